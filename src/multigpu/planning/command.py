"""``python main.py plan``: forecast every layout these devices allow, measure the few that matter, and write the
choice as a config.

    python main.py plan --trainer.devices=4                          # every layout of 4 GPUs
    python main.py plan --config configs/smoke.yaml --trainer.accelerator=cpu --trainer.devices=2
    python main.py plan --trainer.devices=8 --plan.dry_run=true      # forecasts only, nothing trains

It takes ``fit``'s options. For each layout (``layouts``) it estimates the memory of each
device from the network on the meta device (``memory_estimate``) and leaves out, saying so,
what would not fit. It times each block on the first device (``profile``), balances the split
layouts by those times, measures the links between the devices (``links``) and forecasts each
layout's images per second (``forecast``). Then it trains, in fresh processes through
``main.py fit`` on synthetic data of CIFAR-10's shape, the reference (one device) and the best
forecast layouts (``ranking``), timing repeated windows of steps (``multigpu.timing.timed_runs``, as
the benchmarks do), and picks the simplest of the layouts tied with the fastest (``report``).

The measurements stop when the time budget (``--plan.budget_s``, counted from the start of the process, Python's
own start-up and imports included) would run out before the next layout ends; the reference and the forecast best
are always measured. On the CPU it checks the cores before and after profiling (``busy_cores``), and after it the
time a virtual machine's host stole while it profiled: busy cores would make the forecasts measure another process
(or the host's other virtual machines), so it waits for them to quieten and profiles again (where the time
budget has room for it; else the forecasts stand, marked busy, for the measured runs to check), or refuses. It checks
them after each measured run too, and the time stolen while it trained: a run on busy cores is measured again once
they are quiet, or marked as such in the table and ``plan.json``.
"""

import os
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from lightning.pytorch.cli import LightningArgumentParser
from typing_extensions import override

from multigpu.cli.lightning_cli import MultiGPUCLI
from multigpu.cli.run_options import RunOptions
from multigpu.errors import UsageError
from multigpu.planning.forecast import forecast
from multigpu.planning.layouts import candidate_layouts
from multigpu.planning.links import ForkedRanks, fork_ranks, measure_links
from multigpu.planning.measurement import TimedSteps, balanced, measure
from multigpu.planning.options import BUSY_REMEDY, PlanOptions, check_no_plan_section
from multigpu.planning.ranking import Outcome, ends_by, in_measuring_order, to_measure
from multigpu.planning.report import PlanInvocation, dry_run_line, print_report, write_outputs
from multigpu.planning.resources import budget as memory_budget
from multigpu.planning.selection import Setting, choose, devices_of, setting_of
from multigpu.renamed_options import add_old_names
from multigpu.run.host_memory import give_back_freed_memory
from multigpu.strategies.layout import Layout, Refusal
from multigpu.timing.busy_cores import CoreCheck, check_cores, note_if_busy, read_cpu_clock, until_quiet

__all__ = ["PlanCLI", "plan", "process_age_s"]


class PlanCLI(MultiGPUCLI):
    """``fit``'s parser with ``--plan.*`` added; it checks the options and builds nothing."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        super().add_arguments_to_parser(parser)
        parser.add_class_arguments(PlanOptions, "plan")
        add_old_names(parser, "plan")

    @override
    def instantiate_classes(self) -> None:
        """Nothing is built here: each layout trains in processes of its own."""


def plan(args: Sequence[str], default_config_files: Sequence[str | Path]) -> None:
    """Run ``python main.py plan <args>``."""
    started = time.monotonic() - process_age_s()
    cli = PlanCLI(default_config_files=default_config_files, args=list(args), run=False)
    config = cli.config
    check_no_plan_section(args)
    options = PlanOptions(**vars(config["plan"]))
    run = RunOptions.of(config)
    if (run.trainer.num_nodes or 1) > 1:
        raise UsageError(
            "plan measures the layouts on this machine alone: drop --trainer.num_nodes, and add it to the fit "
            "command of the layout it chooses."
        )
    # The link probe's ranks on the CPU, forked before this process computes anything (``ForkedRanks``): before
    # ``setting_of``, which runs a network other than ResNet-50 once to check it, and the busy check
    cuda, devices, _ = devices_of(run.trainer)
    forked = fork_ranks(devices, cuda)
    try:
        _plan(run, options, args, started, forked)
    finally:
        if forked is not None:
            forked.dismiss()  # where plan ended before measuring the links: an error, an interrupt


def _plan(
    run: RunOptions, options: PlanOptions, args: Sequence[str], started: float, forked: ForkedRanks | None
) -> None:
    """``plan``, once its options are checked: profile, forecast, measure and report (``started``: the
    process's start, on ``time.monotonic()``'s clock; ``forked``: the link probe's ranks, where forked)."""
    trainer = run.trainer
    setting = setting_of(run)
    warmup = options.warmup if options.warmup is not None else (10 if setting.cuda else 2)
    steps = options.steps or (4 if setting.cuda else 1)
    layouts, refusals = candidate_layouts(
        setting.devices,
        setting.cuda,
        setting.batch_size,
        bool(run.recipe.compile),
        options.strategies,
        options.schedules,
        options.micro_batches,
    )
    where = f"{setting.devices} {'CUDA' if setting.cuda else 'CPU'} device(s)"
    print(
        f"plan: {where}, batch {setting.batch_size} per device, {setting.precision}, {warmup} warm-up steps and "
        f"{options.windows} timed windows of {steps} step(s) per measured layout",
        flush=True,
    )
    budget = memory_budget(setting.cuda, setting.device_ids or list(range(setting.devices)), options.memory_per_device)
    if setting.cuda:
        before = None
    elif options.dry_run:  # quick, whatever the cores: the forecasts say how sure they are instead
        before = note_if_busy("plan", "before profiling")
        before = before if before.busy else None
    else:
        before = until_quiet(options.if_busy, "plan", "before profiling", BUSY_REMEDY)
    deadline = None if options.budget_s is None else started + options.budget_s
    outcomes, left_out, basis = _profiled(run, setting, options, layouts, budget, deadline, before, forked)
    refusals += left_out
    give_back_freed_memory()  # the profiled blocks' memory, for the measured runs
    measured: list[Outcome] = []  # those chosen to be measured, as measured (or left by the budget)
    if not options.dry_run:
        accumulate = trainer.accumulate_grad_batches or 1
        selected = in_measuring_order(outcomes if options.measure == "all" else to_measure(outcomes, options.top))
        within = "" if options.budget_s is None else f", within {options.budget_s:.0f} s in all"
        spent = f"{time.monotonic() - started:.0f} s so far: Python's start-up, the profile and the links"
        print(f"measuring {len(selected)} of {len(outcomes)} layouts{within} ({spent})", flush=True)
        timed = TimedSteps(warmup, steps, options.windows, accumulate if isinstance(accumulate, int) else 1)
        measured = measure(selected, args, setting, timed, deadline, None if setting.cuda else options.if_busy)
        done = {id(before): after for before, after in zip(selected, measured)}
        outcomes = [done.get(id(outcome), outcome) for outcome in outcomes]
    folder = Path(trainer.log_root) / run.run_name
    print_report(outcomes, refusals, setting.device_ids, budget, measured=not options.dry_run)
    if (
        not options.dry_run
        and write_outputs(
            outcomes,
            folder,
            setting.device_ids,
            trainer,
            f"{where}, batch {setting.batch_size} per device, {setting.precision}",
            measured,
            options.budget_s,
            time.monotonic() - started,
            basis,
            PlanInvocation(args, run.run_name, run.checkpoint_root),
        )
        is None
    ):
        raise UsageError("no layout trained, so nothing was written: each was left out or failed, as listed above.")
    if options.dry_run:
        print(dry_run_line(outcomes, refusals, basis.get("busy")))


def process_age_s() -> float:
    """Seconds since this process started, Python's start-up and the imports included (docs/plan.md, "Running it",
    has how long they take), as the user's clock counts ``plan``'s time; 0 where ``/proc`` does not say (not
    Linux)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()  # after the name, which may hold spaces
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: the start, in clock ticks
    except (OSError, ValueError, IndexError):
        return 0.0


def _profiled(
    run: RunOptions,
    setting: Setting,
    options: PlanOptions,
    layouts: list[Layout],
    budget: tuple[int, bool],
    deadline: float | None,
    before: CoreCheck | None,
    forked: ForkedRanks | None = None,
) -> tuple[list[Outcome], list[Refusal], dict]:
    """``_forecasts``, with the cores checked after profiling on the CPU (``busy_cores``): where they were busy, kept
    in a dry run (which never waits), else as ``--plan.if_busy`` says: profiled again once they are quiet (``wait``,
    where a second profile would end within the time budget ``deadline``), refused (``refuse``), or kept (``go``, or
    no room for a second profile); kept, saying why under ``busy`` in what the forecasts were built from. ``before``:
    the check before profiling that found the cores busy, where plan went on; ``forked``: the link probe's ranks,
    forked as plan began, where it has them."""
    if setting.cuda:
        return _forecasts(run, setting, options, layouts, budget)
    clock, start = read_cpu_clock(), time.monotonic()
    outcomes, left_out, basis = _forecasts(run, setting, options, layouts, budget, forked)
    profiled_s = time.monotonic() - start
    busy: CoreCheck | None  # what the check after profiling found, where the cores were busy
    if options.dry_run:  # no wait, no second profile: the forecasts stand, and say so
        busy = note_if_busy("plan", "after profiling", clock)
        if (busy := busy if busy.busy else before) is not None:
            basis["busy"] = busy.reason
        return outcomes, left_out, basis
    waits = options.if_busy == "wait"
    if waits and not ends_by(deadline, profiled_s):  # no room to profile again: no wait either
        if (busy := note_if_busy("plan", "after profiling", clock)).busy:
            _no_time_to_profile_again(options, profiled_s)
        else:
            busy = None
    elif (busy := until_quiet(options.if_busy, "plan", "after profiling", BUSY_REMEDY, clock)) is not None and waits:
        if not ends_by(deadline, profiled_s):  # the wait for quiet cores spent the room
            _no_time_to_profile_again(options, profiled_s, time.monotonic() - start - profiled_s)
        else:  # the profile measured another process or machine: once more, on quiet cores
            print("plan: profiling again, on quiet cores", flush=True)
            clock = read_cpu_clock()
            outcomes, left_out, basis = _forecasts(run, setting, options, layouts, budget)
            if (again := check_cores(since=clock)).busy:
                raise UsageError(
                    f"the cores were busy again while plan profiled ({again}): {again.measures_too('its', BUSY_REMEDY)}"
                )
            return outcomes, left_out, basis
    if busy is None and options.if_busy == "go":
        busy = before  # profiled on the cores found busy before
    if busy is not None:
        basis["busy"] = busy.reason
    return outcomes, left_out, basis


def _no_time_to_profile_again(options: PlanOptions, profiled_s: float, waited_s: float = 0.0) -> None:
    """Say that a profile on busy cores stands: a second one would not end within the time budget, after the
    ``waited_s`` seconds of checking and waiting for quiet cores, if any."""
    waited = f", the wait for quiet cores {waited_s:.0f} s" if waited_s else ""
    print(
        f"plan: no time to profile again within --plan.budget_s={options.budget_s:g} (the profile took "
        f"{profiled_s:.0f} s{waited}): its forecasts stand, marked busy in plan.json, and each run it measures is "
        "checked as it trains (pass a larger --plan.budget_s, or null, to profile again)",
        flush=True,
    )


def _forecasts(
    run: RunOptions,
    setting: Setting,
    options: PlanOptions,
    layouts: list[Layout],
    budget: tuple[int, bool],
    forked: ForkedRanks | None = None,
) -> tuple[list[Outcome], list[Refusal], dict]:
    """Profile the network's blocks and the links, and forecast each layout that fits: the outcomes, the
    layouts left out with why, and what the forecasts were built from (the passes' seconds at every size timed,
    the whole network's update and the zero-bubble schedules' split factor at every thread count timed, the links'
    figures), which ``plan.json`` records."""
    profile = setting.profile(run.network, run.recipe)
    profile.measure_together({layout.timed_input for layout in layouts})
    layouts, refusals = balanced(layouts, profile)
    chosen, left_out = choose(layouts, setting, budget, options.recompute, bool(run.recipe.compile))
    refusals += left_out
    world = max(layout.processes for layout in chosen) if chosen else 1
    links = measure_links(world, setting.cuda, setting.device_ids, forked)
    contention, lockstep = profile.contention(links.world)  # from the profile's rounds: the level's own moment
    links = replace(links, contention=contention, lockstep=lockstep)
    outcomes = []
    for layout in chosen:
        expected = forecast(layout, profile, links, setting.memory)
        if isinstance(expected, str):
            refusals.append(Refusal(layout.label, expected))
        else:
            outcomes.append(Outcome(layout, setting.estimated_peaks(layout), expected))
    basis = {
        "passes_s": profile.passes(),
        "update_s": profile.updates(),
        "split_backward": profile.splits(),
        "links": links.figures(),
    }
    return outcomes, refusals, basis
