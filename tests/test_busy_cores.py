"""A busy machine is noticed, not believed: ``plan`` checks the cores it profiles on, and says so when other
processes keep them busy."""

import subprocess
import sys
import time

import pytest
from helpers import SMOKE, cli_main, run_args

from multigpu.planning import busy_cores
from multigpu.planning.profile import cores


@pytest.fixture
def busy_machine():
    """A process spinning on every core, as another training run would keep them."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores())]
    time.sleep(0.5)
    yield
    for spinner in spinners:
        spinner.kill()
        spinner.wait()


def test_busy_cores_are_measured_as_busy(busy_machine):
    check = busy_cores.check_cores()
    assert check.busy, check
    assert str(check).startswith(f"a convolution on {cores()} thread(s) got ")


@pytest.mark.parametrize(
    ("if_busy", "refusal"),
    [
        ("refuse", "error: the cores stayed busy ("),
        ("wait", "error: the cores stayed busy for 0 s ("),  # a wait cut to nothing
    ],
)
def test_plan_on_busy_cores_says_so_and_refuses_before_profiling(
    if_busy, refusal, busy_machine, monkeypatch, capsys, tmp_path
):
    monkeypatch.setattr(busy_cores, "WAIT_S", 0.0)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(
            "plan",
            "--config",
            SMOKE,
            "--trainer.accelerator=cpu",
            "--trainer.devices=2",
            *run_args(tmp_path),
            f"--plan.if_busy={if_busy}",
        )
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert "plan: the cores are busy before profiling: a convolution on " in out
    assert "timing the blocks" not in out  # nothing profiled on busy cores
    line = err.strip().splitlines()[-1]
    assert line.startswith(refusal) and line.endswith(
        "plan's figures would measure the other process too. Stop it, or pass --plan.if_busy=go to plan anyway."
    ), line
