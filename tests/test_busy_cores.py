"""A busy machine is noticed, not believed: ``plan`` checks the cores it profiles on, and says so when other
processes keep them busy."""

import os
import subprocess
import sys
import time

import pytest
from helpers import SMOKE, cli_main, run_args

from multigpu.timing import busy_cores
from multigpu.timing.busy_cores import cores


def plan_on_2_cpus(tmp_path, *options: str) -> list[str]:
    """``main.py plan``'s arguments for the smoke recipe on 2 CPU devices, its outputs under ``tmp_path``."""
    return [
        "plan",
        "--config",
        SMOKE,
        "--trainer.accelerator=cpu",
        "--trainer.devices=2",
        *run_args(tmp_path),
        *options,
    ]


@pytest.fixture
def busy_machine():
    """A process spinning on the one core this test runs on (both pinned to it), as another training run would keep
    it: a convolution gets half of that core at most, on a loaded machine or a quiet one, and the other test
    running beside keeps the machine's other cores."""
    allowed = os.sched_getaffinity(0)
    core = {min(allowed)}
    os.sched_setaffinity(0, core)
    spin = f"import os; os.sched_setaffinity(0, {core})\nwhile True: pass"
    spinner = subprocess.Popen([sys.executable, "-c", spin])
    time.sleep(0.5)
    assert cores() == 1
    yield
    spinner.kill()
    spinner.wait()
    os.sched_setaffinity(0, allowed)


def test_busy_cores_are_measured_as_busy(busy_machine, monkeypatch):
    monkeypatch.setattr(busy_cores, "read_cpu_clock", lambda: None)  # another process, not a host's other machines
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
    monkeypatch.setattr(busy_cores, "read_cpu_clock", lambda: None)  # another process, not a host's other machines
    with pytest.raises(SystemExit) as exit_info:
        cli_main(*plan_on_2_cpus(tmp_path, f"--plan.if_busy={if_busy}"))
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
    check = lambda threads=None, since=None: busy_cores.CoreCheck(2, next(shares))  # noqa: E731
    monkeypatch.setattr(busy_cores, "check_cores", check)
    monkeypatch.setattr(command, "check_cores", check)
    monkeypatch.setattr(busy_cores.time, "sleep", lambda seconds: None)
    profiled = []
    monkeypatch.setattr(command, "_forecasts", lambda *args: profiled.append(args) or ([], [], {}))
    monkeypatch.setattr(command, "process_age_s", lambda: 0.0)  # the budget's clock starts now, not with pytest
    with pytest.raises(SystemExit):  # with nothing profiled, nothing is measured: "no layout trained" at the end
        cli_main(*plan_on_2_cpus(tmp_path))
    out, err = capsys.readouterr()
    assert len(profiled) == 2  # once on the cores that turned busy, once more on quiet ones
    assert "plan: the cores are busy after profiling: a convolution on 2 thread(s) got 50%" in out
    assert "plan: the cores are quiet again (95%)." in out and "plan: profiling again, on quiet cores" in out
    if busy_again:
        refusal = "error: the cores were busy again while plan profiled (a convolution on 2 thread(s) got 50%"
    else:
        refusal = "error: no layout trained, so nothing was written"
    assert err.strip().splitlines()[-1].startswith(refusal)


def test_a_dry_run_on_busy_cores_neither_waits_nor_refuses_and_says_how_sure_it_is(monkeypatch, capsys, tmp_path):
    """Busy before and after profiling, whatever --plan.if_busy says: one profile, no wait, and its last line says
    the forecasts were made on busy cores."""
    from multigpu.planning import command

    check = lambda threads=None, since=None: busy_cores.CoreCheck(2, 0.5)  # noqa: E731
    monkeypatch.setattr(busy_cores, "check_cores", check)
    monkeypatch.setattr(command, "check_cores", check)
    monkeypatch.setattr(busy_cores.time, "sleep", lambda seconds: pytest.fail("a dry run waited"))
    profiled = []
    monkeypatch.setattr(command, "_forecasts", lambda *args: profiled.append(args) or ([], [], {}))
    cli_main(*plan_on_2_cpus(tmp_path), "--plan.dry_run=true", "--plan.if_busy=refuse")
    out = capsys.readouterr().out
    assert len(profiled) == 1
    assert "plan: the cores are busy before profiling: a convolution on 2 thread(s) got 50%" in out
    last = out.strip().splitlines()[-1]
    assert "; forecast on busy cores (a convolution on 2 thread(s) got 50%" in last, last
    assert "run it again on quiet cores for firm figures; nothing trained, nothing written" in last, last


def test_the_time_a_host_stole_is_read_from_proc_stat(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  600 10 200 3000 40 0 10 140 0 0\ncpu0 300 5 100 1500 20 0 5 70 0 0\n")
    before = busy_cores.read_cpu_clock(stat)
    assert before == busy_cores.CpuClock(wanted=960, stolen=140)  # idle and waiting on the disk left out
    stat.write_text("cpu  1400 10 300 3300 40 0 10 440 0 0\n")  # 1,500 ticks later: 300 idle, 300 stolen
    assert busy_cores.read_cpu_clock(stat).stolen_share_since(before) == pytest.approx(0.25)
    stat.write_text("cpu  600 10 200 3000 40 0 10\n")  # a kernel that does not count stolen time
    assert busy_cores.read_cpu_clock(stat) is None
    assert busy_cores.read_cpu_clock(tmp_path / "absent") is None  # not Linux


@pytest.fixture
def virtual_machine(monkeypatch):
    """A virtual machine's /proc/stat, whose host steals what the test says: ``steal(wanted, stolen)`` moves its
    clock on by that many ticks; the convolution finds its 2 cores quiet (99%)."""
    from multigpu.planning import command

    clock = {"wanted": 0, "stolen": 0}

    def steal(wanted: int, stolen: int) -> None:
        clock["wanted"] += wanted
        clock["stolen"] += stolen

    read = lambda: busy_cores.CpuClock(**clock)  # noqa: E731
    monkeypatch.setattr(busy_cores, "read_cpu_clock", read)
    monkeypatch.setattr(command, "read_cpu_clock", read)
    monkeypatch.setattr(busy_cores, "threads_per_process", lambda processes: 2)
    monkeypatch.setattr(busy_cores, "_share", lambda threads: 0.99)
    monkeypatch.setattr(busy_cores.time, "sleep", lambda seconds: None)
    return steal


@pytest.mark.parametrize("if_busy", ["go", "wait"])
def test_plan_says_when_the_host_stole_the_cores_while_it_profiled(
    if_busy, virtual_machine, monkeypatch, capsys, tmp_path
):
    """A virtual machine whose host ran other machines on its cores while plan profiled: the convolution finds
    the cores quiet before and after, but 30% of their time was stolen meanwhile. plan says so; told to go on, it
    goes on; told to wait, it finds them quiet, profiles again, and refuses when the host steals as much again."""
    from multigpu.planning import command

    profiled = []
    monkeypatch.setattr(
        command, "_forecasts", lambda *args: profiled.append(args) or virtual_machine(1000, 300) or ([], [], {})
    )
    monkeypatch.setattr(command, "process_age_s", lambda: 0.0)  # the budget's clock starts now, not with pytest
    with pytest.raises(SystemExit) as exit_info:  # nothing profiled, nothing measured: "no layout trained" at best
        cli_main(*plan_on_2_cpus(tmp_path), f"--plan.if_busy={if_busy}")
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    stolen = (
        "plan: the cores are busy after profiling: a convolution on 2 thread(s) got 99% of their cores (quiet "
        "cores: 85% or more), and the host stole 30% of the cores' time while it measured (steal in /proc/stat, of "
        "the time they ran or waited to run; quiet: 10% or less); the host runs other virtual machines on them."
    )
    assert stolen in out and "busy before profiling" not in out
    if if_busy == "go":
        assert len(profiled) == 1
        assert "plan: going on (if_busy=go): its figures measure the host's other virtual machines too." in out
    else:
        assert len(profiled) == 2
        assert "plan: the cores are quiet again (99%)." in out and "plan: profiling again, on quiet cores" in out
        line = err.strip().splitlines()[-1]
        assert line.startswith("error: the cores were busy again while plan profiled (a convolution on 2 thread(s)")
        assert "the host stole 30% of the cores' time" in line and line.endswith(
            "its figures would measure the host's other virtual machines too. Try again when the host is quieter, "
            "or pass --plan.if_busy=go to plan anyway."
        )


@pytest.mark.parametrize(
    ("if_busy", "budget_s", "wait_s", "profiles"),
    [("wait", 90, 0, 1), ("go", 90, 0, 1), ("wait", 200, 0, 2), ("wait", 110, 30, 1)],
)
def test_a_busy_profile_is_profiled_again_where_the_budget_has_room_or_stands_marked(
    if_busy, budget_s, wait_s, profiles, virtual_machine, monkeypatch, capsys, tmp_path
):
    """The host stole 30% of the cores' time while plan profiled, which took 45 s of the test's clock. With a budget
    of 90 s a second profile (from 45 s, 54 s with the forecasts' 20%) would end past it: told to wait, plan neither
    waits nor profiles again, says why, and its forecasts stand, marked busy in what ``plan.json`` records; told to
    go on, the same mark. With 200 s it profiles again, and the second profile (quiet) is not marked. With 110 s it
    waits, but a wait of 30 s spends the room (75 s and 54 s past 110): the forecasts stand, marked."""
    from types import SimpleNamespace

    from multigpu.planning import command, measurement, ranking

    clock, bases = [0.0], []

    def profile(*args):
        virtual_machine(1000, 300 if not bases else 0)
        clock[0] += 45.0
        bases.append({})
        return [], [], bases[-1]

    waits = []

    def wait_for_quiet(who, check):
        waits.append(who)
        clock[0] += wait_s
        return busy_cores.CoreCheck(2, 1)

    monkeypatch.setattr(busy_cores, "wait_for_quiet", wait_for_quiet)
    monkeypatch.setattr(command, "_forecasts", profile)
    for module in (command, measurement, ranking):
        monkeypatch.setattr(module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(command, "process_age_s", lambda: 0.0)
    with pytest.raises(SystemExit):  # nothing profiled, nothing measured: "no layout trained"
        cli_main(*plan_on_2_cpus(tmp_path, f"--plan.if_busy={if_busy}", f"--plan.budget_s={budget_s}"))
    out = capsys.readouterr().out
    assert len(bases) == profiles and ("plan: profiling again, on quiet cores" in out) == (profiles == 2)
    assert len(waits) == (if_busy == "wait" and budget_s > 90)  # no wait where there is no room to profile again
    if profiles == 2:
        assert "busy" not in bases[-1]
        return
    assert bases[0]["busy"].startswith("a convolution on 2 thread(s) got 99% of their cores")
    assert bases[0]["busy"].endswith("the host runs other virtual machines on them")
    waited = f", the wait for quiet cores {wait_s} s" if wait_s else ""
    no_room = (
        f"plan: no time to profile again within --plan.budget_s={budget_s} (the profile took 45 s{waited}): its "
        "forecasts stand, marked busy in plan.json, and each run it measures is checked as it trains (pass a larger "
        "--plan.budget_s, or null, to profile again)"
    )
    assert (no_room in out) == (if_busy == "wait")


def test_a_profile_that_stands_on_busy_cores_says_how_it_is_marked_and_what_is_checked_next(capsys):
    """The line says where the mark is and that every run is checked (a dry run never profiles again)."""
    from types import SimpleNamespace

    from multigpu.planning.command import _no_time_to_profile_again

    _no_time_to_profile_again(SimpleNamespace(budget_s=90), 73.4)
    assert capsys.readouterr().out == (
        "plan: no time to profile again within --plan.budget_s=90 (the profile took 73 s): its forecasts stand, "
        "marked busy in plan.json, and each run it measures is checked as it trains (pass a larger --plan.budget_s, "
        "or null, to profile again)\n"
    )


def test_plan_says_when_the_host_steals_the_cores_as_it_checks_them(virtual_machine, monkeypatch, capsys, tmp_path):
    """The host stealing a third of the cores' time in every try of the convolution before profiling: busy, though
    the convolution got 99% of the time it ran; refused at once, with what the user can do."""
    monkeypatch.setattr(busy_cores, "_share", lambda threads: virtual_machine(90, 30) or 0.99)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(*plan_on_2_cpus(tmp_path, "--plan.if_busy=refuse"))
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert "plan: the cores are busy before profiling: a convolution on 2 thread(s) got 99% of their cores" in out
    assert "and the host stole 33% of the cores' time" in out and "timing the blocks" not in out
    refusal = err.strip().splitlines()[-1]
    assert refusal.endswith(
        "plan's figures would measure the host's other virtual machines too. Try again when the host is quieter, "
        "or pass --plan.if_busy=go to plan anyway."
    )


def test_a_check_busy_both_ways_names_both():
    check = busy_cores.CoreCheck(2, 0.5, 0.3)
    assert check.busy and check.first_remedy == "Stop it"
    assert check.cause == "another process is running on them, and the host runs other virtual machines on them"
    assert check.other == "the other process and the host's other virtual machines"
    assert not busy_cores.CoreCheck(2, 0.9, 0.1).busy  # 10% stolen is still quiet
    jumped = busy_cores.CpuClock(100, 500).stolen_share_since(busy_cores.CpuClock(0, 0))
    assert jumped == 1.0  # a counter that jumped is no share above 1


@pytest.mark.parametrize(
    ("if_busy", "stolen", "deadline", "trained", "marked"),
    [
        ("wait", [300, 0], None, ["auto", "ddp", "ddp"], False),  # measured again on quiet cores
        ("wait", [300, 300], None, ["auto", "ddp", "ddp"], True),  # busy again: kept, marked
        ("wait", [300, None], None, ["auto", "ddp", "ddp"], True),  # failed when measured again: kept, marked
        ("wait", [300], 7.5, ["auto", "ddp"], True),  # no time left to measure it again: kept, marked
        ("wait", [300], 3.0, ["auto", "ddp"], True),  # past the budget: measured once, as the best forecast
        ("go", [300], None, ["auto", "ddp"], True),
        ("refuse", [300], None, ["auto", "ddp"], None),  # refused, with the reason
    ],
)
def test_a_layout_measured_while_the_host_stole_the_cores_is_measured_again_or_marked(
    if_busy, stolen, deadline, trained, marked, virtual_machine, monkeypatch, capsys
):
    """The host steals 30% of the cores' time while ``ddp`` trains (the reference trains on quiet cores): plan
    checks the cores after each measured run and says so; as ``--plan.if_busy`` says, it measures ddp again once
    the cores are quiet (where the time budget allows), keeps its figures marked (in the table and ``plan.json``),
    or refuses. Each run takes a second of the test's clock."""
    from types import SimpleNamespace

    from multigpu.errors import UsageError
    from multigpu.planning import measurement, ranking
    from multigpu.planning.ranking import Outcome
    from multigpu.planning.report import print_report
    from multigpu.strategies import LAYOUTS

    runs, steals = [], iter(stolen)

    clock = [0.0]

    def fake_run(command, out, log, timeout):
        strategy = next(arg for arg in command if arg.startswith("--trainer.strategy=")).split("=")[1]
        runs.append(strategy)
        clock[0] += 1.0
        if (steal := next(steals) if strategy == "ddp" else 0) is None:
            log.write_text("RuntimeError: the second run broke\n")
            raise measurement.RunFailed("ended with an error")
        virtual_machine(1000, steal)
        return {"window_images_per_s": [10.0, 11.0], "images_per_s": 10.5, "peak_memory_bytes": [1]}

    monkeypatch.setattr(measurement, "run", fake_run)
    for module in (measurement, ranking):
        monkeypatch.setattr(module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(measurement, "read_cpu_clock", busy_cores.read_cpu_clock)  # the fixture's /proc/stat
    monkeypatch.setattr("sys.argv", ["main.py"])
    # The reference first, then ddp, the best forecast (both measured whatever the time): ddp trains 2 x 8 images for
    # 1 + 1 x 2 steps, 4.8 s at 10 img/s, 5.76 s with the forecast's 20%; it starts at 1 s and would end by 6.76 s,
    # within a deadline of 7.5 s, past one of 3 s; measured again from 2 s, it would end past either.
    order = [
        Outcome(LAYOUTS[strategy](name, 2, 2, 8), [1], forecast)
        for name, strategy, forecast in (("1 device", "auto", 9.0), ("ddp", "ddp", 10.0))
    ]
    setting = SimpleNamespace(batch_size=8, devices=2, device_ids=None)
    if marked is None:
        with pytest.raises(UsageError) as refusal:
            measurement.measure(order, [], setting, measurement.TimedSteps(1, 1, 2, 1), deadline, if_busy)
        assert str(refusal.value).startswith("the cores were busy while ddp trained (a convolution on 2 thread(s)")
        assert str(refusal.value).endswith(
            "its figures would measure the host's other virtual machines too. Try again when the host is quieter, "
            "or pass --plan.if_busy=go to plan anyway."
        )
        assert runs == trained
        return
    measured = measurement.measure(order, [], setting, measurement.TimedSteps(1, 1, 2, 1), deadline, if_busy)
    out = capsys.readouterr().out
    assert runs == trained and measured[0].busy is None
    assert "plan: the cores are busy after measuring ddp: a convolution on 2 thread(s) got 99% of their cores" in out
    assert "and the host stole 30% of the cores' time" in out
    assert ("plan: measuring ddp again, on quiet cores" in out) == (len(trained) == 3)
    assert (measured[1].busy is not None) == marked
    failed_again = "plan: ddp failed when measured again (RuntimeError: the second run broke); its first figures stay"
    assert (failed_again in out) == (None in stolen)
    assert out.rstrip().endswith("ddp: 10.5 img/s (10.0-11.0), forecast 10.0" + (", on busy cores" if marked else ""))
    print_report(measured, [], None, (2**30, True), measured=True)
    table = capsys.readouterr().out
    assert ("ddp (busy)" in table) == marked
    assert ("  (busy) ddp trained on busy cores, and measured them too: a convolution on" in table) == marked
