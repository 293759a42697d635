"""What ``plan`` is asked: its ``--plan.*`` options, checked, and how they sit among ``fit``'s arguments."""

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import yaml

from multigpu.errors import UsageError, check_at_least
from multigpu.strategies import PLANNED_STRATEGIES
from multigpu.strategies.pipeline.stage_placement import SCHEDULES
from multigpu.timing.busy_cores import IF_BUSY

__all__ = ["BUSY_REMEDY", "PlanOptions", "check_no_plan_section", "without_plan_options"]

BUSY_REMEDY = "pass --plan.if_busy=go to plan anyway"


class PlanOptions:
    """What ``plan`` tries, which layouts it measures, and how long it trains each.

    Args:
        warmup: untimed optimizer steps first (default: 10 on GPUs, 2 on the CPU).
        steps: optimizer steps in each timed window (default: 4 on GPUs, 1 on the CPU).
        windows: timed windows per measured layout; their median is its figure, the slowest and fastest its range.
        measure: ``best`` measures the reference (one device), the ``top`` layouts by forecast and those
            forecast within the forecasts' error of the best; ``all`` measures every layout.
        top: how many of the best forecast layouts ``measure=best`` measures.
        strategies: the strategies to try besides one device, which is always measured (the reference).
        schedules: the pipeline schedules to try.
        micro_batches: the micro-batch counts a pipeline of P processes tries (default P, 2P and 4P).
        recompute_activations: ``auto`` tries it only for the layouts that would not fit without it
            (it adds a forward pass per step and saves only memory); ``both``, ``no`` or ``yes``.
        memory_per_device: GiB each device may use (on the CPU: each process), instead of the free memory.
        dry_run: list the layouts, the ones left out and the memory estimates, and train none; on busy cores it
            neither waits nor refuses (``if_busy`` is for plans that measure), and its last line says the forecasts
            were made on busy cores.
        budget_s: seconds the whole plan may take: it measures the layouts in the order of their forecasts
            (the reference and the forecast best first, always) while the next one would end within it, and
            says which it left unmeasured; ``null`` measures them all.
        if_busy: on the CPU, what to do when other processes keep the cores busy before or after profiling,
            or a virtual machine's host takes more than a tenth of their time while it profiles (the forecasts
            would measure them too): ``wait`` up to a minute for quiet cores, then profile again and refuse if
            they were busy again (where the time budget has no room for a second profile, its forecasts stand,
            marked busy in ``plan.json``); ``refuse`` at once; ``go`` on, saying so. The same after each measured run:
            ``wait`` measures it again once on quiet cores (where the budget allows), and keeps its figures,
            marked, where they were busy again, the cores stayed busy or the budget is spent; ``refuse`` at once;
            ``go`` marks them.
    """

    def __init__(
        self,
        warmup: int | None = None,
        steps: int | None = None,
        windows: int = 5,
        measure: Literal["best", "all"] = "best",
        top: int = 3,
        strategies: list[str] = list(PLANNED_STRATEGIES),
        schedules: list[str] = list(SCHEDULES),
        micro_batches: list[int] | None = None,
        recompute_activations: Literal["auto", "both", "no", "yes"] = "auto",
        memory_per_device: float | None = None,
        dry_run: bool = False,
        budget_s: float | None = 90.0,
        if_busy: IF_BUSY = "wait",
    ) -> None:
        for option, value, least in (
            ("warmup", warmup, 0),
            ("steps", steps, 1),
            ("windows", windows, 2),
            ("top", top, 1),
        ):
            if value is not None:
                check_at_least(f"--plan.{option}", value, least)
        if budget_s is not None and budget_s <= 0:
            raise UsageError(f"--plan.budget_s must be more than 0 seconds (or null: no bound), not {budget_s}.")
        if memory_per_device is not None and memory_per_device <= 0:
            raise UsageError(f"--plan.memory_per_device must be more than 0 GiB, not {memory_per_device}.")
        for count in micro_batches or ():
            check_at_least("--plan.micro_batches", count, 1)
        if unknown := [name for name in schedules if name.lower() not in SCHEDULES]:
            raise UsageError(f"--plan.schedules: {unknown[0]!r} is not one of {', '.join(SCHEDULES)}.")
        if unknown := [name for name in strategies if name not in PLANNED_STRATEGIES]:
            raise UsageError(f"--plan.strategies: {unknown[0]!r} is not one of {', '.join(PLANNED_STRATEGIES)}.")
        self.warmup, self.steps, self.windows, self.measure, self.top = warmup, steps, windows, measure, top
        self.strategies, self.schedules = strategies, schedules
        self.micro_batches, self.recompute = micro_batches, recompute_activations
        self.memory_per_device, self.dry_run = memory_per_device, dry_run
        self.budget_s, self.if_busy = budget_s, if_busy


def check_no_plan_section(args: Sequence[str]) -> None:
    """Refuse a config file with a ``plan`` section: each layout's ``fit`` reads the same files, and has no such
    section."""
    for index, arg in enumerate(args):
        path = arg.partition("=")[2] if arg.startswith("--config=") else args[index + 1] if arg == "--config" else None
        if (
            path
            and Path(path).is_file()
            and isinstance(loaded := yaml.safe_load(Path(path).read_text()), dict)
            and "plan" in loaded
        ):
            raise UsageError(
                f"{path} has a plan section, which fit (run for each layout) refuses: give the "
                "--plan.* options on the command line instead."
            )


def without_plan_options(args: Sequence[str]) -> list[str]:
    """``args`` without ``--plan.*`` options and their values."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg.startswith("--plan."):
            skip = "=" not in arg
        else:
            kept.append(arg)
    return kept
