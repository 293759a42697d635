"""``plan``'s measurements: the split layouts balanced by their blocks' time, then the layouts chosen to measure
trained in fresh processes through ``main.py fit``, their figures scraped from what the run writes."""

import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from multigpu.errors import UsageError
from multigpu.planning.options import BUSY_REMEDY, without_plan_options
from multigpu.planning.profile import BlockProfile
from multigpu.planning.ranking import Outcome, ends_by
from multigpu.planning.selection import Setting
from multigpu.strategies.layout import Layout, Refusal
from multigpu.strategies.partition import balance_by_cost
from multigpu.timing.busy_cores import IF_BUSY, note_if_busy, read_cpu_clock, wait_for_quiet
from multigpu.timing.step_timer import step_timer
from multigpu.timing.timed_runs import RunFailed, fit_command, last_error, run

__all__ = ["LAYOUT_TIMEOUT_S", "TimedSteps", "balanced", "measure"]

LAYOUT_TIMEOUT_S = 1200  # a layout still training after 20 minutes has hung (a deadlock, say): it is stopped


def balanced(layouts: list[Layout], profile: BlockProfile) -> tuple[list[Layout], list[Refusal]]:
    """The split layouts with the balance that evens out their blocks' measured time, as ``balance_by: time``
    would choose it in each run (``profile``, at each layout's micro-batch and share of the cores). Those whose
    micro-batches cannot train (BatchNorm given one value per channel) are refused."""
    balanced, refusals = [], []
    for layout in layouts:
        if layout.num_stages > 1:
            times = profile.times(*layout.timed_input)
            if isinstance(times, str):
                refusals.append(Refusal(layout.label, times))
                continue
            layout = replace(
                layout, balance=tuple(balance_by_cost(times.cost(layout.micro_batches), layout.num_stages))
            )
        balanced.append(layout)
    return balanced, refusals


@dataclass(frozen=True)
class TimedSteps:
    """How each layout is timed: ``warmup`` untimed steps, then ``windows`` windows of ``steps`` steps, each step of
    ``accumulate`` loader batches per replica."""

    warmup: int
    steps: int
    windows: int
    accumulate: int = 1

    @property
    def timed(self) -> int:
        """The steps timed after the warm-up."""
        return self.steps * self.windows

    def training_s(self, outcome: Outcome) -> float:
        """The seconds ``outcome``'s forecast gives its timed steps and warm-up (0 without a forecast)."""
        images = outcome.layout.batch_size * outcome.layout.replicas * self.accumulate * (self.warmup + self.timed)
        return images / outcome.forecast if outcome.forecast else 0.0


class _Budget:
    """What is left of the time budget: a ``deadline`` on ``time.monotonic()``'s clock (``None``: no budget), and the
    most a run took for its forecast training time so far (``stretch``), which the next runs are expected to take
    too."""

    def __init__(self, deadline: float | None) -> None:
        self.deadline, self.stretch = deadline, 1.0

    def allows(self, seconds: float) -> bool:
        return ends_by(self.deadline, seconds)

    def took(self, seconds: float, training_s: float) -> None:
        """A run on quiet cores took ``seconds`` for a forecast training time of ``training_s``."""
        if training_s > 0:
            self.stretch = max(self.stretch, seconds / training_s)


def measure(
    outcomes: list[Outcome],
    args: Sequence[str],
    setting: Setting,
    timed: TimedSteps,
    deadline: float | None = None,
    if_busy: IF_BUSY | None = None,
) -> list[Outcome]:
    """Train each layout in fresh processes, in the given order, timed as ``timed`` says; its figures, or why it
    failed. With a ``deadline`` (``time.monotonic()``'s clock) a layout is left unmeasured, and so are those after
    it, once it would end past it: its forecast training time, times the most that the runs so far took for theirs
    (starting processes, building the network and the first steps, which are slower, grow with a step's time),
    and ``FORECAST_ERROR`` more, the most a forecast is taken to err when choosing which to measure (the first
    pipeline measured, often the fourth layout, starts slower still). The first layout (the reference) and the best
    forecast are measured whatever the time, and a line says by how much they ran past the deadline.

    With ``if_busy`` (on the CPU) the cores are checked after each run, and the time a virtual machine's host
    stole since it began (``busy_cores``): a run on busy cores measured them too, so it is said in one line and,
    as ``if_busy`` says, measured again once they are quiet (``wait``: once, where the deadline allows, for the
    reference and the best forecast too; still busy, or no time left, its figures are kept and marked), refused
    (``refuse``), or kept and marked (``go``)."""
    entry = Path(sys.argv[0]).resolve()
    if entry.suffix != ".py":
        raise UsageError("run plan as `python main.py plan ...`: it launches main.py fit for each layout.")
    user_args = without_plan_options(args)
    images = setting.batch_size * setting.devices * timed.accumulate * (timed.warmup + timed.timed + 1)
    always = {0, max(range(len(outcomes)), key=lambda i: outcomes[i].forecast or 0.0)} if outcomes else set()
    measured: list[Outcome] = []
    left: list[Outcome] = []
    budget = _Budget(deadline)
    with tempfile.TemporaryDirectory(prefix="multigpu-plan-") as tmp:
        folder = Path(tmp)
        for index, outcome in enumerate(outcomes):
            training_s = timed.training_s(outcome)
            if index not in always and (left or not budget.allows(training_s * budget.stretch)):
                left.append(outcome)
                measured.append(outcome)
                continue
            options = [*user_args, *outcome.layout.fit_options(setting.device_ids)]
            timer = step_timer(timed.warmup, folder / f"layout{index}.json", timed.steps)
            command = fit_command(entry, options, folder, f"plan-{index}", timed.warmup + timed.timed, images, timer)
            trained = _measured(outcome, command, folder / f"layout{index}", training_s, budget, if_busy)
            print(f"  [{index + 1}/{len(outcomes)}] {trained.layout.label}: {_said(trained)}", flush=True)
            measured.append(trained)
    if left:
        print(
            f"  not measured, the time budget spent: {', '.join(o.layout.label for o in left)} "
            f"(raise --plan.budget_s to measure them)",
            flush=True,
        )
    if deadline is not None and (over := time.monotonic() - deadline) >= 1.0:
        print(
            f"  past the time budget by {over:.0f} s: the reference and the best forecast are measured whatever the "
            f"time, the others while their forecast run ends within it",
            flush=True,
        )
    return measured


def _said(trained: Outcome) -> str:
    if trained.failure:
        return f"failed: {trained.failure}"
    low, high = trained.interval
    said = f"{trained.images_per_s:.1f} img/s ({low:.1f}-{high:.1f}), forecast {trained.forecast or 0:.1f}"
    return said + (", on busy cores" if trained.busy else "")


def _measured(
    outcome: Outcome, command: list[str], stem: Path, training_s: float, budget: _Budget, if_busy: IF_BUSY | None
) -> Outcome:
    """``outcome`` trained by ``command`` (``_trained``), its cores checked after it with ``if_busy``: measured again
    once they are quiet where ``if_busy`` and the budget allow, marked busy where the figures stand on busy cores."""
    start, clock = time.monotonic(), read_cpu_clock() if if_busy else None
    trained = _trained(outcome, command, stem)
    check = note_if_busy("plan", f"after measuring {outcome.layout.label}", clock) if if_busy else None
    if check is None or trained.failure or not check.busy:
        budget.took(time.monotonic() - start, training_s)  # a run on busy cores says nothing of the next one's time
        return trained
    trained = replace(trained, busy=check.reason)
    if if_busy == "refuse":
        raise UsageError(
            f"the cores were busy while {outcome.layout.label} trained ({check}): "
            f"{check.measures_too('its', BUSY_REMEDY)}"
        )
    # The budget allows the reference and the best forecast one run whatever the time, not a second, taken to last
    # as long as the first did (on busy cores), or as its forecast, the longer
    again_s = max(training_s * budget.stretch, time.monotonic() - start)
    if if_busy == "go" or not budget.allows(again_s) or wait_for_quiet("plan", check).busy:
        return trained
    if not budget.allows(again_s):  # the wait spent what the budget had left
        return trained
    print(f"plan: measuring {outcome.layout.label} again, on quiet cores", flush=True)
    start, clock = time.monotonic(), read_cpu_clock()
    again = _trained(outcome, command, stem)
    if again.failure:  # the first figures stay, marked
        print(
            f"plan: {outcome.layout.label} failed when measured again ({again.failure}); its first figures stay, "
            "marked busy",
            flush=True,
        )
        return trained
    check = note_if_busy("plan", f"after measuring {outcome.layout.label}", clock)
    if check is not None and check.busy:
        return replace(again, busy=check.reason)
    budget.took(time.monotonic() - start, training_s)
    return again


def _trained(outcome: Outcome, command: list[str], stem: Path) -> Outcome:
    """``outcome`` with the figures of a run of ``command``, which writes them to ``stem``.json and its output to
    ``stem``.log, or with why it failed."""
    log = stem.with_suffix(".log")
    for earlier in stem.parent.glob(f"{stem.name}.json*"):  # a run measured again: the first one's figures
        earlier.unlink()
    try:
        return replace(outcome, figures=run(command, stem.with_suffix(".json"), log, timeout=LAYOUT_TIMEOUT_S))
    except RunFailed as failure:
        if "still running" in str(failure):
            return replace(outcome, failure=f"still training after {LAYOUT_TIMEOUT_S} s: stopped")
        return replace(outcome, failure=last_error(log.read_text()))
