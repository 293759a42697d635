"""Every pipeline schedule against one device that accumulates the same micro-batches."""

import subprocess
import sys

import pytest
import torch
from helpers import ABORTED_AT_EXIT, REPO

from multigpu.errors import UsageError
from multigpu.strategies.pipeline.stage_placement import SCHEDULES, StagePlacement

pytestmark = pytest.mark.internals  # CI runs these on the lowest torch we declare too

# LoopedBFS runs each stage's backward passes last micro-batch first, so the gradients of the
# micro-batches are summed in another order than one device's: float32 rounding, which 3 steps carry on
# (relative, and absolute where a sum cancels). Seen on an Intel Xeon with torch 2.11: 1.1e-4 on a BatchNorm
# running variance of about 10, 4e-5 on a momentum of 6.8, and 1.1e-5 on the momentum of a linear bias
# before BatchNorm, whose gradient is zero but for rounding (3e-8 to 1e-6 on other machines and torches).
# A micro-batch lost or counted twice would move the gradients by about an eighth.
REORDERED = {"loopedbfs": (1e-4, 1e-4)}  # (rtol, atol)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``trained(layout)``: what ``tests/schedule_training.py LAYOUT`` saved, run once per module."""
    folder, results = tmp_path_factory.mktemp("schedules"), {}

    def train(layout: str) -> dict:
        if layout not in results:
            out = folder / f"{layout}.pt"
            result = subprocess.run(
                [sys.executable, str(REPO / "tests" / "schedule_training.py"), layout, str(out)],
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert result.returncode == 0 and ABORTED_AT_EXIT not in result.stderr, (
                result.stdout[-3000:] + result.stderr[-3000:]
            )
            results[layout] = torch.load(out)
        return results[layout]

    return train


def _compare(piped: dict, reference: dict, tolerance: tuple[float, float], buffers: bool = True) -> None:
    rtol, atol = tolerance
    names = [name for name in reference["state"] if buffers or not ("running" in name or "num_batches" in name)]
    assert len(names) == (56 if buffers else 32)  # 8 x (weight, bias, BatchNorm weight, bias) + 8 x 3 buffers
    state, expected = ({name: saved["state"][name] for name in names} for saved in (piped, reference))
    torch.testing.assert_close(state, expected, rtol=rtol, atol=atol)
    assert len(piped["momentum"]) == 32
    torch.testing.assert_close(piped["momentum"], reference["momentum"], rtol=rtol, atol=atol)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["2", "4"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_one_pipeline_equals_one_device_accumulating_its_micro_batches(schedule, layout, trained):
    """Parameters, BatchNorm statistics and momentum: bit for bit, but for a schedule that reorders the sums."""
    _compare(trained(layout)[schedule], trained("reference-2")["reference"], REORDERED.get(schedule, (0.0, 0.0)))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_two_replicas_of_a_pipeline_equal_one_device_accumulating_both(schedule, trained):
    """In float64: the replicas' average rounds differently from one device's sum (1e-15 seen).

    BatchNorm's running statistics are each replica's own, as under DDP, and are not compared.
    """
    _compare(trained("2x2")[schedule], trained("reference-4")["reference"], (0.0, 1e-12), buffers=False)


def test_placement_is_looped_or_v_shaped():
    assert StagePlacement("Interleaved1F1B", 2, 2).stages_of(0) == [0, 2]
    assert StagePlacement("ZBVZeroBubble", 2, 2).stages_of(0) == [0, 3]
    assert StagePlacement("DualPipeV", 4, 2).stages_of(1) == [1, 6]
    assert StagePlacement("gpipe", 4, 1).stages_of(3) == [3]


@pytest.mark.parametrize(
    ("schedule", "per_process", "micro_batches", "message"),
    [
        ("1f1b", 2, 8, "schedule 1f1b runs one stage per process, not stages_per_process=2"),
        (
            "ZBVZeroBubble",
            1,
            8,
            "schedule ZBVZeroBubble places 2 stages on each process in a V: set stages_per_process=2",
        ),
        ("DualPipeV", 2, 3, "schedule DualPipeV needs at least as many micro-batches as stages: micro_batches=3 < 4"),
        (
            "Interleaved1F1B",
            2,
            5,
            "micro_batches=5 is not a multiple of its 2 rounds. Use a multiple of 2 micro-batches",
        ),
    ],
)
def test_a_layout_the_schedule_cannot_run_is_refused(schedule, per_process, micro_batches, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        StagePlacement(schedule, 2, per_process).check(micro_batches)
