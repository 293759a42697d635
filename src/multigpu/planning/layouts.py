"""Every way to train on a given number of devices, and why each of the others cannot run: ``plan`` asks each
registered strategy (``multigpu.strategies.SPECS``) for its layouts, the reference first."""

from collections.abc import Sequence

from multigpu.errors import UsageError
from multigpu.strategies import LAYOUTS, PLANNED_STRATEGIES
from multigpu.strategies.layout import Layout, LayoutRequest, Refusal
from multigpu.strategies.pipeline.stage_placement import SCHEDULES

__all__ = ["candidate_layouts"]


def candidate_layouts(
    devices: int,
    cuda: bool,
    batch_size: int,
    compiled: bool,
    strategies: Sequence[str] = PLANNED_STRATEGIES,
    schedules: Sequence[str] = SCHEDULES,
    micro_batches: Sequence[int] | None = None,
) -> tuple[list[Layout], list[Refusal]]:
    """The layouts without activation recomputation that can train on ``devices`` devices (the reference first),
    and a ``Refusal`` for each one that cannot.

    Every layout but the reference trains the same global batch, ``batch_size`` per device as ``ddp`` does:
    ``dp`` takes ``batch_size x devices`` in its one process, a model-parallel replica or a pipeline of ``k``
    devices ``batch_size x k``. Only speed and memory differ between them, not the optimisation.

    Args:
        micro_batches: the counts a pipeline of ``P`` processes tries; default ``P``, ``2P`` and ``4P``.
    """
    request = LayoutRequest(devices, cuda, batch_size, compiled, schedules, micro_batches)
    refusals: list[Refusal] = []

    def refuse(what: str, why: str) -> None:
        refusals.append(Refusal(what, why))

    if unknown := [name for name in strategies if name not in PLANNED_STRATEGIES]:
        raise UsageError(f"plan.strategies: {unknown[0]!r} is not one of {', '.join(PLANNED_STRATEGIES)}.")
    asked = [layout for layout in LAYOUTS.values() if layout.reference] + [LAYOUTS[name] for name in strategies]
    layouts = [offer for layout in asked for offer in layout.offered(request, refuse)]
    return layouts, refusals
