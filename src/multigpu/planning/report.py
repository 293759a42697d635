"""What ``plan`` prints and writes: the table of forecasts and measurements with its ties, the layouts left out,
``plan.yaml``, ``plan.json`` and a chart."""

import json
import shlex
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from multigpu.cli.run_options import TrainerOptions
from multigpu.planning.bar_chart import write_bar_chart
from multigpu.planning.ranking import Outcome, choice, chosen_by_forecast, ranked, tied
from multigpu.strategies.layout import Refusal

__all__ = ["PlanInvocation", "dry_run_line", "print_report", "write_outputs"]

MIB = 2**20


def _efficiency(outcome: Outcome, outcomes: Sequence[Outcome]) -> float | None:
    """img/s over (devices x one device's img/s)."""
    reference = next((o for o in outcomes if o.layout.reference and o.figures and not o.layout.recompute), None)
    if reference is None or not outcome.figures:
        return None
    return outcome.images_per_s / (outcome.layout.devices * reference.images_per_s)


def _mib(values: Sequence[int]) -> str:
    return "/".join(f"{value / MIB:,.0f}" for value in values)


def _in_order(outcomes: Sequence[Outcome]) -> list[Outcome]:
    """The measured outcomes fastest first, then the others by forecast."""
    others = sorted((o for o in outcomes if not o.figures), key=lambda o: -(o.forecast or 0.0))
    return ranked(outcomes) + others


def print_report(
    outcomes: Sequence[Outcome],
    refusals: Sequence[Refusal],
    device_ids: Sequence[int] | None,
    budget: tuple[int, bool],
    measured: bool,
) -> None:
    """The layouts left out and why, then the table: each layout's forecast and, if it ran, its measurement."""
    if refusals:
        print("\nleft out:")
        for refusal in refusals:
            print(f"  {refusal}")
    for outcome in outcomes:
        if outcome.failure:
            print(f"  {outcome.layout.label}: failed: {outcome.failure}")
    limit, per_device = budget
    room = f"{limit / MIB:,.0f} MiB {'per device' if per_device else 'for all processes'}"
    ordered = _in_order(outcomes)
    ties = {id(o) for o in tied(outcomes)}
    if measured:
        print("\n(img/s: the median of the timed windows; range: the slowest and the fastest window; = ties with #1)")
    else:
        print(f"\n{len(outcomes)} layouts would run (forecast, and memory estimates with {room} available):")
    print(
        f"\n{'#':>4}  {'layout':<44} {'forecast':>9} {'img/s':>7} {'range':>13} {'error':>6} "
        f"{'peak MiB':>13} {'estimate MiB':>13} {'efficiency':>10}"
    )
    for place, outcome in enumerate(ordered, 1):
        forecast = f"{outcome.forecast:.1f}" if outcome.forecast else "-"
        if outcome.figures:
            low, high = outcome.interval
            mark = "=" if id(outcome) in ties and len(ties) > 1 else " "
            efficiency = _efficiency(outcome, outcomes)
            peaks = _mib(outcome.figures["peak_memory_bytes"])
            label = f"{outcome.layout.label} (busy)" if outcome.busy else outcome.layout.label
            print(
                f"{place:>3}{mark}  {label:<44} {forecast:>9} {outcome.images_per_s:>7.1f} "
                f"{f'{low:.1f}-{high:.1f}':>13} {outcome.error:>+6.0%} {peaks:>13} "
                f"{_mib(outcome.estimate):>13} {'-' if efficiency is None else f'{efficiency:.2f}':>10}"
            )
        else:
            said = "failed" if outcome.failure else "-"
            print(
                f"{'':>4}  {outcome.layout.label:<44} {forecast:>9} {said:>7} {'':>13} {'':>6} {'':>13} "
                f"{_mib(outcome.estimate):>13}"
            )
    if busy := [outcome for outcome in outcomes if outcome.busy]:
        print()
    for outcome in busy:
        print(f"  (busy) {outcome.layout.label} trained on busy cores, and measured them too: {outcome.busy}.")
    chosen = choice(outcomes)
    if chosen is not None:
        others = [o.layout.label for o in tied(outcomes) if o is not chosen]
        if chosen_by_forecast(outcomes):
            why = (
                f"by forecast ({chosen.forecast or 0:.1f} img/s, the best of the layouts measured): every one trained "
                "on busy cores, so their figures measure the other work too (plan again on quiet cores to choose by "
                "measurement)"
            )
        elif others:
            why = (
                f"tied with {', '.join(others)} (their medians lie within the fastest one's range), and the simplest: "
                "the fewest processes, then the least memory"
            )
        elif len(ranked(outcomes)) == 1:
            why = "the only layout measured, so nothing was compared with it"
        else:
            why = "the fastest, and no other layout's median lies within its range"
        print(f"\nchosen: {chosen.layout.label}: {why}.")
    print("\nfit options:")
    for outcome in ordered:
        print(f"  {outcome.layout.label}: {' '.join(outcome.layout.fit_options(device_ids))}")


@dataclass(frozen=True)
class PlanInvocation:
    """What ``plan`` was given: the options after ``plan`` on its command line, the run's name and where runs keep
    their checkpoints; what the ``fit`` command it prints is made of."""

    args: Sequence[str] = ()
    run_name: str = "run"
    checkpoint_root: str = "checkpoints"

    def fit_command(self, plan_yaml: Path, config: dict[str, Any]) -> str:
        """``python main.py fit`` with the options given to ``plan`` (but ``--plan.*``, the run's name and those the
        plan's ``config`` sets: the plan decides those), then ``--config plan_yaml``, and a run name of its own that
        has no checkpoint folder yet: a command that trains the chosen layout as printed."""
        chosen = {f"{section}.{key}" for section, values in config.items() for key in values}
        kept, skip_value = [], False
        for arg in self.args:
            if skip_value:
                skip_value = False
                continue
            name = arg.split("=", 1)[0].removeprefix("--")
            decided = (
                name.startswith("plan.")
                or name == "run_name"
                or any(name == key or name.startswith(f"{key}.") for key in chosen)
            )
            if decided:
                skip_value = arg.startswith("--") and "=" not in arg
                continue
            kept.append(arg)
        name, count = f"{self.run_name}-plan", 1
        while (Path(self.checkpoint_root) / name).exists():
            count += 1
            name = f"{self.run_name}-plan{count}"
        words = ["python", "main.py", "fit", *kept, "--config", str(plan_yaml), f"--run_name={name}"]
        return " ".join(shlex.quote(word) for word in words)


def write_outputs(
    outcomes: Sequence[Outcome],
    folder: Path,
    device_ids: Sequence[int] | None,
    trainer: TrainerOptions,
    title: str,
    selected: Sequence[Outcome],
    budget_s: float | None,
    elapsed_s: float,
    basis: dict,
    invocation: PlanInvocation = PlanInvocation(),
) -> Path | None:
    """Write the chosen layout as ``plan.yaml``, every forecast and figure as ``plan.json`` and the chart
    ``plan.png`` into ``folder``; return the config's path (None when no layout ran). ``selected``: the outcomes
    chosen to be measured, those that the time budget (``budget_s``) left unmeasured among them; ``elapsed_s``: the
    seconds plan took so far, its process's start included, which its last line sets against the budget;
    ``basis``: what the forecasts were built from (``plan.json`` keeps it, so that a forecast that missed can be
    traced); ``invocation``: what ``plan`` was given, for the ``fit`` command it prints."""
    chosen = choice(outcomes)
    if chosen is None:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    config = chosen.layout.config(device_ids)
    fit_trainer = config["trainer"]
    fit_trainer["accelerator"] = trainer.accelerator or "auto"
    if trainer.precision is not None:
        fit_trainer["precision"] = trainer.precision
    low, high = chosen.interval
    command = invocation.fit_command(folder / "plan.yaml", config)
    by_forecast = chosen_by_forecast(outcomes)
    how = f" by forecast ({chosen.forecast or 0:.1f} img/s; every layout measured on busy cores)" if by_forecast else ""
    header = (
        f"# The layout `python main.py plan` chose{how}: {chosen.layout.label}, {chosen.images_per_s:.1f} img/s "
        f"(windows {low:.1f}-{high:.1f}; {title}).\n# Train with it: {command}\n"
    )
    (folder / "plan.yaml").write_text(header + yaml.safe_dump(config, sort_keys=False))
    ties, picked = {id(o) for o in tied(outcomes)}, {o.layout.label for o in selected}
    rows = [
        {
            **asdict(outcome),
            "layout": outcome.layout.label,
            "images_per_s": outcome.images_per_s if outcome.figures else None,
            "interval": list(outcome.interval) if outcome.figures else None,
            "error": outcome.error,
            "tied_with_fastest": id(outcome) in ties,
            "chosen": outcome is chosen,
            "selected": outcome.layout.label in picked,
            "left_by_budget": outcome.layout.label in picked and not outcome.figures and outcome.failure is None,
            "efficiency": _efficiency(outcome, outcomes),
            "fit_options": outcome.layout.fit_options(device_ids),
        }
        for outcome in outcomes
    ]
    plan = {
        "title": title,
        "budget_s": budget_s,
        "elapsed_s": elapsed_s,
        "chosen_by": "forecast" if by_forecast else "measurement",
        "results": rows,
        "basis": basis,
    }
    (folder / "plan.json").write_text(json.dumps(plan, indent=2, default=list))
    bars = ranked(outcomes)
    notes = [
        ", ".join(
            ([f"forecast {o.forecast:.1f}"] if o.forecast else [])
            + (["chosen"] if o is chosen else ["tie"] if id(o) in ties else [])
        )
        for o in bars
    ]
    write_bar_chart(
        [o.layout.label for o in bars],
        [o.images_per_s for o in bars],
        notes,
        f"python main.py plan: {title}",
        folder / "plan.png",
        grey=[o.layout.reference for o in bars],
    )
    measured = sum(1 for outcome in outcomes if outcome.figures)
    figure = f"by forecast, {chosen.forecast or 0:.1f} img/s" if by_forecast else f"{chosen.images_per_s:.1f} img/s"
    busy = bool(basis.get("busy")) or any(outcome.busy for outcome in outcomes)
    print(
        f"\nplan: measured {measured} of {len(outcomes)} layouts {_time_taken(elapsed_s, budget_s, busy)}, and chose "
        f"{chosen.layout.label} ({figure}); wrote {folder / 'plan.yaml'}, plan.json and plan.png. Train with it: "
        f"{command}"
    )
    return folder / "plan.yaml"


def _time_taken(elapsed_s: float, budget_s: float | None, busy: bool) -> str:
    """How long plan took against its time budget, and where past it, why."""
    if budget_s is None:
        return f"in {elapsed_s:.0f} s (no time budget)"
    if elapsed_s <= budget_s:
        return f"in {elapsed_s:.0f} s, within its {budget_s:g} s budget"
    why = "the reference and the best forecast are measured whatever the time"
    if busy:
        why += ", and busy cores slowed the profile and the runs (and the waits for quiet ones)"
    return f"in {elapsed_s:.0f} s, {elapsed_s - budget_s:.0f} s past its {budget_s:g} s budget ({why})"


def dry_run_line(outcomes: Sequence[Outcome], refusals: Sequence[Any], busy: str | None = None) -> str:
    """The closing line of a dry run: what it forecast, the fastest forecast, how sure it is where the cores were
    busy (``busy``: why), and that nothing was written."""
    fastest = max((o for o in outcomes if o.forecast), key=lambda o: o.forecast or 0.0, default=None)
    best = f"; the fastest forecast: {fastest.layout.label}, {fastest.forecast:.1f} img/s" if fastest else ""
    unsure = (
        f"; forecast on busy cores ({busy}), so each is as far off as the other work took from the profile: run it "
        "again on quiet cores for firm figures"
        if busy
        else ""
    )
    return (
        f"\nplan (dry run): forecast {len(outcomes)} layouts and left out {len(refusals)}{best}{unsure}; nothing "
        "trained, nothing written (without --plan.dry_run it measures the best and writes plan.yaml)."
    )
