"""Where a run stands in Lightning's loop counters: the epoch and batch a resumed run goes on from, the counters
rewritten for a run resumed with other batches per step, and whether a run has anything left to train.

Lightning's fit loop counts an epoch in loader batches (``epoch_loop.batch_progress``) and the
epochs in ``epoch_progress``; a checkpoint holds both under ``loops.fit_loop``.
"""

from collections.abc import Mapping
from typing import Any

__all__ = ["count_steps_as_done", "finished_training", "next_position", "reopen_cut_epoch", "trained_to"]


def _cut_short(fit_loop: Mapping[str, Any]) -> bool:
    """Whether this state of Lightning's fit loop ended its epoch before the epoch's last batch, stopped by
    ``max_steps``, ``max_time`` or ``trainer.should_stop``: Lightning counts such an epoch as processed, as it
    counts one that ran to its end."""
    epochs = fit_loop["epoch_progress"]["current"]
    batches = fit_loop["epoch_loop.batch_progress"]
    return (
        epochs["processed"] == epochs["started"] > 0
        and batches["current"]["processed"] > 0
        and not batches["is_last_batch"]
    )


def next_position(fit_loop: Mapping[str, Any]) -> tuple[int, int]:
    """Where a run resumed from this state of Lightning's fit loop (its ``state_dict()``, as a checkpoint
    holds it under ``loops``) goes on: the epoch it trains next, and how many of that epoch's batches
    are already trained.

    A checkpoint written after an epoch's last batch (at the epoch's end, or by SIGTERM, which
    Lightning acts on once the epoch is counted) goes on with the next epoch from its start; one written
    after a limit stopped the epoch before its last batch goes on inside that epoch.
    """
    epochs = fit_loop["epoch_progress"]["current"]
    batches = fit_loop["epoch_loop.batch_progress"]
    if _cut_short(fit_loop):
        return epochs["processed"] - 1, batches["current"]["processed"]
    if epochs["started"] <= epochs["processed"]:  # between epochs
        return epochs["processed"], 0
    if batches["is_last_batch"] and batches["current"]["processed"] == batches["current"]["ready"]:
        return epochs["processed"] + 1, 0
    return epochs["processed"], batches["current"]["processed"]


def reopen_cut_epoch(fit_loop: dict[str, Any]) -> None:
    """Make a fit loop's state (a checkpoint's ``loops.fit_loop``) whose epoch a limit stopped before its last
    batch count that epoch as unfinished, in place, as a checkpoint written inside it does: Lightning then
    resumes it at its next batch, trains the rest of it and validates it at its end, where it would otherwise go
    on with the next epoch and leave the rest of this one untrained."""
    if not _cut_short(fit_loop):
        return
    for part in ("current", "total"):
        epochs = fit_loop["epoch_progress"][part]
        epochs["processed"] = epochs["completed"] = epochs["started"] - 1


def count_steps_as_done(fit_loop: dict[str, Any], steps: int, accumulation: int) -> None:
    """Make a fit loop's state (a checkpoint's ``loops.fit_loop``) count ``steps`` steps of ``accumulation``
    loader batches as done in its epoch, in place.

    Lightning counts an epoch in loader batches and steps the optimizer after every ``accumulation``-th
    one; a run resumed with other batches per step goes on counting from the new layout's count,
    so that each of its steps accumulates whole and the epoch ends where the training order does.
    """
    progress = fit_loop["epoch_loop.batch_progress"]
    shift = steps * accumulation - progress["current"]["processed"]
    for part in ("current", "total"):
        for counter in ("ready", "started", "processed", "completed"):
            progress[part][counter] += shift


def finished_training(
    checkpoint: dict[str, Any], max_epochs: int | None, max_steps: int | None, max_time: Any = None
) -> str | None:
    """Why a run whose newest checkpoint is ``checkpoint`` has nothing left to train, naming the limit that stopped
    it and the option that lifts it, or ``None``.

    Lightning's limits: ``max_steps`` -1 (or none) is no step limit; ``max_epochs`` -1 is no
    epoch limit, and none is 1000 epochs when neither a step nor a time limit is set.
    """
    step = checkpoint["global_step"]
    if max_steps is not None and max_steps != -1 and step >= max_steps:
        return f"it has reached max_steps={max_steps} (step {step}); raise --trainer.max_steps to train further"
    if max_epochs is None:
        max_epochs = 1000 if max_steps in (None, -1) and max_time is None else -1
    fit_loop = checkpoint.get("loops", {}).get("fit_loop")
    epochs = next_position(fit_loop)[0] if fit_loop else checkpoint["epoch"]
    if max_epochs != -1 and epochs >= max_epochs:
        trained = f"it has trained max_epochs={max_epochs} epoch(s) (step {step})"
        return f"{trained}; raise --trainer.max_epochs to train further"
    return None


def trained_to(checkpoint: dict[str, Any]) -> str:
    """Where a checkpoint's training stands, counted as the training's own lines count it: ``epoch E, step S``, ``E``
    the (0-based) epoch its last step belongs to."""
    step = checkpoint.get("global_step", 0)
    fit_loop = checkpoint.get("loops", {}).get("fit_loop")
    if fit_loop:
        epoch, batches = next_position(fit_loop)
        epoch = epoch if batches else epoch - 1
    else:
        epoch = checkpoint.get("epoch", 0)
    return f"epoch {max(epoch, 0)}, step {step}"
