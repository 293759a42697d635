"""Which layouts ``plan`` measures, how sure each measured figure is, and which layout it picks.

It measures the reference (one device), the ``top`` layouts by forecast, and every other
layout whose forecast lies within ``FORECAST_ERROR`` of the best forecast: the largest
error the accuracy benchmark (``benchmarks/plan_accuracy.py``) allows. A measured layout's
figure is the median of its windows' images per second, and its range runs from the slowest
window to the fastest: with 5 windows the median lies inside it 15 times in 16, whatever the
noise (each window is as likely to fall above the median as below it). Layouts whose median
lies within the fastest one's range are tied with it, and among them the plan picks the simplest:
the fewest processes, then the least memory. A range made wide by a busy machine makes no tie:
its median, not its fastest window, is set against the fastest layout's range. Where every layout
measured trained on busy cores, their figures measure the other work too: the plan then picks the
best forecast among them, and says so.
"""

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from multigpu.strategies.layout import Layout

__all__ = [
    "FORECAST_ERROR",
    "Outcome",
    "choice",
    "chosen_by_forecast",
    "ends_by",
    "in_measuring_order",
    "ranked",
    "tied",
    "to_measure",
]

FORECAST_ERROR = 0.2


def ends_by(deadline: float | None, run_s: float) -> bool:
    """Whether a run forecast to take ``run_s`` seconds, and ``FORECAST_ERROR`` more, would end by ``deadline`` (a
    ``time.monotonic`` reading; always, with none): what the time budget lets ``plan`` profile or measure."""
    return deadline is None or time.monotonic() + run_s * (1 + FORECAST_ERROR) <= deadline


@dataclass(frozen=True)
class Outcome:
    """A layout's estimated peak per device and forecast images per second, and once it ran, its figures or why
    it failed, and why its cores were busy while it trained (``busy``; None when they were quiet or not
    checked): its figures then measure that too."""

    layout: Layout
    estimate: list[int]
    forecast: float | None = None
    figures: dict | None = None
    failure: str | None = None
    busy: str | None = None

    @property
    def windows(self) -> list[float]:
        """Images per second of each timed window (one figure for a run timed as a whole)."""
        if not self.figures:
            return []
        return self.figures.get("window_images_per_s") or [self.figures["images_per_s"]]

    @property
    def images_per_s(self) -> float:
        """The median of the windows' figures (0 before it ran)."""
        return statistics.median(self.windows) if self.figures else 0.0

    @property
    def interval(self) -> tuple[float, float]:
        """The slowest and the fastest window."""
        return (min(self.windows), max(self.windows)) if self.figures else (0.0, 0.0)

    @property
    def error(self) -> float | None:
        """The forecast's error relative to the measured median."""
        if not (self.figures and self.forecast):
            return None
        return self.forecast / self.images_per_s - 1


def to_measure(outcomes: Sequence[Outcome], top: int) -> list[Outcome]:
    """The outcomes to measure, in their order (see the module's docstring)."""
    forecasts = [(o, forecast) for o in outcomes if (forecast := o.forecast)]
    by_forecast = sorted(forecasts, key=lambda pair: -pair[1])
    best = by_forecast[0][1] if by_forecast else 0.0
    kept = {id(o) for o, _ in by_forecast[:top]}
    kept |= {id(o) for o, forecast in by_forecast if forecast >= best * (1 - FORECAST_ERROR)}
    return [o for o in outcomes if id(o) in kept or o.layout.reference]


def in_measuring_order(outcomes: Sequence[Outcome]) -> list[Outcome]:
    """The reference first, then by forecast, the best first: the order in which a time budget measures them."""
    return sorted(outcomes, key=lambda o: (not o.layout.reference, -(o.forecast or 0.0)))


def ranked(outcomes: Sequence[Outcome]) -> list[Outcome]:
    """The measured outcomes, fastest (by median) first."""
    return sorted((o for o in outcomes if o.figures), key=lambda o: -o.images_per_s)


def chosen_by_forecast(outcomes: Sequence[Outcome]) -> bool:
    """Whether every measured outcome trained on busy cores (none is then compared by its figures)."""
    measured = [o for o in outcomes if o.figures]
    return bool(measured) and all(o.busy for o in measured)


def tied(outcomes: Sequence[Outcome]) -> list[Outcome]:
    """The measured outcomes whose median lies within the fastest one's range, the fastest first (none where the
    choice goes by forecast)."""
    fastest = ranked(outcomes)
    if not fastest or chosen_by_forecast(outcomes):
        return []
    low = fastest[0].interval[0]
    return [o for o in fastest if o.images_per_s >= low]


def choice(outcomes: Sequence[Outcome]) -> Outcome | None:
    """The simplest of the layouts tied with the fastest: the fewest processes, then the least memory; where every
    measured layout trained on busy cores, the one of them with the best forecast."""
    if chosen_by_forecast(outcomes):
        return max((o for o in outcomes if o.figures), key=lambda o: o.forecast or 0.0)
    group = tied(outcomes)
    if not group:
        return None
    return min(group, key=lambda o: (o.layout.processes, sum((o.figures or {})["peak_memory_bytes"]), -o.images_per_s))
