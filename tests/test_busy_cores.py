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


@pytest.mark.parametrize("busy_again", [False, True])
def test_plan_waits_when_the_cores_turn_busy_while_it_profiles_then_profiles_again(
    busy_again, monkeypatch, capsys, tmp_path
):
    """Busy after profiling: the profile measured another process too, so plan waits for quiet cores and profiles
    again; busy once more after that, it refuses."""
    from multigpu.planning import command

    shares = iter([0.99, 0.5, 0.95, 0.5 if busy_again else 0.97])  # before, after, while waiting, after again
    check = lambda threads=None: busy_cores.CoreCheck(2, next(shares))  # noqa: E731
    monkeypatch.setattr(busy_cores, "check_cores", check)
    monkeypatch.setattr(command, "check_cores", check)
    monkeypatch.setattr(busy_cores.time, "sleep", lambda seconds: None)
    profiled = []
    monkeypatch.setattr(command, "_forecasts", lambda *args: profiled.append(args) or ([], [], {}))
    plan = ["plan", "--config", SMOKE, "--trainer.accelerator=cpu", "--trainer.devices=2", *run_args(tmp_path)]
    if busy_again:
        with pytest.raises(SystemExit):
            cli_main(*plan, "--plan.dry_run=true")
    else:
        cli_main(*plan, "--plan.dry_run=true")
    out, err = capsys.readouterr()
    assert len(profiled) == 2  # once on the cores that turned busy, once more on quiet ones
    assert "plan: the cores are busy after profiling: a convolution on 2 thread(s) got 50%" in out
    assert "plan: the cores are quiet again (95%)." in out and "plan: profiling again, on quiet cores" in out
    if busy_again:
        refusal = "error: the cores were busy again while plan profiled (a convolution on 2 thread(s) got 50%"
        assert err.strip().splitlines()[-1].startswith(refusal)
