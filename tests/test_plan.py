"""``python main.py plan``: the layouts it lists and leaves out, its memory estimates and forecasts, the layouts
it measures, its table with ties, and its config."""

import json
import re
import shlex
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from helpers import DEFAULT_CONFIG, SMOKE, cli_main, run_args, run_cli
from lightning.fabric.utilities.rank_zero import LightningDeprecationWarning

from multigpu.errors import UsageError
from multigpu.model.resnet import resnet50_block_factories
from multigpu.planning import command
from multigpu.planning.command import PlanCLI
from multigpu.planning.layouts import candidate_layouts
from multigpu.planning.links import Links
from multigpu.planning.memory_estimate import block_memory
from multigpu.planning.ranking import FORECAST_ERROR
from multigpu.planning.selection import Setting, choose

pytestmark = pytest.mark.internals  # CI runs these on the lowest torch we declare too

# The suite's other worker keeps the cores busy: the plans here say so and go on (test_busy_cores checks the rest).
BUSY_GO = "--plan.if_busy=go"

TWO_CPU_PROCESSES = {
    "1 device",
    "ddp",
    "fsdp",
    "model parallel 2",
    *(f"pipeline 2 {schedule} m{count}" for schedule in ("gpipe", "1f1b") for count in (2, 4, 8)),
    *(
        f"pipeline 4/2p {schedule} m{count}"
        for schedule in ("interleaved1f1b", "loopedbfs", "interleavedzerobubble", "zbvzerobubble")
        for count in (2, 4, 8)
    ),
    "pipeline 4/2p dualpipev m4",
    "pipeline 4/2p dualpipev m8",
}


def test_plan_forks_the_link_probes_ranks_before_it_runs_a_network_and_ends_them_when_it_ends(monkeypatch, tmp_path):
    """On the CPU, before ``setting_of`` (which runs a network other than ResNet-50 once, to check it): a fork after
    a parallel region hangs a forked rank's first one on more than one thread. Ended whatever ends plan."""
    calls = []

    class Ranks:
        def __init__(self, processes: int) -> None:
            calls.append(f"fork {processes}")

        def dismiss(self) -> None:
            calls.append("dismiss")

    def setting_of(run):
        calls.append(f"setting {run.network.arch}")
        raise UsageError("stop here")

    monkeypatch.setattr(command, "fork_ranks", lambda processes, cuda: Ranks(processes))
    monkeypatch.setattr(command, "setting_of", setting_of)
    args = ["--config", SMOKE, "--trainer.accelerator=cpu", "--trainer.devices=2", *run_args(tmp_path)]
    with pytest.raises(UsageError, match="stop here"):
        command.plan([*args, "--model.arch=resnet18"], [DEFAULT_CONFIG])
    assert calls == ["fork 2", "setting resnet18", "dismiss"]


def test_two_cpu_processes_allow_every_layout_but_dp_and_those_that_need_more_devices():
    layouts, refusals = candidate_layouts(devices=2, cuda=False, batch_size=8, compiled=False)
    assert {layout.name for layout in layouts} == TWO_CPU_PROCESSES
    assert layouts[0].name == "1 device"  # the reference comes first
    reasons = {refusal.what: refusal.why for refusal in refusals}
    assert reasons == {
        "dp": "needs CUDA devices (without them dp trains on one device)",
        "manual_model_parallel over 4 devices per replica": "--trainer.devices=2 is not a multiple of the 4 devices "
        "per replica of manual_model_parallel: use a multiple of 4, or change devices_per_replica (or balance)",
        "pipeline over 4 processes": "the pipeline has 4 stages over 4 processes, but devices x nodes = 2 processes is "
        "not a multiple of 4: use a multiple of 4 devices, or change num_stages",
        "pipeline 4 stages dualpipev m2": "schedule dualpipev needs at least as many micro-batches as stages: "
        "micro_batches=2 < 4 stages. Raise micro_batches",
    }


def test_four_gpus_add_dp_fsdp_replicated_model_parallel_and_four_stage_pipelines():
    layouts, refusals = candidate_layouts(devices=4, cuda=True, batch_size=10, compiled=False)
    by_name = {layout.name: layout for layout in layouts}
    assert {
        "dp",
        "fsdp",
        "model parallel 2 x2",
        "model parallel 4",
        "pipeline 2 x2 1f1b m4",
        "pipeline 4 1f1b m4",
        "pipeline 8/4p interleaved1f1b m4",
    } <= set(by_name)
    # The same global batch of 40 everywhere: 10 per device, 20 per 2-device replica, 40 in dp's one process.
    assert by_name["ddp"].batch_size == 10 and by_name["dp"].batch_size == 40
    assert by_name["model parallel 2 x2"].batch_size == by_name["pipeline 2 x2 1f1b m4"].batch_size == 20
    assert by_name["model parallel 2 x2"].processes == 2 and by_name["pipeline 2 x2 1f1b m4"].replicas == 2
    reasons = {refusal.what: refusal.why for refusal in refusals}
    assert (
        reasons["pipeline 2 stages gpipe m8"]
        == "its batch of 20 images (2 x --data.batch_size) is not divisible by 8 micro-batches"
    )
    assert "pipeline 8 stages dualpipev m16" in reasons


def test_compiled_networks_leave_out_the_strategies_that_place_blocks_themselves():
    layouts, refusals = candidate_layouts(devices=2, cuda=False, batch_size=8, compiled=True)
    assert [layout.name for layout in layouts] == ["1 device", "ddp"]
    assert all("cannot run --model.compile" in refusal.why for refusal in refusals if "CUDA" not in refusal.why)
    compile_refused = {refusal.what for refusal in refusals if "cannot run --model.compile" in refusal.why}
    assert compile_refused == {
        "fsdp",
        "manual_model_parallel over 2 devices per replica",
        "manual_model_parallel over 4 devices per replica",
        "pipeline over 2 processes",
        "pipeline over 4 processes",
    }


@pytest.fixture(scope="module")
def memory():
    return block_memory(resnet50_block_factories(num_classes=10, stem="cifar"), half_activations=False)


def _setting(memory, batch_size: int = 128) -> Setting:
    return Setting(
        cuda=True,
        devices=2,
        device_ids=None,
        batch_size=batch_size,
        precision="32-true",
        memory=memory,
        optimizer_states=1,
        overhead=0,
    )


def test_memory_estimate_splits_the_state_and_recomputation_shrinks_the_activations(memory):
    params = sum(memory.params)
    assert 89 * 2**20 < params < 90 * 2**20  # ResNet-50 with 10 classes: 23.5 million float32 parameters
    layouts, _ = candidate_layouts(devices=2, cuda=True, batch_size=128, compiled=False)
    by_name = {layout.name: layout for layout in layouts}
    one = by_name["1 device"].device_memory(memory, optimizer_states=1)
    (whole,) = one[0]
    assert whole > 3 * params  # parameters, gradients, momentum, and activations
    pipeline = replace(by_name["pipeline 2 gpipe m4"], balance=(28, 6), batch_size=128)
    stages = pipeline.device_memory(memory, optimizer_states=1)
    assert len(stages) == 2 and all(stage[0] < whole for stage in stages)
    recomputed = replace(by_name["1 device"], recompute=True).device_memory(memory, optimizer_states=1)
    assert recomputed[0][0] < 0.6 * whole  # measured on this CPU: 4,482 -> 2,552 MiB (-43%)
    # fsdp over 2 devices: half the state of one, plus the largest block's parameters three times over.
    sharded = by_name["fsdp"].device_memory(memory, optimizer_states=1)
    assert [len(process) for process in sharded] == [1, 1]
    assert abs(sharded[0][0] - (whole - 1.5 * params + 3 * max(memory.params))) <= 1


def test_layouts_that_would_not_fit_are_left_out_and_tried_with_recomputation(memory):
    setting = _setting(memory)
    layouts, _ = candidate_layouts(devices=2, cuda=True, batch_size=128, compiled=False, strategies=["ddp"])
    (one_device, ddp) = layouts
    limit = (setting.estimated_peaks(one_device)[0] + setting.estimated_peaks(ddp)[0]) // 2
    chosen, refusals = choose(layouts, setting, (limit, True), "auto", compiled=False)
    assert [layout.label for layout in chosen] == ["1 device", "ddp +recompute"]
    reasons = {refusal.what: refusal.why for refusal in refusals}
    assert reasons["ddp"].startswith("would need about ") and reasons["ddp"].endswith(" MiB per device free")
    assert "+recompute (activation recomputation) of 1 layouts" in reasons  # the one that fits without it
    chosen, refusals = choose(layouts, setting, (1, True), "auto", compiled=False)
    assert chosen == [] and len(refusals) == 4  # each layout, with and without recomputation


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (
            "--plan.strategies=[nope]",
            "error: --plan.strategies: 'nope' is not one of ddp, dp, fsdp, manual_model_parallel, pipeline.",
        ),
        (
            "--trainer.num_nodes=2",
            "error: plan measures the layouts on this machine alone: drop --trainer.num_nodes, "
            "and add it to the fit command of the layout it chooses.",
        ),
        ("--plan.micro_batches=[0]", "error: --plan.micro_batches must be at least 1, not 0."),
        ("--plan.memory_per_device=-1", "error: --plan.memory_per_device must be more than 0 GiB, not -1.0."),
        ("--plan.memory_per_device=0", "error: --plan.memory_per_device must be more than 0 GiB, not 0.0."),
        ("--plan.budget_s=0", "error: --plan.budget_s must be more than 0 seconds (or null: no bound), not 0.0."),
    ],
)
def test_bad_plan_options_end_with_one_line(capsys, option, message):
    with pytest.raises(SystemExit) as exit_info:
        cli_main("plan", "--config", SMOKE, "--trainer.devices=2", option)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == message


def test_the_old_name_of_the_recomputation_option_still_works_with_a_deprecation_line(tmp_path):
    old_config = tmp_path / "old.yaml"
    old_config.write_text("plan:\n  activation_checkpointing: both\n")
    for args, recomputes in (
        (["--plan.activation_checkpointing=yes"], "yes"),
        (["--config", str(old_config)], "both"),
        (["--config", str(old_config), "--plan.recompute_activations=no"], "no"),  # the command line wins
    ):
        with pytest.warns(LightningDeprecationWarning, match="use --plan.recompute_activations"):
            cli = PlanCLI(args=["--config", SMOKE, *args], run=False)
        assert cli.config["plan"]["recompute_activations"] == recomputes, args
        assert "activation_checkpointing" not in cli.config["plan"]


def test_a_plan_that_trains_no_layout_says_so_and_fails(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(
            "plan",
            "--config",
            SMOKE,
            "--trainer.accelerator=cpu",
            "--trainer.devices=2",
            *run_args(tmp_path),
            "--plan.strategies=[ddp]",
            "--plan.memory_per_device=0.01",
            BUSY_GO,
        )
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert "  ddp: would need about " in out and "1 device: would need about " in out
    assert err.strip().splitlines()[-1] == (
        "error: no layout trained, so nothing was written: each was left out or failed, as listed above."
    )
    assert not (tmp_path / "logs" / "test").exists()


def test_a_config_file_with_a_plan_section_is_refused(capsys, tmp_path):
    config = tmp_path / "plan_options.yaml"
    config.write_text("plan:\n  steps: 2\n")
    with pytest.raises(SystemExit):
        cli_main("plan", "--config", SMOKE, "--config", str(config))
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {config} has a plan section, which fit (run for each layout) refuses: give the --plan.* options on "
        "the command line instead."
    )


def _table(stdout: str) -> list[list[str]]:
    """The rows of plan's table, split at runs of two spaces or more: place, layout, then the figures."""
    start = stdout.index("   #  layout")
    lines = stdout[start : stdout.index("\n\n", start)].splitlines()[1:]
    return [[cell for cell in re.split(r"\s{2,}", line.strip()) if cell] for line in lines]


@pytest.mark.slow
def test_dry_run_forecasts_every_layout_with_its_estimate_and_runs_none(tmp_path):
    result = run_cli(
        "plan",
        "--config",
        SMOKE,
        "--trainer.accelerator=cpu",
        "--trainer.devices=2",
        *run_args(tmp_path),
        "--plan.dry_run=true",
        "--plan.micro_batches=[2,16]",
        "--model.arch=resnet18",  # what a dry run does, for a network that profiles in a third of ResNet-50's time
        "--model.stem=imagenet",
        BUSY_GO,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout
    rows = _table(result.stdout)
    assert {row[0] for row in rows} == {
        name for name in TWO_CPU_PROCESSES if not name.startswith("pipeline") or name.endswith(" m2")
    }
    forecast = [float(row[1]) for row in rows]  # layout, forecast, "-" (not measured), estimate
    assert forecast == sorted(forecast, reverse=True) and min(forecast) > 0
    assert all(row[2] == "-" for row in rows)
    # 16 micro-batches of a pipeline's 16 images: with the ImageNet stem, layer4 sees 1x1 images, and
    # BatchNorm cannot train on one value per channel.
    single_images = {name.replace(" m8", " m16") for name in TWO_CPU_PROCESSES if name.endswith(" m8")}
    for name in single_images:
        assert (
            f"  {name}: micro-batches of 1 image(s) do not train: Expected more than 1 value per channel"
            in result.stdout
        )
    assert "  dp: needs CUDA devices (without them dp trains on one device)" in result.stdout
    assert "measuring the links between 2 CPU processes" in result.stdout
    assert not (tmp_path / "logs" / "test" / "plan.yaml").exists()
    best = max(rows, key=lambda row: float(row[1]))
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith(f"plan (dry run): forecast {len(rows)} layouts and left out ")
    assert (
        f"the fastest forecast: {best[0]}, {best[1]} img/s; " in last and "; nothing trained, nothing written" in last
    )
    # The suite's other worker may keep the cores busy: the line then says the forecasts were made on busy cores.
    busy = "plan: the cores are busy" in result.stdout
    assert ("; forecast on busy cores (" in last) == busy, result.stdout


@pytest.mark.slow
def test_plan_forecasts_measures_the_best_marks_ties_and_writes_a_config_that_fit_trains_with(tmp_path):
    """For ResNet-18 (``--model.arch``: any network is profiled, forecast and measured as ResNet-50 is; a network of
    a few thousand parameters takes longer, its windows needing many more steps)."""
    arch = ["--model.arch=resnet18", "--model.stem=imagenet"]
    result = run_cli(
        "plan",
        "--config",
        SMOKE,
        "--trainer.accelerator=cpu",
        "--trainer.devices=2",
        *run_args(tmp_path),
        *arch,
        "--plan.strategies=[ddp,pipeline]",
        "--plan.schedules=[1f1b]",
        "--plan.micro_batches=[2,4]",
        "--plan.top=1",
        "--plan.warmup=1",
        "--plan.windows=3",
        "--data.num_workers=1",
        "--plan.budget_s=null",  # every layout chosen, whatever this machine's load: the budget has its own test
        BUSY_GO,
        cwd=tmp_path,
        timeout=600,  # the recipe's loader workers
    )
    assert result.returncode == 0, result.stdout
    rows = {(row[1] if row[0][0].isdigit() else row[0]).removesuffix(" (busy)"): row for row in _table(result.stdout)}
    assert set(rows) == {"1 device", "ddp", "pipeline 2 1f1b m2", "pipeline 2 1f1b m4"}  # marked where the suite's
    # other worker kept the cores busy while it trained
    folder = tmp_path / "logs" / "test"
    plan = json.loads((folder / "plan.json").read_text())
    figures = {row["layout"]: row for row in plan["results"]}
    measured = {name for name, row in figures.items() if row["figures"]}
    assert plan["budget_s"] is None and not any(row["left_by_budget"] for row in plan["results"])
    # What the forecasts were built from: the passes at each size a layout runs (1 device, ddp and a pipeline of 2
    # micro-batches: 8 images; of 4: 4 images a micro-batch), on each process's share of the 2 cores, and the links
    passes = plan["basis"]["passes_s"]
    assert {"8 images on 2 thread(s)", "8 images on 1 thread(s)", "4 images on 1 thread(s)"} <= set(passes)
    assert all(seconds > 0 for seconds in passes.values())
    assert plan["basis"]["split_backward"] == {}  # no zero-bubble schedule among these layouts
    updates = plan["basis"]["update_s"]  # the whole network's one SGD step, at each thread count
    assert set(updates) == {"on 2 thread(s)", "on 1 thread(s)"} and all(seconds > 0 for seconds in updates.values())
    links = plan["basis"]["links"]
    assert links["world"] == 2 and links["contention"] >= 1 and links["reduces"]["bandwidth"] > 0
    assert {name for name, row in figures.items() if row["selected"]} == measured
    best = max(figures, key=lambda name: figures[name]["forecast"])
    within = {
        name for name, row in figures.items() if row["forecast"] >= (1 - FORECAST_ERROR) * figures[best]["forecast"]
    }
    assert measured == {"1 device", best} | within  # the reference, the top 1 and those within the error
    for name, row in figures.items():
        if name in measured:
            assert len(row["figures"]["window_images_per_s"]) == 3
            low, high = row["interval"]
            assert low <= row["images_per_s"] <= high and row["error"] == pytest.approx(
                row["forecast"] / row["images_per_s"] - 1
            )
            processes = 1 if name == "1 device" else 2  # one measured peak and one estimate per process
            assert len(row["figures"]["peak_memory_bytes"]) == len(row["estimate"]) == processes
        else:
            assert row["figures"] is None and rows[name][2] == "-"
    chosen = [name for name, row in figures.items() if row["chosen"]]
    # Beside the suite's other worker every run may have trained on busy cores: then the best forecast is chosen
    if by_forecast := all(figures[name]["busy"] for name in measured):
        tied, expected = set(), max(measured, key=lambda name: figures[name]["forecast"])
    else:
        fastest = max(measured, key=lambda name: figures[name]["images_per_s"])
        tied = {name for name in measured if figures[name]["images_per_s"] >= figures[fastest]["interval"][0]}
        expected = min(  # the fewest processes, then the least memory
            tied, key=lambda name: (1 if name == "1 device" else 2, sum(figures[name]["figures"]["peak_memory_bytes"]))
        )
    assert plan["chosen_by"] == ("forecast" if by_forecast else "measurement")
    assert {name for name, row in figures.items() if row["tied_with_fastest"]} == tied
    assert {name for name in measured if rows[name][0].endswith("=")} == (tied if len(tied) > 1 else set())
    assert chosen == [expected]
    assert f"chosen: {chosen[0]}: {'by forecast' if by_forecast else ''}" in result.stdout
    assert (
        result.stdout.strip()
        .splitlines()[-1]
        .startswith(f"plan: measured {len(measured)} of {len(figures)} layouts in ")
    )
    assert f" s (no time budget), and chose {chosen[0]} (" in result.stdout.strip().splitlines()[-1]
    assert (folder / "plan.png").read_bytes().startswith(b"\x89PNG")
    config = yaml.safe_load((folder / "plan.yaml").read_text())
    assert config["model"] == {"recompute_activations": False}
    assert config["trainer"]["accelerator"] == "cpu"
    # The command it printed, run as printed: plan's options but its own, the plan's config, a run name of its own.
    command = shlex.split(result.stdout.strip().splitlines()[-1].partition("Train with it: ")[2])
    assert command[:3] == ["python", "main.py", "fit"] and command[-1] == "--run_name=test-plan", command
    assert not [word for word in command if word.startswith(("--plan.", "--trainer.devices"))], command
    assert (folder / "plan.yaml").read_text().splitlines()[1] == f"# Train with it: {shlex.join(command)}"
    trained = run_cli(*command[2:], cwd=tmp_path)
    assert trained.returncode == 0, trained.stdout
    assert torch.load(tmp_path / "checkpoints" / "test-plan" / "last.ckpt")["hyper_parameters"]["arch"] == "resnet18"


def test_a_time_budget_measures_the_reference_and_the_best_forecast_then_what_fits(monkeypatch, capsys, tmp_path):
    """``--plan.budget_s``: the layouts in measuring order, the reference and the best forecast whatever the time,
    then each one whose forecast training time still ends before the deadline; the rest are named, unmeasured,
    and ``plan.json`` says which. Where the first two end past the deadline, a line says by how much."""
    from multigpu.cli.run_options import TrainerOptions
    from multigpu.planning import measurement
    from multigpu.planning.ranking import Outcome, in_measuring_order
    from multigpu.planning.report import write_outputs
    from multigpu.strategies import LAYOUTS

    trained = []

    def fake_run(command, out, log, timeout):
        trained.append(next(arg for arg in command if arg.startswith("--trainer.strategy=")))
        return {"window_images_per_s": [10.0, 11.0], "images_per_s": 10.5, "peak_memory_bytes": []}

    monkeypatch.setattr(measurement, "run", fake_run)
    monkeypatch.setattr("sys.argv", ["main.py"])
    outcomes = [
        Outcome(LAYOUTS[strategy](name, 2, 2, 8), [1], forecast)
        for name, strategy, forecast in (
            ("ddp", "ddp", 15.0),
            ("1 device", "auto", 10.0),  # the slowest forecast, and the reference
            ("fsdp", "fsdp", 12.0),
            ("model parallel 2", "manual_model_parallel", 20.0),
        )
    ]
    order = in_measuring_order(outcomes)
    assert [o.layout.name for o in order] == ["1 device", "model parallel 2", "ddp", "fsdp"]
    setting = SimpleNamespace(batch_size=8, devices=2, device_ids=None)  # what measure reads of a Setting
    # Each layout trains 2 x 8 images per step for 1 + 1 x 2 steps: 48 images, 3.2 s at ddp's 15 img/s.
    measured = measurement.measure(
        order, [], setting, measurement.TimedSteps(1, 1, 2, 1), deadline=time.monotonic() + 2.0
    )
    assert trained == ["--trainer.strategy=auto", "--trainer.strategy=manual_model_parallel"]
    assert [o.figures is not None for o in measured] == [True, True, False, False]
    assert "  not measured, the time budget spent: ddp, fsdp (raise --plan.budget_s to measure them)" in (
        capsys.readouterr().out
    )
    basis = {"passes_s": {"8 images on 2 thread(s)": 0.9}, "links": Links(world=1).figures()}
    outcomes = [*measured, Outcome(LAYOUTS["dp"]("dp", 2, 1, 8), [1], 9.0)]
    write_outputs(outcomes, tmp_path, None, TrainerOptions(), "", measured, 2.0, 3.4, basis)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["budget_s"] == 2.0 and plan["elapsed_s"] == 3.4 and plan["basis"] == basis
    last = capsys.readouterr().out.strip().splitlines()[-1]  # the budget, and why it was not kept
    assert last.startswith(
        "plan: measured 2 of 5 layouts in 3 s, 1 s past its 2 s budget (the reference and the best forecast are "
        "measured whatever the time), and chose "
    )
    assert {row["layout"]: (row["selected"], row["left_by_budget"]) for row in plan["results"]} == {
        "1 device": (True, False),
        "model parallel 2": (True, False),
        "ddp": (True, True),
        "fsdp": (True, True),
        "dp": (False, False),
    }
    trained.clear()
    measurement.measure(order, [], setting, measurement.TimedSteps(1, 1, 2, 1), deadline=time.monotonic() + 60.0)
    assert len(trained) == 4 and "past the time budget" not in capsys.readouterr().out
    trained.clear()  # a slow machine: the budget spent before measuring began
    measurement.measure(order, [], setting, measurement.TimedSteps(1, 1, 2, 1), deadline=time.monotonic() - 30.0)
    assert trained == ["--trainer.strategy=auto", "--trainer.strategy=manual_model_parallel"]
    assert (
        "  past the time budget by 30 s: the reference and the best forecast are measured whatever the time, "
        "the others while their forecast run ends within it" in capsys.readouterr().out
    )


@pytest.mark.parametrize("deadline, measured", [(20.6, ["ddp"]), (20.2, [])])
def test_the_budget_stretches_a_forecast_by_the_most_a_run_took_for_its_own(monkeypatch, deadline, measured):
    """A run takes longer than its forecast training time (starting processes, building the network, the slower
    first steps), the more the longer its steps: the budget gives the next layout its forecast training time
    times the largest such stretch so far (here 2.5, not the first run's 2 or their mean) and 20% for its own
    error (``FORECAST_ERROR``), on the clock from which ``deadline`` counts."""
    from multigpu.planning import measurement, ranking
    from multigpu.planning.ranking import Outcome
    from multigpu.strategies import LAYOUTS

    clock = [0.0]
    took = {"auto": 4.8, "manual_model_parallel": 6.0, "ddp": 8.0, "fsdp": 10.0}  # forecast 2.4, 2.4, 3.2, 4 s
    trained = []

    def fake_run(command, out, log, timeout):
        strategy = next(arg for arg in command if arg.startswith("--trainer.strategy=")).split("=")[1]
        trained.append(strategy)
        clock[0] += took[strategy]
        return {"window_images_per_s": [10.0, 11.0], "images_per_s": 10.5, "peak_memory_bytes": []}

    monkeypatch.setattr(measurement, "run", fake_run)
    for module in (measurement, ranking):
        monkeypatch.setattr(module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr("sys.argv", ["main.py"])
    order = [
        Outcome(LAYOUTS[strategy](name, 2, 2, 8), [1], forecast)
        for name, strategy, forecast in (
            ("1 device", "auto", 10.0),
            ("model parallel 2", "manual_model_parallel", 20.0),
            ("ddp", "ddp", 15.0),
            ("fsdp", "fsdp", 12.0),
        )
    ]
    setting = SimpleNamespace(batch_size=8, devices=2, device_ids=None)
    # Each layout trains 8 images per step and replica for 1 + 1 x 2 steps. After the first two, the clock reads
    # 10.8 s: ddp would end at 10.8 + 3.2 x 2.5 x 1.2 = 20.4 s (at 19.44 s by the mean stretch, 18.8 s without the
    # 20%); fsdp after it, at 18.8 + 4 x 2.5 x 1.2 s.
    measurement.measure(order, [], setting, measurement.TimedSteps(1, 1, 2, 1), deadline=deadline)
    assert trained == ["auto", "manual_model_parallel", *measured]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the process's start time comes from /proc (Linux)")
def test_the_budget_counts_from_the_start_of_the_process():
    """``plan``'s budget counts Python's start-up and the imports, as the user's clock does: a process that slept
    1.5 s before asking is at least 1.5 s old (on Linux, where ``/proc`` says)."""
    script = "import time; time.sleep(1.5); from multigpu.planning.command import process_age_s; print(process_age_s())"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert 1.5 <= float(done.stdout) < 60
