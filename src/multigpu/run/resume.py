"""One owner for resume: where a checkpoint stands (``ResumePoint``), made in one place from the checkpoint, and given
from here to the data module's sampler and to Lightning's loop counters.

A checkpoint holds, under ``"multigpu"`` (``KEY``, written by ``RunMetadata``), the layout it was trained on, the data
its run read (class names; the mean and std it normalised with) and where training stood in the epoch's order of
global batches (``order``: the epoch, the images of its order trained, the shuffle's seed, the global batch), the
same on any layout; Lightning's own entries hold the model's and the data's options. A run resumed on another layout
goes on with the same images: the data module's sampler starts where ``order`` says, and Lightning's loop counters
count the steps before it in the new layout's batches (``resume``).
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

from multigpu.renamed_options import RENAMED_CLASSES, new_hyperparameter_names
from multigpu.run.loop_position import count_steps_as_done, next_position
from multigpu.run.replicas import data_parallel_size, micro_batches_per_batch
from multigpu.typed_options import ModuleOptions

__all__ = ["KEY", "ResumableData", "ResumePoint", "layout_record", "resume", "training_order"]

KEY = "multigpu"
# Where a data module kept the order before ``KEY`` did: Lightning's key of its state, its class's name, old or new
_DATA_MODULE_KEYS = ("ImageDataModule", *(old for old, new in RENAMED_CLASSES.items() if new == "ImageDataModule"))


@dataclass(frozen=True)
class ResumePoint:
    """Where a checkpoint stands, and the options its run was trained with.

    Attributes:
        ordered: whether the checkpoint says where training stood in the epoch's order (one written without a data
            module of ours does not).
        epoch: the epoch training goes on with.
        position: the images of that epoch's order already trained, on any layout; ``None`` for a checkpoint of an
            early version, which kept ``batches`` instead: the loader batches each replica trained, on this layout.
        shuffle_seed: the seed of the run's order and augmentation; ``None`` for a version that kept none (0).
        global_batch: the images per optimizer step it trained with.
        model_options, data_options: the model's and the data's options (``--model.*``, ``--data.*``).
        data: what its run read of the data: ``classes``, and the ``mean`` and ``std`` it normalised with.
        layout: how it was trained (``layout_record``).
        log_version: its TensorBoard run.
    """

    ordered: bool = False
    epoch: int = 0
    position: int | None = 0
    batches: int = 0
    shuffle_seed: int | None = None
    global_batch: int | None = None
    model_options: Mapping[str, Any] = field(default_factory=dict)
    data_options: Mapping[str, Any] = field(default_factory=dict)
    data: Mapping[str, Any] = field(default_factory=dict)
    layout: Mapping[str, Any] = field(default_factory=dict)
    log_version: int | str | None = None

    @classmethod
    def of(cls, checkpoint: Mapping[str, Any]) -> "ResumePoint":
        """The point of ``checkpoint``, of this version or an earlier one (whose data module kept the order under its
        own class name, an old one among them)."""
        saved = checkpoint.get(KEY, {})
        order = saved.get("order")
        if order is None:
            order = next((checkpoint[name] for name in _DATA_MODULE_KEYS if name in checkpoint), None)
        layout = {name: value for name, value in saved.items() if name not in ("order", "data", "log_version")}
        ordered, order = order is not None, order or {}
        return cls(
            ordered=ordered,
            epoch=order.get("epoch", 0),
            position=order.get("position"),
            batches=order.get("batches", 0),
            shuffle_seed=order.get("shuffle_seed"),
            global_batch=order.get("global_batch"),
            model_options=new_hyperparameter_names(checkpoint.get("hyper_parameters") or {}),
            data_options=checkpoint.get("datamodule_hyper_parameters") or {},
            data=saved.get("data", {}),
            layout=layout,
            log_version=saved.get("log_version"),
        )

    def images_trained(self, batch_size: int, replicas: int) -> int:
        """The images of the epoch's order trained, read with this layout's batches where the checkpoint counted
        batches."""
        return self.position if self.position is not None else self.batches * batch_size * replicas


@runtime_checkable
class ResumableData(Protocol):
    """What a data module that resumes inside an epoch gives and takes (``ImageDataModule``)."""

    def order_state(self, epoch: int, batches: int) -> dict[str, int]:
        """Where training stands in ``epoch`` after ``batches`` loader batches of each replica: the epoch, the images
        of its order trained, the global batch and the shuffle's seed."""

    def resume_at(self, point: ResumePoint) -> tuple[int, Any] | None:
        """Start the training order where ``point`` stands; the epoch it stopped inside and how this layout trains
        the rest of it (an ``EpochOrder``), or ``None`` where it stopped between epochs."""


def training_order(trainer: Trainer) -> dict[str, int] | None:
    """Where training stands in the epoch's order, for a checkpoint written now."""
    datamodule = trainer.datamodule
    if not isinstance(datamodule, ResumableData):
        return None
    return datamodule.order_state(*next_position(trainer.fit_loop.state_dict()))


def layout_record(trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
    """How ``trainer`` trains: its strategy, processes, replicas, accumulated batches, global batch and images per
    forward pass."""
    batch_size = ModuleOptions.of(pl_module).batch_size
    return {
        "strategy": type(trainer.strategy).__name__,
        "world_size": trainer.world_size,
        "replicas": data_parallel_size(trainer),
        "accumulated_batches": trainer.accumulate_grad_batches,
        "global_batch_size": pl_module.global_batch_size if hasattr(pl_module, "global_batch_size") else None,
        "forward_batch": batch_size // micro_batches_per_batch(trainer) if batch_size else None,
    }


def resume(trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
    """Give the point of ``checkpoint`` to the data module's sampler and to the loop counters that Lightning restores
    next, and say in one line what the layout kept and changed."""
    point = ResumePoint.of(checkpoint)
    datamodule = trainer.datamodule
    resumed = datamodule.resume_at(point) if point.ordered and isinstance(datamodule, ResumableData) else None
    if resumed is not None and "loops" in checkpoint:
        count_steps_as_done(checkpoint["loops"]["fit_loop"], resumed[1].skipped_steps, trainer.accumulate_grad_batches)
    _report_layout(point.layout, layout_record(trainer, pl_module), resumed)


def _report_layout(saved: Mapping[str, Any], now: dict[str, Any], resumed: tuple[int, Any] | None) -> None:
    changes = [
        f"{name.replace('_', ' ')} {saved[name]} -> {now[name]}"
        for name in ("strategy", "world_size", "replicas", "accumulated_batches")
        if name in saved and saved[name] != now[name]
    ]
    kept, changed = [], []
    for name, what in (("global_batch_size", "the global batch"), ("forward_batch", "images per forward pass")):
        before, after = saved.get(name, now[name]), now[name]
        (kept if before == after else changed).append(
            f"{what} {after}" if before == after else f"{what} {before} -> {after}"
        )
    if not changes and not changed:
        return
    opening = (
        f"Resuming with another layout ({', '.join(changes)})"
        if changes
        else "Resuming on the same strategy and devices with another batch"
    )
    parts = [f"kept {' and '.join(kept)}"] if kept else []
    if changed:
        parts.append(f"changed {' and '.join(changed)}")
    if saved.get("global_batch_size", now["global_batch_size"]) != now["global_batch_size"]:
        parts.append("the learning rate keeps the checkpoint's scaling")
    elif not changed:
        parts.append("so the same steps train the same images")
    where = ""
    if resumed is not None:
        epoch, epoch_order = resumed
        where = f"; epoch {epoch} goes on after its first {epoch_order.start} of {epoch_order.samples} images"
    rank_zero_info(f"{opening}: {', '.join(parts)}{where}.")
