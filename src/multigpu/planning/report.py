"""What ``plan`` prints and writes: the ranked table, the layouts left out, ``plan.yaml``, ``plan.json`` and a chart."""

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from multigpu.bar_chart import write_bar_chart
from multigpu.planning.layouts import Layout, Refusal

__all__ = ["Outcome", "print_report", "write_outputs"]

MIB = 2**20
REFERENCE = "auto"  # one device: the strategy of the layout every other one is compared with


@dataclass(frozen=True)
class Outcome:
    """A layout's estimated peak per device, and once it ran, its figures or why it failed."""

    layout: Layout
    estimate: list[int]
    figures: dict | None = None
    failure: str | None = None

    @property
    def images_per_s(self) -> float:
        return self.figures["images_per_s"] if self.figures else 0.0


def _ranked(outcomes: Sequence[Outcome]) -> list[Outcome]:
    return sorted((outcome for outcome in outcomes if outcome.figures), key=lambda outcome: -outcome.images_per_s)


def _efficiency(outcome: Outcome, outcomes: Sequence[Outcome]) -> float | None:
    """img/s over (devices x one device's img/s)."""
    reference = next(
        (o for o in outcomes if o.layout.strategy == REFERENCE and o.figures and not o.layout.recompute), None
    )
    if reference is None:
        return None
    return outcome.images_per_s / (outcome.layout.devices * reference.images_per_s)


def _mib(values: Sequence[int]) -> str:
    return "/".join(f"{value / MIB:,.0f}" for value in values)


def print_report(
    outcomes: Sequence[Outcome],
    refusals: Sequence[Refusal],
    device_ids: Sequence[int] | None,
    budget: tuple[int, bool],
    measured: bool,
) -> None:
    """The layouts left out and why, then the ranked table (or, for a dry run, the layouts and their estimates)."""
    if refusals:
        print("\nleft out:")
        for refusal in refusals:
            print(f"  {refusal}")
    failed = [outcome for outcome in outcomes if outcome.failure]
    for outcome in failed:
        print(f"  {outcome.layout.label}: failed: {outcome.failure}")
    limit, per_device = budget
    room = f"{limit / MIB:,.0f} MiB {'per device' if per_device else 'for all processes'}"
    if not measured:
        print(f"\n{len(outcomes)} layouts would run (memory estimates, {room} available):")
        for outcome in outcomes:
            print(
                f"  {outcome.layout.label:<40} estimate MiB {_mib(outcome.estimate):>20}   "
                f"{' '.join(outcome.layout.fit_options(device_ids))}"
            )
        return
    ranked = _ranked(outcomes)
    if not ranked:
        return
    header = (
        f"{'#':>3}  {'layout':<40} {'img/s':>8} {'step ms':>9} {'peak MiB':>20} {'estimate MiB':>20} {'efficiency':>10}"
    )
    print("\n" + header)
    for place, outcome in enumerate(ranked, 1):
        efficiency = _efficiency(outcome, outcomes)
        print(
            f"{place:>3}  {outcome.layout.label:<40} {outcome.images_per_s:>8.1f} "
            f"{outcome.figures['step_time_s'] * 1000:>9.1f} {_mib(outcome.figures['peak_memory_bytes']):>20} "
            f"{_mib(outcome.estimate):>20} {'-' if efficiency is None else f'{efficiency:.2f}':>10}"
        )
    print("\nfit options:")
    for place, outcome in enumerate(ranked, 1):
        print(f"{place:>3}  {' '.join(outcome.layout.fit_options(device_ids))}")


def write_outputs(
    outcomes: Sequence[Outcome], folder: Path, device_ids: Sequence[int] | None, trainer: dict[str, Any], title: str
) -> Path | None:
    """Write the fastest layout as ``plan.yaml``, every figure as ``plan.json`` and the chart ``plan.png`` into
    ``folder``; return the config's path (None when no layout ran)."""
    ranked = _ranked(outcomes)
    if not ranked:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    best = ranked[0]
    config = best.layout.config(device_ids)
    config["trainer"]["accelerator"] = trainer.get("accelerator") or "auto"
    if trainer.get("precision") is not None:
        config["trainer"]["precision"] = trainer["precision"]
    header = (
        f"# The fastest layout `python main.py plan` measured: {best.layout.label}, "
        f"{best.images_per_s:.1f} img/s ({title}).\n# Train with it: python main.py fit <the same options> "
        f"--config {folder / 'plan.yaml'}\n"
    )
    (folder / "plan.yaml").write_text(header + yaml.safe_dump(config, sort_keys=False))
    rows = [
        {
            **asdict(outcome),
            "layout": outcome.layout.label,
            "efficiency": _efficiency(outcome, outcomes),
            "fit_options": outcome.layout.fit_options(device_ids),
        }
        for outcome in outcomes
    ]
    (folder / "plan.json").write_text(json.dumps({"title": title, "results": rows}, indent=2, default=list))
    notes = [f"eff. {e:.2f}" if (e := _efficiency(outcome, outcomes)) is not None else "" for outcome in ranked]
    write_bar_chart(
        [outcome.layout.label for outcome in ranked],
        [outcome.images_per_s for outcome in ranked],
        notes,
        f"python main.py plan: {title}",
        folder / "plan.png",
        grey=[outcome.layout.strategy == REFERENCE for outcome in ranked],
    )
    print(
        f"\nwrote {folder / 'plan.yaml'} (the fastest: {best.layout.label}), plan.json and plan.png beside it."
        f"\ntrain with it: python main.py fit <the same options> --config {folder / 'plan.yaml'}"
    )
    return folder / "plan.yaml"
