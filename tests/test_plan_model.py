"""``plan``'s cost model: the pipeline schedules simulated from their action lists, DDP's overlapped buckets,
the links' arithmetic, and how measured windows become ranges, ties and a choice."""

import itertools
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import free_port
from lightning.pytorch.plugins.precision import Precision
from torch import nn

from multigpu.compat import schedule_actions
from multigpu.model.lazy_blocks import LazyBlocks
from multigpu.planning import link_probe
from multigpu.planning import links as links_module
from multigpu.planning.forecast import forecast
from multigpu.planning.link_probe import REPEATS, SHARDED_ROUNDS, SIZES, _sharded_costs, _timed
from multigpu.planning.links import ForkedRanks, Link, Links, fork_ranks
from multigpu.planning.profile import BlockProfile, PassTimes
from multigpu.planning.ranking import Outcome, choice, chosen_by_forecast, tied, to_measure
from multigpu.planning.report import print_report
from multigpu.strategies import LAYOUTS
from multigpu.strategies.layout import BlockMemory, overlapped_reduction
from multigpu.strategies.pipeline.layouts import PipelineLayout
from multigpu.strategies.pipeline.simulation import simulate_step
from multigpu.strategies.pipeline.stage_placement import SCHEDULES, StagePlacement, natural_stages_per_process
from multigpu.timing.busy_cores import threads_per_process

pytestmark = pytest.mark.internals  # the schedules' action lists come from a private torch module

NO_SEND = lambda stage: 0.0  # noqa: E731
MOMENTUM = {"momentum": 0.9}  # the SGD the blocks' copies update with


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_balanced_pipeline_of_one_stage_per_process_takes_its_textbook_time(schedule):
    # P stages, m micro-batches, forward 1 and backward 2 each: (m + P - 1) x (1 + 2), the bubble included.
    for processes, micro_batches in ((2, 4), (4, 8)):
        finish = simulate_step(
            StagePlacement(schedule, processes, 1), micro_batches, [1.0] * processes, [2.0] * processes, NO_SEND
        )
        assert max(finish) == (micro_batches + processes - 1) * 3
        assert finish[0] == max(finish)  # the first stage finishes last: its backward passes come last


def test_sends_between_processes_lengthen_the_step_and_sends_within_one_do_not():
    layout = StagePlacement("gpipe", 2, 1)
    quick = max(simulate_step(layout, 2, [1.0, 1.0], [2.0, 2.0], NO_SEND))
    slow = max(simulate_step(layout, 2, [1.0, 1.0], [2.0, 2.0], lambda stage: 0.5))
    assert slow == quick + 2 * 0.5  # one forward send and one backward send on the longest path


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_simulates_to_the_end_with_every_action_once(schedule):
    per_process = natural_stages_per_process(schedule)
    layout = StagePlacement(schedule, 2, per_process)
    stages = layout.num_stages
    finish = simulate_step(layout, 4, [1.0] * stages, [2.0] * stages, NO_SEND)
    work = 4 * stages * 3 / 2  # every stage's forward and backward passes, shared by the 2 processes
    assert work <= max(finish) <= 2 * work
    if per_process > 1:  # torch's own lists: each stage of the process, each micro-batch, forward and backward
        actions = schedule_actions(schedule, 2, 4, per_process)
        for process, listed in enumerate(actions):
            forwards = {(stage, m) for kind, stage, m in listed if kind == "F"}
            assert forwards == {(stage, m) for stage in layout.stages_of(process) for m in range(4)}


def test_ddp_buckets_hide_behind_the_backward_pass_on_gpus_and_hold_it_up_on_the_cpu():
    backward, params = [1.0] * 4, [2**20] * 4  # four blocks, each one bucket's worth of 1 MiB
    reduce = lambda nbytes: 0.5  # noqa: E731
    assert overlapped_reduction(backward, params, reduce, overlap=True) == 4 + 0.5  # only the last one shows
    assert overlapped_reduction(backward, params, reduce, overlap=False) == 4 + 0.5 * 2  # first bucket, then the rest


class _FlatProfile:
    """Every block 1 s forward, 2 s backward and no update (or ``updates``), whatever the images; a backward pass
    split in two ``split`` times as long as whole."""

    def __init__(self, blocks: int, split: float = 1.0, updates: list[float] | None = None) -> None:
        self.blocks, self.split, self.updates = blocks, split, updates or [0.0] * blocks

    def split_backward(self, processes: int = 1) -> float:
        return self.split

    def times(self, images: int, processes: int = 1) -> PassTimes:
        return PassTimes([1.0] * self.blocks, [2.0] * self.blocks, self.updates)


def test_a_pipelines_processes_update_after_its_last_action_and_the_step_waits_for_the_slowest_update():
    """GPipe over 2 processes, 4 micro-batches: the first stage's last backward pass ends the passes at 15 s, the
    second stage's 2 s before; the second stage's update of 3 s starts only then (the output's broadcast), and the
    step waits for it (the SIGTERM flag's all-reduce), so it ends at 18 s, not at 16 (13 s and its update)."""
    memory = BlockMemory(params=[0, 0], activations=[0.0] * 2, inputs=[0.0] * 2, tensors=[0] * 2)
    layout = PipelineLayout(
        "p", 2, 2, 4, stages=2, stages_per_process=1, schedule="gpipe", balance=(1, 1), micro_batches=4
    )
    step = layout.batch_size / forecast(layout, _FlatProfile(2, updates=[0.5, 3.0]), Links(world=2), memory)
    assert step == pytest.approx((4 + 2 - 1) * 3 + 3.0)


def test_fsdp_on_the_cpu_pays_its_collectives_and_its_runtime_per_block_and_per_byte_in_turn_with_the_passes():
    blocks, nbytes = 3, 10**6
    memory = BlockMemory(params=[nbytes] * blocks, activations=[0.0] * blocks, inputs=[0.0] * blocks, tensors=[0] * 3)
    layout = LAYOUTS["fsdp"]("fsdp", devices=2, processes=2, batch_size=6)
    gathers = Link(0.0, 1e6)  # a whole block's gather moves half its bytes: 0.5 s; so does its reduce-scatter
    links = Links(world=2, gathers=gathers, scatters=gathers, sharded_block=0.25, sharded_byte=1e-6)
    compute, collectives = blocks * (1.0 + 2.0), blocks * 3 * 0.5  # two gathers (forward, backward), one scatter
    runtime = blocks * (0.25 + 1e-6 * nbytes)  # per block, and per byte: the copies around its collectives
    step = layout.batch_size * layout.replicas / forecast(layout, _FlatProfile(blocks), links, memory)
    assert step == pytest.approx(compute + collectives + runtime)


def test_the_split_factor_lengthens_only_the_split_halves_and_the_first_stages_input_needs_no_gradient():
    """The split factor lengthens every split backward pass but the first stage's, whose input-gradient half is
    nothing and whose weight-gradient half is the whole pass; DualPipeV runs most of its backward passes whole,
    which it leaves alone."""
    stages, backward = 4, [2.0] * 4
    zbv, dualpipev = StagePlacement("zbvzerobubble", 2, 2), StagePlacement("dualpipev", 2, 2)

    def finish(layout: StagePlacement, backward: list[float], split: float) -> float:
        return max(simulate_step(layout, 8, [1.0] * stages, backward, NO_SEND, 0.0, split))

    # ZBV splits every backward pass: the factor comes to the same as every pass but the first stage's lengthened
    lengthened = [2.0] + [2.0 * 1.5] * 3
    assert finish(zbv, backward, 1.5) == finish(zbv, lengthened, 1.0)
    split = finish(dualpipev, backward, 1.5)
    assert finish(dualpipev, backward, 1.0) < split < finish(dualpipev, lengthened, 1.0)


@pytest.mark.parametrize(("schedule", "splits"), [("zbvzerobubble", True), ("interleaved1f1b", False)])
def test_a_zero_bubble_schedule_pays_for_its_split_backward_pass_and_the_others_do_not(schedule, splits):
    blocks = 4
    memory = BlockMemory(params=[0] * blocks, activations=[0.0] * blocks, inputs=[0.0] * blocks, tensors=[0] * 4)
    layout = PipelineLayout(
        "p", 2, 2, 8, stages=4, stages_per_process=2, schedule=schedule, balance=(1, 1, 1, 1), micro_batches=4
    )
    links = Links(world=2)
    whole = forecast(layout, _FlatProfile(blocks), links, memory)
    split = forecast(layout, _FlatProfile(blocks, split=1.5), links, memory)
    assert (split < whole) if splits else (split == whole)


def test_ddp_and_fsdp_go_at_the_pace_of_their_slowest_process_and_a_pipeline_does_not():
    blocks = 4
    memory = BlockMemory(params=[0] * blocks, activations=[0.0] * blocks, inputs=[0.0] * blocks, tensors=[0] * 4)
    pipeline = PipelineLayout(
        "p", 2, 2, 8, stages=2, stages_per_process=1, schedule="1f1b", balance=(2, 2), micro_batches=4
    )
    even, paced = Links(world=2), Links(world=2, lockstep=1.25)  # links that cost nothing: only the passes count
    step = lambda layout, links: 1 / forecast(layout, _FlatProfile(blocks), links, memory)  # noqa: E731
    for strategy in ("ddp", "fsdp"):
        layout = LAYOUTS[strategy](strategy, 2, 2, 8)
        assert step(layout, paced) == pytest.approx(1.25 * step(layout, even))
        # measured over 4 processes: 2 of them are charged a third of the way from even to the slowest of 4
        assert step(layout, replace(paced, world=4)) == pytest.approx((1 + 0.25 / 3) * step(layout, even))
    assert step(pipeline, paced) == step(pipeline, even)


def test_links_follow_the_ring_algorithms():
    links = Links(world=4, sends=Link(0.001, 1e9), reduces=Link(0.003, 1e9), gathers=Link(0.003, 1e9))
    assert links.send(1e9) == pytest.approx(1.001)
    assert links.all_reduce(1e9, 4) == pytest.approx(0.003 + 1.5)  # 2 (n-1)/n of the bytes
    assert links.all_reduce(1e9, 2) == pytest.approx(0.001 + 1.0)  # a smaller ring: fewer hops, less traffic
    assert links.all_gather(1e9, 4) == pytest.approx(0.003 + 0.75)
    assert links.all_gather(1e9, 4, latency=False) == pytest.approx(0.75)
    assert links.all_reduce(1e9, 1) == 0.0
    fitted = Link.fitted([[1000, 0.002], [1_001_000, 0.003]], traffic=1.0)
    assert fitted.bandwidth == pytest.approx(1e9) and fitted.latency == pytest.approx(0.002 - 1e-6)


def test_the_links_figures_are_strict_json_an_unmeasured_links_bandwidth_none():
    """What ``plan.json`` records of the links: JSON without ``Infinity``, which strict readers refuse."""
    figures = json.loads(json.dumps(Links(world=1).figures(), allow_nan=False))
    assert figures["sends"] == {"latency": 0.0, "bandwidth": None} and figures["contention"] == 1.0
    measured = Links(world=2, reduces=Link(0.003, 1e9), lockstep=1.1).figures()
    assert measured["reduces"] == {"latency": 0.003, "bandwidth": 1e9} and measured["lockstep"] == 1.1


def test_the_link_probe_keeps_the_median_of_its_timed_runs_not_the_fastest():
    """The collectives a training step meets: the median of ``REPEATS`` runs, the first (a warm-up) untimed."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    sleeps = iter([0.3, 0.0, 0.0, 0.0, 0.05, 0.05, 0.3, 0.3])  # the fastest 0, the mean 0.1 s
    assert REPEATS + 1 == 8
    seconds = _timed(lambda: time.sleep(next(sleeps)), torch.device("cpu"))
    assert 0.05 <= seconds < 0.09


def test_the_sharded_cost_per_byte_is_the_median_round_so_a_slow_moment_on_two_rounds_leaves_it(monkeypatch):
    """Each round times a large matrix's gathers and reduce-scatter, then the sharded and the unsharded passes, back
    to back, and the median round counts: two rounds whose sharded passes ran a second slow, and the untimed first,
    leave the figure of the quiet ones (with the parts timed apart, one plan of 2 December read 19 ns a byte where the
    others read about 1)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    quiet, slow = [0.01, 0.01, 0.3, 0.02], [0.01, 0.01, 1.3, 0.02]  # gather, reduce-scatter, sharded, unsharded
    assert SHARDED_ROUNDS == 5
    rounds = [[0.5, 0.5, 9.0, 0.5], quiet, slow, quiet, slow, quiet]
    script = iter([0.004] * (REPEATS + 1) + [0.001] * (REPEATS + 1) + [part for round in rounds for part in round])
    monkeypatch.setattr(link_probe, "_once", lambda function, device: next(script))
    per_block, per_byte, _ = _sharded_costs(torch.device("cpu"), blocks=8)
    excess = (0.3 - 0.02) / 2 - 2 * 0.01 - 0.01  # per matrix, of 2
    width = math.isqrt(SIZES[-1] // 4)
    assert per_block == pytest.approx(0.0005) and per_byte == pytest.approx((excess - 0.0005) / (4 * width * width))
    assert next(script, None) is None


def test_the_link_probe_imports_torch_alone():
    """Its processes start after torchrun's: each import of Lightning there would add seconds to every ``plan``."""
    code = "import sys, multigpu.planning.link_probe; print([m for m in sys.modules if m.startswith('lightning')])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


@contextmanager
def forking_python(code: str):
    """``python -c code`` in a session of its own, its standard output and error captured; whatever it forked is
    killed on leaving, so that a test that fails leaves no rank behind."""
    process = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        yield process
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.communicate()


def finished(process: subprocess.Popen, timeout: float) -> tuple[str, str]:
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err
    return out, err


def output_of(code: str, timeout: float = 150) -> tuple[str, str]:
    """The standard output and error of ``forking_python(code)``, which must succeed within ``timeout`` seconds."""
    with forking_python(code) as process:
        return finished(process, timeout)


def test_the_forked_link_probe_measures_with_the_ranks_asked_for_and_the_others_end():
    """``plan``'s process forks the probe's ranks before it computes anything, so that they start measuring with
    torch imported; forked so, two threads each compute (a fork after GNU OpenMP's first parallel region hangs a
    child's first one with more than one thread). The rank not asked for ends at once, without measuring."""
    code = (
        "import json, multigpu.planning.links as links\n"
        "ranks = links.ForkedRanks(3)\n"
        "links.threads_per_process = lambda processes: 2\n"
        "print(json.dumps(sorted(ranks.measure(2))), len(ranks))\n"
    )
    out, err = output_of(code)
    keys, left = out.rsplit(maxsplit=1)
    assert json.loads(keys) == sorted(
        ["send", "all_reduce", "all_gather", "reduce_scatter", "pipeline_action"]
        + ["sharded_block", "sharded_byte", "sharded_update"]
    )
    assert left == "0"  # used up: a second profile's links are measured by torchrun
    assert "FutureWarning" not in err  # the ranks share plan's output


def test_the_link_probes_ranks_are_forked_on_a_cpu_of_linux_for_several_processes_alone():
    """GPUs' ranks are started by ``torchrun`` (CUDA does not survive a fork), and one process has no links. Those
    forked and dismissed end of themselves, not killed."""
    assert fork_ranks(2, cuda=True) is None and fork_ranks(1, cuda=False) is None
    ranks = fork_ranks(2, cuda=False)
    assert isinstance(ranks, ForkedRanks) and len(ranks) == 2
    processes = list(ranks._ranks)
    ranks.dismiss()
    assert [process.exitcode for process in processes] == [0, 0] and len(ranks) == 0


def test_measure_links_takes_the_forked_ranks_where_it_has_as_many_else_torchrun(monkeypatch):
    """Links for 2 processes from 2 forked ranks; a plan whose layouts need none dismisses them."""
    calls = []

    class Ranks:
        def __len__(self) -> int:
            return 2

        def measure(self, processes: int) -> dict:
            calls.append(f"measure {processes}")
            points = [[SIZES[0], 0.001], [SIZES[1], 0.011]]
            return {"send": points, "all_reduce": points, "all_gather": points, "reduce_scatter": points} | {
                "pipeline_action": 0.002,
                "sharded_block": 0.003,
                "sharded_byte": 1e-9,
                "sharded_update": 1e-4,
            }

        def dismiss(self) -> None:
            calls.append("dismiss")

    monkeypatch.setattr(links_module, "_measured_by_torchrun", lambda *args: pytest.fail("torchrun started"))
    measured = links_module.measure_links(2, False, None, Ranks())
    assert calls == ["measure 2"] and measured.world == 2 and measured.pipeline_action == 0.002
    assert links_module.measure_links(1, False, None, Ranks()).world == 1 and calls[-1] == "dismiss"


def test_a_forked_link_probe_rank_that_fails_ends_the_others_at_once():
    """Rank 1 fails before it joins the process group: rank 0 would wait for it in the store until gloo's time limit
    (30 minutes); its exit ends rank 0 at once, and plan says which rank failed, not that the links took too long."""
    code = (
        "import time, multigpu.planning.links as links, multigpu.planning.link_probe as probe\n"
        "join = probe.dist.init_process_group\n"
        "def fail_on_rank_1(*args, rank, **kwargs):\n"
        "    if rank == 1: raise SystemExit(3)\n"
        "    join(*args, rank=rank, **kwargs)\n"
        "probe.dist.init_process_group = fail_on_rank_1\n"
        "ranks, start = links.ForkedRanks(2), time.monotonic()\n"
        "try:\n"
        "    ranks.measure(2)\n"
        "except links.UsageError as error:\n"
        "    print(f'{time.monotonic() - start:.0f}', error)\n"
    )
    out, _ = output_of(code)
    seconds, error = out.split(" ", 1)
    assert error.strip() == "measuring the links between the devices failed: rank 1 exited with 3; see the output above"
    assert int(seconds) < 30  # links.LINK_TIMEOUT_S is 180


def test_the_forked_link_probe_ends_when_plan_ends_first():
    """A plan that ends first (killed, say) leaves no rank behind: they watch plan's process."""
    code = (
        "import os, multigpu.planning.links as links\n"
        "ranks = links.ForkedRanks(2)\n"
        "print(*(rank.pid for rank in ranks._ranks), flush=True)\n"
        "os._exit(0)\n"  # without Python's own ending, which ends daemonic children
    )

    def running(pid: str) -> bool:
        try:  # a zombie waits for its new parent to collect it: ended
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    with forking_python(code) as process:
        out, _ = finished(process, timeout=60)
        pids = out.split()
        assert len(pids) == 2
        deadline = time.monotonic() + 20
        while any(map(running, pids)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(map(running, pids))


def _outcome(name: str, processes: int, forecast: float, windows: list[float] | None = None, peak: int = 1) -> Outcome:
    layout = LAYOUTS["auto" if name == "1 device" else "ddp"](name, processes, processes, 8)
    figures = {"images_per_s": 0.0, "window_images_per_s": windows, "peak_memory_bytes": [peak]} if windows else None
    return Outcome(layout, [0], forecast, figures)


def test_the_reference_the_top_forecasts_and_those_within_the_error_are_measured():
    outcomes = [
        _outcome("1 device", 1, 10.0),
        _outcome("a", 2, 30.0),
        _outcome("b", 2, 25.0),  # within 20% of the best
        _outcome("c", 2, 23.0),
        _outcome("d", 2, 20.0),
    ]
    assert [o.layout.name for o in to_measure(outcomes, top=1)] == ["1 device", "a", "b"]
    assert [o.layout.name for o in to_measure(outcomes, top=3)] == ["1 device", "a", "b", "c"]


def test_a_median_within_the_fastest_range_ties_and_the_simplest_of_the_tie_is_chosen():
    one = _outcome("1 device", 1, 20.0, [19.0, 21.0, 20.0], peak=2)
    fast = _outcome("a", 2, 22.0, [19.5, 22.0, 23.0], peak=1)
    slow = _outcome("b", 2, 15.0, [14.0, 15.0, 16.0])
    assert one.images_per_s == 20.0 and one.interval == (19.0, 21.0)
    assert tied([one, fast, slow]) == [fast, one]
    assert choice([one, fast, slow]) is one  # one process beats two, however fast
    apart = _outcome("1 device", 1, 20.0, [18.0, 19.0, 21.4])  # its range overlaps, its median does not
    assert tied([apart, fast, slow]) == [fast] and choice([apart, fast, slow]) is fast


def test_a_range_made_wide_by_a_busy_machine_ties_with_nothing():
    """The issue's measurements: the pipeline at 8.2 images/s, one device on busy cores at 0.9 with a window of 9.2.
    The pipeline is chosen: one device's median is a ninth of it."""
    pipeline = _outcome("pipeline 2 gpipe m2", 2, 8.0, [7.9, 8.2, 8.5])
    busy = _outcome("1 device", 1, 5.0, [0.9, 0.9, 9.2])
    assert tied([busy, pipeline]) == [pipeline] and choice([busy, pipeline]) is pipeline


def test_with_every_layout_measured_on_busy_cores_the_best_forecast_is_chosen_and_said(capsys):
    """The cores too busy to measure: the figures measured the other work too, so the plan chooses by forecast among
    the layouts it measured, and says so; one quiet measurement is compared by its figures again."""
    one = replace(_outcome("1 device", 1, 9.0, [5.0, 6.0, 7.0]), busy="a convolution got 40% of the cores")
    ddp = replace(_outcome("ddp", 2, 14.0, [4.0, 5.0, 5.5]), busy="a convolution got 45% of the cores")
    unmeasured = _outcome("pipeline", 2, 30.0)
    assert chosen_by_forecast([one, ddp, unmeasured]) and choice([one, ddp, unmeasured]) is ddp
    assert tied([one, ddp, unmeasured]) == []
    print_report([one, ddp, unmeasured], [], None, (2**30, True), measured=True)
    assert (
        "chosen: ddp: by forecast (14.0 img/s, the best of the layouts measured): every one trained on busy cores, so "
        "their figures measure the other work too (plan again on quiet cores to choose by measurement)."
    ) in capsys.readouterr().out
    quiet = replace(one, busy=None)
    assert not chosen_by_forecast([quiet, ddp]) and choice([quiet, ddp]) is quiet


def test_a_choice_that_no_measurement_was_compared_with_says_so(capsys):
    """With the time budget spent after the reference, the plan chose the only layout it measured: it says that,
    not that the others' ranges lie below it."""
    one = _outcome("1 device", 1, 20.0, [19.0, 21.0, 20.0])
    print_report([one, _outcome("a", 2, 15.0)], [], None, (2**30, True), measured=True)
    assert "chosen: 1 device: the only layout measured, so nothing was compared with it." in capsys.readouterr().out
    print_report([one, _outcome("b", 2, 15.0, [14.0, 15.0, 16.0])], [], None, (2**30, True), measured=True)
    assert (
        "chosen: 1 device: the fastest, and no other layout's median lies within its range." in capsys.readouterr().out
    )


def test_each_run_of_blocks_is_scaled_to_its_own_figures_in_its_blocks_proportions():
    """Two runs of two blocks each, unequal within each run: every run's blocks add up to that run's own forward and
    backward figures, each block keeping its share of its run; a run whose blocks took no time keeps them at 0."""
    times = PassTimes([1.0, 3.0, 2.0, 0.0], [2.0, 2.0, 4.0, 0.0], [0.5] * 4)
    scaled = times.scaled_to([0, 2, 4], [(8.0, 2.0), (1.0, 6.0)])
    assert scaled.forward == pytest.approx([2.0, 6.0, 1.0, 0.0])
    assert scaled.backward == pytest.approx([1.0, 1.0, 6.0, 0.0])
    assert scaled.update == [0.5] * 4
    untimed = PassTimes([0.0, 0.0, 1.0], [0.0, 0.0, 1.0], [0.0] * 3).scaled_to([0, 2, 3], [(0.5, 0.5), (2.0, 3.0)])
    assert (untimed.forward, untimed.backward) == ([0.0, 0.0, 2.0], [0.0, 0.0, 3.0])
    # the updates, to the whole network's one step, each block keeping its share; the passes as they were
    updated = times.with_update(1.0)
    assert updated.update == pytest.approx([0.25] * 4) and updated.forward == times.forward
    assert untimed.with_update(1.0).update == [0.0] * 3


def test_the_blocks_add_up_to_the_whole_network_timed_at_once(monkeypatch):
    """Timed one by one, the blocks each pay a call of their own and find their parameters in the caches: the profile
    scales the forward passes of each of the whole network's runs of blocks to that run's forward pass and their
    backward passes to its backward pass, each timed at the same size, and the blocks' updates to the whole
    network's one update at the same thread count."""
    factories = [lambda: nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 16)), nn.ReLU, lambda: nn.Linear(16, 10)]
    profile = lambda: BlockProfile(LazyBlocks(factories, seed=0), Precision(), torch.device("cpu"), MOMENTUM)  # noqa: E731
    assert profile()._bounds() == [0, 1, 2, 3]  # fewer blocks than SEGMENTS: a run each
    (runs,), together, updates = profile()._whole_passes([torch.zeros(2, 3, 32, 32)], [1], [1])
    assert len(runs) == 3 and all(0 < seconds < 1 for run in runs for seconds in run) and together == {}
    assert list(updates) == [1] and 0 < updates[1] < 1

    def whole_passes(seconds, update):
        return lambda self, examples, threads, copies: (
            [seconds] * len(examples),
            {},
            {count: update for count in threads} if update else {},
        )

    monkeypatch.setattr(BlockProfile, "_whole_passes", whole_passes([(0.05, 0.1), (0.01, 0.1), (0.04, 0.2)], 0.3))
    scaled_profile = profile()
    scaled = scaled_profile.times(2, 1)
    assert scaled.forward == pytest.approx([0.05, 0.01, 0.04]) and scaled.backward == pytest.approx([0.1, 0.1, 0.2])
    assert sum(scaled.update) == pytest.approx(0.3) and scaled.update[1] == 0.0  # the ReLU has nothing to update
    # the level plan.json records: the whole pass at each size and thread count timed, the update at each count
    assert scaled_profile.passes() == {f"2 images on {threads_per_process(1)} thread(s)": pytest.approx(0.5)}
    assert scaled_profile.updates() == {f"on {threads_per_process(1)} thread(s)": 0.3}
    monkeypatch.setattr(BlockProfile, "_whole_passes", whole_passes(None, None))
    as_timed = profile().times(2, 1)  # the whole network did not fit: the blocks stay as timed
    assert sum(as_timed.forward + as_timed.backward) < 0.1 and 0 < sum(as_timed.update) < 0.1


def test_the_whole_network_is_timed_in_rounds_of_every_size_and_its_mean_counts(monkeypatch):
    """The whole network's passes set every forecast's level: each round runs every size in turn (a slow moment
    falls on all alike), after one untimed pass at the largest, and a size's figure is its rounds' mean, as a run's
    steps are, not its fastest."""
    factories = [lambda: nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 16)), nn.ReLU, lambda: nn.Linear(16, 10)]
    profile = BlockProfile(LazyBlocks(factories, seed=0), Precision(), torch.device("cpu"), MOMENTUM)
    # forward and backward: untimed; round 1: 2 and 4 images; round 2: 2 and 4
    # each of the runs of blocks: the first and the last two blocks
    threads, clock = [], iter([[(9.0, 9.0)] * 2, [(1.0, 2.0), (0.0, 1.0)], [(3.0, 6.0)] * 2, [(2.0, 3.0)] * 2])
    clock = itertools.chain(clock, [[(5.0, 8.0)] * 2])

    def seconds(self, net, x, bounds) -> list[tuple[float, float]]:
        threads.append(torch.get_num_threads())
        return next(clock)

    monkeypatch.setattr(BlockProfile, "_pass_seconds", seconds)
    small, large = torch.zeros(2, 3, 32, 32), torch.zeros(4, 3, 32, 32)
    expected = [[(1.5, 2.5), (1.0, 2.0)], [(4.0, 7.0), (4.0, 7.0)]]
    monkeypatch.setattr(BlockProfile, "_update_seconds", lambda self, net, count: count / 10)
    profile._updates[1] = 0.5  # an earlier size's: the update at 1 thread is timed once in a profile
    assert profile._whole_passes([small, large], [1, 2], [1, 1]) == (expected, {}, {2: 0.2})
    assert threads == [2, 1, 2, 1, 2]  # the largest (on its 2 threads) untimed, then the sizes in turn, twice


def test_the_whole_networks_update_is_one_step_over_all_its_parameters_the_mean_after_one_untimed(monkeypatch):
    """A layout's process updates all its parameters in one optimizer step: the profile times that step (the
    recipe's SGD, changing no parameter) with the thread count asked for, its mean after one untimed."""
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    net(torch.randn(3, 4)).sum().backward()  # gradients of a pass, kept
    before = [param.clone() for param in net.parameters()]
    recipe = {"momentum": 0.9, "nesterov": True, "weight_decay": 5e-4}
    profile = BlockProfile(LazyBlocks([nn.ReLU]), Precision(), torch.device("cpu"), recipe)
    steps, clock = [], iter([9.0, 1.0, 3.0])

    def seconds(self, work) -> float:
        work()
        steps.append(torch.get_num_threads())
        return next(clock)

    monkeypatch.setattr(BlockProfile, "_seconds", seconds)
    assert profile._update_seconds(net, 1) == 2.0 and steps == [1, 1, 1]
    assert all(torch.equal(param, old) for param, old in zip(net.parameters(), before))
    # timed once per thread count in a profile; on a GPU (no thread count) it reads "on the device"
    profile._updates = {None: 0.1}
    assert profile.updates() == {"on the device": 0.1}


def test_the_whole_network_timed_in_runs_of_blocks_computes_the_gradients_of_one_pass():
    """Each run of blocks is cut from the one before, as a pipeline's stages are, and its backward pass starts from
    the gradient of the next run's input: every parameter gets the gradient a pass through the whole network gives,
    and each run its own forward and backward seconds."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 16), _Halves(), _Joined(), nn.Linear(16, 10))
    profile = BlockProfile(LazyBlocks([nn.ReLU] * 5), Precision(), torch.device("cpu"), MOMENTUM)
    x = torch.randn(4, 3, 32, 32, requires_grad=True)
    net(x).backward(torch.ones(4, 10))
    whole = [param.grad.clone() for param in [x, *net.parameters()]]
    x.grad = None
    runs = profile._pass_seconds(net, x, [0, 2, 3, 5])  # the second run passes a tuple, as a bottleneck's halves do
    assert len(runs) == 3 and all(seconds > 0 for run in runs for seconds in run)
    assert all(torch.allclose(param.grad, grad) for param, grad in zip([x, *net.parameters()], whole))


class _Halves(nn.Module):
    def forward(self, x):
        return torch.tanh(x), x


class _Joined(nn.Module):
    def forward(self, halves):
        return halves[0] * halves[1]


def test_copies_at_once_follow_each_pass_alone_and_give_the_contention(monkeypatch):
    """On the CPU a size that a layout of several processes computes is also timed with as many copies of the network
    at once, right after its pass alone in each round: the contention and the lockstep come from the same moments as
    the level they scale."""
    monkeypatch.setattr("multigpu.timing.busy_cores.cores", lambda: 2)  # 2 processes: 1 thread each
    factories = [lambda: nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 16)), nn.ReLU, lambda: nn.Linear(16, 10)]
    profile = BlockProfile(LazyBlocks(factories, seed=0), Precision(), torch.device("cpu"), MOMENTUM)
    calls = []
    # forward and backward alone: untimed (4 images); round 1: 2 and 4 images; round 2: 2 and 4
    # in two runs of blocks each, their sums as the copies' figures count them: 1.0 and 1.2 s at 2 images
    alone = iter([[(4.0, 5.0)] * 2, [(0.3, 0.2), (0.1, 0.4)], [(0.5, 0.2), (0.0, 0.5)], [(0.2, 0.3), (0.3, 0.4)]])
    alone = itertools.chain(alone, [[(0.6, 0.8), (0.4, 0.6)]])
    at_once = iter([[9.0, 9.0], [1.1, 1.3], [1.3, 1.5]])  # untimed; round 1; round 2: 2 images, 2 copies

    def seconds(self, net, x, bounds) -> list[tuple[float, float]]:
        calls.append(f"alone on {torch.get_num_threads()}")
        return next(alone)

    def copies(self, nets, x) -> list[float]:
        calls.append(f"{len(nets)} at once on {torch.get_num_threads()}, {len(x)} images")
        return next(at_once)

    monkeypatch.setattr(BlockProfile, "_pass_seconds", seconds)
    monkeypatch.setattr(BlockProfile, "_at_once", copies)
    profile.measure_together([(2, 2), (4, 1)])
    both = "2 at once on 1, 2 images"
    assert calls == ["alone on 2", both, "alone on 1", both, "alone on 2", "alone on 1", both, "alone on 2"]
    contention, lockstep = profile.contention(2)
    assert contention == pytest.approx(1.3 / 1.1) and lockstep == pytest.approx(1.4 / 1.3)
    assert profile.contention(4) == (1.0, 1.0)  # no size timed with 4 copies


def test_copies_of_the_network_each_run_a_whole_pass_in_a_thread_of_their_own():
    """Each copy runs its own forward and backward pass in a thread of its own, all of them started at once: each
    copy's forward pass waits at a barrier for the other's, which a copy run after the other would never reach (how
    fast they go side by side is the machine's: on 2 quiet cores two one-thread copies took 1.03 to 1.25 times one
    alone, in plans of 29 November)."""
    nets = [nn.Sequential(nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 8))) for _ in range(2)]
    profile = BlockProfile(LazyBlocks([lambda: nets[0][0]]), Precision(), torch.device("cpu"), MOMENTUM)
    meet, threads = threading.Barrier(2, timeout=30), []

    def met(module, args, out):
        threads.append(threading.current_thread())
        meet.wait()

    for net in nets:
        net[0].register_forward_hook(met)
    times = profile._at_once(nets, torch.zeros(4, 3, 32, 32))
    assert times is not None and len(times) == 2 and all(seconds > 0 for seconds in times)
    assert all(param.grad is not None for net in nets for param in net.parameters())
    assert len(set(threads)) == 2 and threading.current_thread() not in threads


def test_the_split_backward_factor_is_timed_once_per_thread_count_and_recorded_by_it():
    """``plan.json``'s basis records the zero-bubble schedules' split factor at each thread count it was timed at."""
    net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 8))
    profile = BlockProfile(LazyBlocks([lambda: net]), Precision(), torch.device("cpu"), MOMENTUM)
    assert profile.splits() == {}
    factor = profile.split_backward(processes=2)
    assert factor > 0 and profile.split_backward(processes=2) == factor  # timed once, then kept
    threads = profile._key(1, 2)[1]
    assert profile.splits() == {f"on {threads} thread(s)": factor}


def _state(pid: str) -> str | None:
    """A process's state letter from ``/proc`` (``Z``: ended, not yet reaped), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="a process's state comes from /proc (Linux)")
def test_a_timed_run_leaves_no_process_behind(tmp_path):
    """What a timed run leaves running when it ends is stopped, so that the next run, or the check of the cores
    after it, finds them as they were: here a child that would sleep a minute (in a real run, a short run's loader
    workers' fork server, still importing its modules on one core for 5-8 s)."""
    from multigpu.timing.timed_runs import launch

    out, pid = tmp_path / "figures.json", tmp_path / "pid"
    leaves = (
        "import subprocess, sys; child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pid)!r}, 'w').write(str(child.pid)); open({str(out)!r}, 'w').write('{{}}')"
    )
    launch([sys.executable, "-c", leaves], out, tmp_path / "log")
    deadline = time.monotonic() + 10
    while _state(pid.read_text()) not in (None, "Z") and time.monotonic() < deadline:
        time.sleep(0.1)  # a kill is delivered at once, its end seen an instant later
    assert _state(pid.read_text()) in (None, "Z")
