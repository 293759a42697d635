"""The benchmark harness runs end to end: the table with the plain-loop reference, JSON and a PNG chart."""

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import HELPERS_ENV, REPO, write_tiny_cifar10


@pytest.mark.slow
def test_throughput_harness_prints_its_table_and_writes_json_and_chart(tmp_path):
    """One round on the tiny ResNet of the plain loop, the application, ddp and the plain PyTorch counterparts of
    ddp, the pipeline and model parallel (each counterpart's losses: test_plain_peers; fsdp's runs as ddp's does, in
    forked processes of ``plain_peers.py``)."""
    peers = ["plain-ddp", "plain-pipeline", "plain-mmp"]
    command = [
        sys.executable,
        str(REPO / "benchmarks" / "throughput.py"),
        "--configs",
        "plain",
        "app",
        "ddp",
        *peers,
        "--accelerator=cpu",
        "--steps=1",
        "--warmup=1",
        "--batch-size=4",  # the pipeline's 4 micro-batches
        "--arch=helpers.tiny_resnet",
        "--rounds=1",  # more rounds and their intervals: test_throughput_runs_rounds_until_every_claim_is_within...
        "--within=0",  # exactly 1 round
        f"--out={tmp_path}",
    ]
    env = {**os.environ, **HELPERS_ENV}
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "round 1 of 1 (img/s): plain " in result.stdout and "\n1 rounds in " in result.stdout
    table = result.stdout[result.stdout.index("config") :].splitlines()
    assert table[0].split()[-2:] == ["vs", "peer"]
    assert [line.split()[0] for line in table[1:7]] == ["plain", "app", "ddp", *peers]
    figures = json.loads((tmp_path / "throughput.json").read_text())
    assert figures["rounds"] == 1 and figures["minutes"] > 0
    rows = {row["name"]: row for row in figures["results"]}
    assert rows["plain"]["vs_plain"] is None and rows["app"]["efficiency"] is None
    assert rows["plain"]["vs_plain_interval"] is None and rows["app"]["efficiency_interval"] is None
    assert [name for name, row in rows.items() if row["vs_peer"] is not None] == ["ddp"]  # the one with its peer
    ratios = [("app", "vs_plain"), ("ddp", "vs_plain"), ("ddp", "efficiency"), ("ddp", "vs_peer")]
    ratios += [(name, "efficiency") for name in peers[:2]]  # against the plain loop, as ours against the app
    for name, field in ratios:  # taken round by round
        low, high = rows[name][f"{field}_interval"]
        assert low <= rows[name][field] <= high, (name, field)
    for row in rows.values():  # the median round's figures, inside the rounds' interval
        assert len(row["rounds_images_per_s"]) == 1 and row["images_per_s"] in row["rounds_images_per_s"]
        assert row["images_per_s_interval"] == [min(row["rounds_images_per_s"]), max(row["rounds_images_per_s"])]
    # Images per step over all processes: the batch of 4 once (a pipeline's stages read the same), and once per
    # data-parallel process.
    once, twice = ("plain", "app", "plain-pipeline", "plain-mmp"), ("ddp", "plain-ddp")
    for name in (*once, *twice):
        images = 4 if name in once else 8
        assert rows[name]["images_per_s"] * rows[name]["step_time_s"] == pytest.approx(images), name
    for name in ("ddp", *peers):  # one figure per process
        assert len(rows[name]["peak_memory_bytes"]) == (1 if name == "plain-mmp" else 2), name
    assert (tmp_path / "throughput.png").read_bytes().startswith(b"\x89PNG")
    machine = figures["machine"]  # the cores checked before and after the rounds
    assert set(machine["cores_share"]) == {"before", "after"} and isinstance(machine["busy"], bool)


@pytest.mark.slow
def test_unknown_configuration_is_refused_with_the_way_out(tmp_path):
    command = [sys.executable, str(REPO / "benchmarks" / "throughput.py"), "--configs", "nope", f"--out={tmp_path}"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip() == "error: unknown configuration 'nope'; --list shows them all."


@pytest.mark.slow
def test_memory_harness_counts_what_each_pipeline_stage_and_each_fsdp_process_holds(tmp_path):
    command = [
        sys.executable,
        str(REPO / "benchmarks" / "memory.py"),
        "--layouts",
        "one-device",
        "pipeline-2",
        "fsdp-2",
        "--recompute=no",
        "--accelerator=cpu",
        "--batch-size=8",
        "--stem=imagenet",
        f"--out={tmp_path}",
    ]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| pipeline-2 | no | 1 | 28-33 |" in result.stdout  # split by parameters, inside layer4.0
    rows = {row["layout"]: row["ranks"] for row in json.loads((tmp_path / "memory.json").read_text())["results"]}
    (whole,) = rows["one-device"][0]["stages"]
    assert whole["params"] == whole["grads"] == whole["optimizer"] > 0  # SGD with momentum: one buffer each
    stages = [rank["stages"][0] for rank in rows["pipeline-2"]]
    for kind in ("params", "grads", "optimizer"):  # the two processes together hold one copy, none the whole
        assert sum(stage[kind] for stage in stages) == whole[kind]
        assert all(0 < stage[kind] < whole[kind] for stage in stages)
    # fsdp over 2 processes: each holds its half of every parameter, gradient and momentum (and padding).
    shards = [rank["stages"][0] for rank in rows["fsdp-2"]]
    held = lambda stage: stage["params"] + stage["grads"] + stage["optimizer"]  # noqa: E731
    assert all(held(shard) <= 0.55 * held(whole) for shard in shards)
    assert sum(held(shard) for shard in shards) >= held(whole)


def test_checkpoint_benchmark_times_each_save_and_makes_its_table(tmp_path, monkeypatch):
    """One run of one epoch of 2 steps with a save after each, in the background: the hold of each of its 4 saves
    (2 steps, then the best-k file and last.ckpt of the epoch's end), its wall time and peak memory; and the table of
    the three ways made from such runs, each against the run without saves of its round."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    checkpoint_stall = importlib.import_module("checkpoint_stall")
    monkeypatch.setenv("PYTHONPATH", str(REPO / "tests"))  # helpers.tiny_resnet, for the run
    args = argparse.Namespace(synthetic_size=16, arch="helpers.tiny_resnet", epochs=1)
    run = checkpoint_stall.run_once("background", args, tmp_path, 0)
    assert len(run["held_s"]) == 4 and run["wall_s"] > 0 and run["peak_bytes"] > 0
    slower = {**run, "wall_s": 2 * run["wall_s"]}
    rows = checkpoint_stall.summary({"background": [run], "foreground": [slower], "none": [run]})
    assert [(row["way"], row["saves"], row["vs_none"][0]) for row in rows] == [
        ("background", 4, 1.0),
        ("foreground", 4, 2.0),
        ("none", 4, 1.0),
    ]
    table = checkpoint_stall.markdown({"rows": rows, "rounds": 1, "arch": "tiny", "coverage": 0.0})
    assert "| foreground | 4 |" in table and "| 2.00 (2.00-2.00) |" in table


@pytest.mark.slow
def test_the_sharded_checkpoint_benchmark_saves_and_loads_both_ways(tmp_path):
    """One round of ours and DCP's sharded saves on one process, a small torchvision network: each is timed, and each
    checkpoint reads back whole (the benchmark's load)."""
    command = [sys.executable, str(REPO / "benchmarks" / "sharded_checkpoints.py"), "--arch=squeezenet1_1"]
    result = subprocess.run(
        [*command, "--rounds=1", "--processes=1", f"--out={tmp_path}"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads((tmp_path / "sharded_checkpoints.json").read_text())["rows"]
    assert [row["way"] for row in rows] == ["ours", "dcp"]
    assert all(row[key][0] > 0 for row in rows for key in ("held", "wall", "load")), rows
    assert (tmp_path / "ours-0" / "last.ckpt").is_file() and (tmp_path / "dcp-0" / "whole.pt").is_file()


@pytest.mark.slow
def test_pipeline_benchmark_prints_where_each_process_spends_its_time(tmp_path):
    command = [
        sys.executable,
        str(REPO / "benchmarks" / "pipeline_efficiency.py"),
        "--schedules",
        "ZBVZeroBubble",  # two stages per process; the name in any case
        "--micro-batches=2",
        "--batch-size=4",
        "--steps=1",
        "--rounds=1",
        "--stem=imagenet",
        f"--out={tmp_path}",
    ]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    figures = json.loads((tmp_path / "pipeline_efficiency.json").read_text())
    assert [row["schedule"] for row in figures["results"]] == ["zbvzerobubble"]
    for row in figures["results"]:
        assert len(row["rounds_images_per_s"]) == 1  # each round its own run, the figure their median
        low, high = row["efficiency_interval"]
        assert low <= row["efficiency"] <= high
        assert len(row["clocks"]) == 2  # each process: forward, backward, send/recv, wait, other
        assert all(clock["forward"] > 0 and clock["backward"] > 0 for clock in row["clocks"])
    # Two processes at once over twice one, from a single timed step of 4 images: a ratio of two timings, which
    # another test running beside this one (`pytest -n 2`) moves anywhere (2.4 in one run); a figure to read on a
    # quiet machine, not to assert.
    assert figures["ceilings"]["2"] > 0
    assert (tmp_path / "pipeline_efficiency.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_plan_accuracy_sets_each_forecast_against_its_measurement_over_runs(tmp_path):
    def row(layout, forecast, measured):
        return {"layout": layout, "forecast": forecast, "images_per_s": measured, "interval": [measured, measured]}

    runs = [  # fsdp's forecast too fast in every run; a layout measured in one run only is left out
        [row("1 device", 30.0, 31.0), row("ddp", 24.0, 20.0), row("fsdp", 12.0, 15.0)],
        [row("1 device", 29.0, 27.0), row("ddp", 22.0, 22.0), row("fsdp", 13.0, 15.0), row("dp", 5.0, 5.0)],
        [row("1 device", 31.0, 30.0), row("ddp", 20.0, 21.0), row("fsdp", 12.0, 14.0)],
    ]
    runs[2][1]["busy"] = "the host stole 23% of the cores' time"  # measured again on busy cores, and kept, marked
    paths = []
    for index, results in enumerate(runs):
        paths.append(tmp_path / f"plan{index}.json")
        basis = {"passes_s": {"8 images on 2 thread(s)": 1.0 + index}}
        basis |= {"busy": "the host stole 20% of the cores' time"} if index == 1 else {}  # forecast on busy cores
        paths[-1].write_text(json.dumps({"title": "2 CPU device(s)", "results": results, "basis": basis}))
    command = [sys.executable, str(REPO / "benchmarks" / "plan_accuracy.py"), "--plan-json", *map(str, paths)]
    result = subprocess.run([*command, f"--out={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    figures = json.loads((tmp_path / "plan_accuracy.json").read_text())
    assert [r["layout"] for r in figures["rows"]] == ["1 device", "ddp", "fsdp"]  # by median measurement
    one_device = figures["rows"][0]
    assert one_device["measured"] == 30.0 and one_device["interval"] == [27.0, 31.0]  # 3 runs: lowest..highest
    assert one_device["forecast"] == 30.0 and one_device["forecast_interval"] == [29.0, 31.0]
    assert figures["largest_error"] == pytest.approx(0.2)  # fsdp in run 1 (12 forecast, 15 measured), and ddp's
    assert figures["measurements"] == 9 and figures["within_band"] == 9 and figures["spearman"] == pytest.approx(1.0)
    assert figures["forecast_best"] == figures["measured_best"] == "1 device" and figures["forecast_best_ties"]
    assert "largest error 20%, median 7% (every layout in every run); 9 of 9 within 20%" in result.stdout
    # Each layout's measurements, pair by pair: 1 device 31/27, 31/30, 30/27; ddp 22/20, 22/21, 21/20; fsdp 15/15,
    # 15/14 twice: median 15/14 - 1, largest 31/27 - 1
    assert figures["repeat_median"] == pytest.approx(1 / 14) and figures["repeat_largest"] == pytest.approx(4 / 27)
    assert "the same layout measured in two runs differed by median 7%, largest 15%" in result.stdout
    assert [basis["passes_s"]["8 images on 2 thread(s)"] for basis in figures["bases"]] == [1.0, 2.0, 3.0]
    markdown = (tmp_path / "plan_accuracy.md").read_text().splitlines()
    assert markdown[4] == "| 1 device | 30.0 | 30.0 | 27.0..31.0 | +3% | -3%..+7% |"
    repeat = "The same layout measured in two runs differed by median 7%, largest 15%: the machine's own repeat"
    assert f"{repeat}, which a forecast made minutes before its measurement meets too." in markdown[-1]
    busy = "1 of the 9 measurements ran on busy cores (another process, or a virtual machine's host stealing their"
    assert figures["busy_measurements"] == 1 and busy in result.stdout
    profiles = "and measured that too; 1 plan(s) forecast from a profile on busy cores (`basis.busy` in its plan.json)"
    assert figures["busy_profiles"] == 1 and markdown[-1].endswith(f"{profiles}.")
    assert (tmp_path / "plan_accuracy.png").read_bytes().startswith(b"\x89PNG")


def test_the_machine_a_figure_came_from_names_its_cpu(monkeypatch, tmp_path):
    """Two 2-core machines compute a third apart: the docs say which CPU, from /proc/cpuinfo where there is one."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    machine = importlib.import_module("machine")
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\nflags\t: fpu\n")
    assert machine.cpu_model(cpuinfo) == "AMD EPYC 7B13"
    monkeypatch.setattr(machine.platform, "processor", lambda: "arm")
    assert machine.cpu_model(tmp_path / "missing") == "arm"  # not Linux: what platform says
    cpuinfo.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\n")  # an ARM kernel's
    assert machine.cpu_model(cpuinfo) == "arm"
    monkeypatch.setattr(machine, "cores", lambda: 2)  # any machine's core count
    assert machine.machine()["device"] == f"CPU ({machine.cpu_model()}), 2 cores"
    assert machine.this_cpu("AMD EPYC 7B13") == "CPU (AMD EPYC 7B13), 2 cores"
    assert machine.this_cpu("") == "CPU, 2 cores"  # nothing known: no empty brackets


def test_smoke_plan_describes_its_runs_and_abridges_the_first_printout(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    smoke_plan = importlib.import_module("smoke_plan")
    table = [
        "   #  layout      forecast   img/s",
        "  1=  model parallel 2   10.0    10.5",
        "  2=  1 device            9.1    10.0",
        *(f"      pipeline {n}          7.{n}       -" for n in range(5)),
    ]
    left = "  not measured, the time budget spent: pipeline 0, pipeline 1, pipeline 2 (raise --plan.budget_s to ...)"
    began = "measuring 5 of 7 layouts, within 90 s in all (31 s so far: Python's start-up, the profile and the links)"
    printout = "\n".join([began, left, "", *table, "", "fit options:"])
    printout += "\n" + "\n".join(f"  layout {n}: --trainer.devices=2" for n in range(7)) + "\n\nplan: measured 2"

    def run(seconds, chosen, tied, errors, began, by_forecast=False):
        return {
            "seconds": seconds, "began_measuring_s": began, "budget_s": 90.0, "layouts": 7, "selected": 5,
            "measured": 2, "busy": by_forecast, "by_forecast": by_forecast,
            "left_by_budget": ["pipeline 0", "pipeline 1", "pipeline 2"], "errors": errors, "chosen": chosen,
            "tied": tied, "printout": printout,
        }  # fmt: skip

    busy = "error: plan: the cores are busy after profiling: ..."
    runs = [
        run(85.0, "1 device", ["model parallel 2"], {"1 device": -0.09, "model parallel 2": -0.04}, 36.0),
        {"seconds": 70.0, "refused": busy, "busy": True, "printout": ""},
        run(95.0, "model parallel 2", [], {"1 device": 0.02, "model parallel 2": 0.12}, 31.0),
        run(99.0, "model parallel 2", [], {"1 device": -0.3, "model parallel 2": 0.5}, 40.0, by_forecast=True),
    ]
    figures = smoke_plan.summary(runs)
    assert figures["within_budget"] == 1 and figures["refused"] == 1
    assert figures["largest_error"] == (0.5, "model parallel 2")
    assert (figures["within_10"], figures["within_15"], figures["errors"]) == (3, 4, 6)
    paragraph, shown = smoke_plan.markdown({"devices": 2, "runs": runs}).split("\n\nThe first printed:\n\n```\n")
    assert paragraph.startswith("`python main.py plan --config configs/smoke.yaml --trainer.accelerator=cpu ")
    assert "ran 4 times: median 90 s, interval 70-99 s (88%), Python's start included. 1 wrote no plan: " in paragraph
    assert f"1x `{busy}`. 1 of 3 finished within its 90 s budget. They began measuring 31 to 40 s after" in paragraph
    assert "the start (Python's start-up, the profile and the links). Each chose 5 of 7 layouts to measure" in paragraph
    assert "and measured 2, leaving 3 to the time budget." in paragraph
    assert "largest +50.0%, `model parallel 2`; median 10.5%" in paragraph
    assert (
        "Of the 3 that chose, 2 chose `model parallel 2`, 1 of them with no other median within its range (1 by "
        "forecast: every layout measured on busy cores); 1 chose `1 device` (tied with model parallel 2 in 1, and the "
        "simplest). 2 found the cores busy." in paragraph
    )
    lines = shown.splitlines()
    assert (
        lines[1] == "  not measured, the time budget spent: pipeline 0, pipeline 1, ... (raise --plan.budget_s to ...)"
    )
    assert lines[3:9] == [*table[:4], "      ... (3 more, down to)", table[-1]]
    options = [f"  layout {n}: --trainer.devices=2" for n in range(2)]
    assert lines[10:14] == ["fit options:", *options, "  ..."]


def test_smoke_plan_reads_what_plan_measured_from_its_plan_json(monkeypatch):
    """A run's budget, layouts selected and left by the budget come from ``plan.json``, not the printout."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    smoke_plan = importlib.import_module("smoke_plan")

    def row(layout, images_per_s, selected, left=False, chosen=False, tied=False, error=None):
        return {
            "layout": layout, "images_per_s": images_per_s, "selected": selected, "left_by_budget": left,
            "chosen": chosen, "tied_with_fastest": tied, "error": error,
        }  # fmt: skip

    rows = [
        row("1 device", 10.0, True, chosen=True, tied=True, error=-0.05),
        row("ddp", 9.8, True, tied=True, error=0.08),
        row("fsdp", None, True, left=True),
        row("dp", None, False),
    ]

    def plan(command, cwd, **_):
        folder = Path(cwd) / "logs" / "smoke"
        folder.mkdir(parents=True)
        (folder / "plan.json").write_text(
            json.dumps({"title": "", "budget_s": 90.0, "chosen_by": "measurement", "results": rows})
        )
        said = "measuring 3 of 4 layouts, within 90 s in all (33 s so far: ...)\nplan: measured 2 of 4 layouts\n"
        return subprocess.CompletedProcess(command, 0, said, "")

    monkeypatch.setattr(smoke_plan.subprocess, "run", plan)
    run = smoke_plan.one_run(2)
    assert (run["budget_s"], run["layouts"], run["selected"], run["measured"]) == (90.0, 4, 3, 2)
    assert run["began_measuring_s"] == 33.0
    assert run["left_by_budget"] == ["fsdp"] and run["errors"] == {"1 device": -0.05, "ddp": 0.08}
    assert (run["chosen"], run["tied"], run["by_forecast"]) == ("1 device", ["ddp"], False)


def test_cuda_paths_keeps_a_failing_path_with_its_reason_and_writes_every_round(monkeypatch):
    """``throughput.measure(keep_going=True)``, as ``cuda_paths.py`` runs it: a path that fails or hangs becomes a
    row with its round and reason and is left out of later rounds; every round's rows are handed on."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    throughput, cuda_paths = importlib.import_module("throughput"), importlib.import_module("cuda_paths")
    speeds = iter([100.0, 90.0, 50.0, 110.0, 95.0, 120.0, 100.0])  # in the order the paths run, below
    ran = []

    def run(command, out, log, threads, pythonpath, cwd, timeout):
        ran.append(out.stem)
        if out.stem == "ddp":
            raise throughput.RunFailed(f"main.py fit ... was still running after {timeout:.0f} s, and was stopped")
        if out.stem == "fsdp" and len(ran) > 4:  # fails in its second round, after a first that worked
            log.write_text("Traceback ...\nRuntimeError: NCCL error: unhandled cuda error\nwarning: at exit\n")
            raise throughput.RunFailed("fsdp failed")
        return {"images_per_s": next(speeds), "step_time_s": 0.05, "peak_memory_bytes": [2**30]}

    monkeypatch.setattr(throughput, "run", run)
    args = argparse.Namespace(
        processes=1, cuda=True, precision="32-true", batch_size=8, steps=2, warmup=1, stem="cifar", arch="resnet50",
        workers=0,
        rounds=3, threads=1, timeout_s=60.0,
    )  # fmt: skip
    written = []
    names = ["plain", "app", "fsdp", "ddp"]
    rows = throughput.measure(names, args, keep_going=True, after_round=lambda rows, n: written.append((n, rows)))
    assert ran == ["plain", "app", "fsdp", "ddp", "app", "fsdp", "plain", "plain", "app"]  # rotated, failures dropped
    hung = "main.py fit ... was still running after 60 s, and was stopped"
    nccl = "RuntimeError: NCCL error: unhandled cuda error"  # the line that says why, not the output's last
    assert [(n, [row.get("error", "ok") for row in rows]) for n, rows in written] == [
        (1, ["ok", "ok", "ok", hung]),
        (2, ["ok", "ok", nccl, hung]),
        (3, ["ok", "ok", nccl, hung]),
    ]
    plain, app, fsdp, ddp = rows
    assert (fsdp["failed_in_round"], ddp["failed_in_round"]) == (2, 1)
    assert app["vs_plain"] == pytest.approx(0.9)  # 90/100, 110/95, 100/120 round by round
    assert app["vs_plain_interval"] == pytest.approx([100 / 120, 110 / 95])
    data = {"settings": {**vars(args), "rounds": 3}, "rounds_finished": 3, "results": rows}
    page = cuda_paths.markdown(data)
    assert "3 of 3 rounds; each figure the median of its rounds; in brackets the rounds' interval, which holds " in page
    assert "| app: main.py fit, one process | yes | 100 (90-110) | 0.900 (0.833-1.158) | - |" in page
    assert f"| fsdp: main.py fit, fsdp (FSDP2), 1 process | **no**, round 2: {nccl} | - |" in page
    first = cuda_paths.markdown({**data, "rounds_finished": 1, "results": written[0][1]})
    assert "1 of 3 rounds; one run of each path, so no interval" in first
    assert "| fsdp: main.py fit, fsdp (FSDP2), 1 process | yes | 50 | 0.500 | 0.556 |" in first


def test_throughput_runs_rounds_until_every_claim_is_within_its_target_or_the_most_rounds(monkeypatch):
    """``--within``: after ``--rounds``, another round while the widest interval of a claim (an efficiency, or a
    one-process ratio to the plain loop) lies further than that from its median; ``--max-rounds`` at most."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    throughput = importlib.import_module("throughput")
    ratios = [1.0, 1.1, 0.9, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]  # app against plain, round by round
    ran: dict[str, int] = {}

    def run(command, out, log, threads, pythonpath, cwd, timeout):
        ran[out.stem] = ran.get(out.stem, 0) + 1
        speed = 100.0 if out.stem == "plain" else {"app": 100.0, "ddp": 190.0}[out.stem] * ratios[ran[out.stem] - 1]
        return {"images_per_s": speed, "step_time_s": 0.05, "peak_memory_bytes": [2**30]}

    monkeypatch.setattr(throughput, "run", run)
    args = argparse.Namespace(
        processes=2, cuda=False, precision="32-true", batch_size=8, steps=2, warmup=1, stem="cifar", arch="resnet50",
        workers=0,
        rounds=5, max_rounds=20, threads=1, timeout_s=60.0,
    )  # fmt: skip
    enough = throughput.claims_within(0.03)  # what --within 0.03 stops on
    names = ["plain", "app", "ddp"]
    rows = throughput.measure(names, args, enough=enough)
    # 0.9 and 1.1 are the ends of app's interval until 9 rounds, whose 95% interval drops one round at each end.
    # ddp's efficiency (0.95 in every round) is judged; its ratio to the plain loop, as wide as app's, is not.
    assert ran == {"plain": 9, "app": 9, "ddp": 9}
    assert throughput.widest_interval(rows) == (0.0, "ddp efficiency")
    ran.clear()
    args.max_rounds = 7
    rows = throughput.measure(names, args, enough=enough)
    assert ran == {"plain": 7, "app": 7, "ddp": 7}
    assert throughput.widest_interval(rows) == (pytest.approx(0.1), "app vs plain")
    settings = {**vars(args), "within": 0.03}
    page = throughput.markdown({"settings": settings, "rounds": 7, "minutes": 42.0, "results": rows})
    assert "7 rounds in 42 minutes; " in page
    assert "the widest lies within ±10.0% of its median (app vs plain) (asked: ±3.0%, in at most 7 rounds):" in page


@pytest.mark.slow
def test_learning_benchmark_pairs_the_app_with_the_plain_loop_and_reports_the_difference(tmp_path):
    data = write_tiny_cifar10(tmp_path / "cifar", per_batch=8, test=8)
    command = [
        sys.executable, str(REPO / "benchmarks" / "learning.py"), f"--data-dir={data}", "--seeds", "1",
        "--epochs=1", "--batch-size=8", "--warmup-epochs=0", f"--out={tmp_path / 'out'}",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    figures = json.loads((tmp_path / "out" / "learning.json").read_text())
    runs = {(run["side"], run["seed"]): run for run in figures["runs"]}
    assert set(runs) == {("app", 1), ("plain-paired", 1), ("plain-independent", 1)}
    assert all(len(run["epochs"]) == 1 for run in runs.values())
    # That the paired runs learn alike, step for step, is test_learning_parity's promise; here, the report's.
    for protocol in ("paired", "independent"):
        low, high = figures["summary"][protocol]["interval"]
        assert low <= figures["summary"][protocol]["mean_difference"] <= high, protocol
    assert (tmp_path / "out" / "learning.png").read_bytes().startswith(b"\x89PNG")


def test_every_table_in_docs_is_its_json_and_one_command_fills_them_all(tmp_path):
    """The pages hold what ``benchmarks/figures.py`` makes of docs/figures/*.json, with intervals, machine and
    command: filling them again changes nothing. A page that lost its block is refused in one line."""
    docs = tmp_path / "docs"
    shutil.copytree(REPO / "docs", docs)
    fill = [sys.executable, str(REPO / "benchmarks" / "figures.py"), "--docs-only", f"--docs={docs}"]
    result = subprocess.run(fill, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    for page in (REPO / "docs").glob("*.md"):
        assert (docs / page.name).read_text() == page.read_text(), (
            f"{page.name}: run python benchmarks/figures.py --docs-only"
        )
    assert result.stdout.count("filled") == 8  # throughput, pipeline efficiency, smoke plan, plan accuracy, learning,
    # memory, checkpoint stall, cuda paths
    (docs / "learning.md").write_text("# Learning\n")
    result = subprocess.run([*fill, "learning"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"error: {docs / 'learning.md'} has no block <!-- figures: learning --> ... <!-- end figures: learning --> "
        "for learning's table: add one where it belongs."
    )
