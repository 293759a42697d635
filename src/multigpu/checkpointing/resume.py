"""One owner for resume: what a checkpoint says of its run (``ResumePoint``), read once from the checkpoint, and the
callback that writes it into each checkpoint and, on resume, gives it to the data module and to Lightning's loop
counters (``RunMetadata``).

A checkpoint holds, under ``"multigpu"`` (``KEY``), the layout it was trained on, the data its run read (class names;
the mean and std it normalised with) and where training stood in the epoch's order of global batches (``order``,
``TrainingPosition``), the same on any layout; Lightning's own entries hold the model's and the data's options. A run
resumed on another layout goes on with the same images: the data module follows the order from where the position
says, and Lightning's loop counters count the steps before it in the new layout's batches.
"""

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from multigpu.checkpointing.loop_position import count_steps_as_done, reopen_cut_epoch
from multigpu.checkpointing.position import KEY, FollowsOrder, TrainingPosition
from multigpu.renamed_options import new_hyperparameter_names
from multigpu.run.replicas import LayoutRecord
from multigpu.run.trainer_parts import datamodule_of

__all__ = ["ResumePoint", "RunMetadata"]


@dataclass(frozen=True)
class ResumePoint:
    """What a checkpoint says of its run: where training stands, and the options it was trained with.

    Attributes:
        training: where training stood in the epoch's order (``None`` for a checkpoint written without a data module
            of ours).
        model_options, data_options: the model's and the data's options (``--model.*``, ``--data.*``).
        data: what its run read of the data: ``classes``, and the ``mean`` and ``std`` it normalised with.
        layout: how it was trained (a ``LayoutRecord``'s entries).
        log_version: its TensorBoard run.
        checkpoint: the checkpoint as read, which Lightning's read of the same file gets (``AtomicCheckpointIO``).
    """

    training: TrainingPosition | None = None
    model_options: Mapping[str, Any] = field(default_factory=dict)
    data_options: Mapping[str, Any] = field(default_factory=dict)
    data: Mapping[str, Any] = field(default_factory=dict)
    layout: Mapping[str, Any] = field(default_factory=dict)
    log_version: int | str | None = None
    checkpoint: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, checkpoint: Mapping[str, Any]) -> "ResumePoint":
        """The point of ``checkpoint``, of this version or an earlier one."""
        saved = checkpoint.get(KEY, {})
        return cls(
            training=TrainingPosition.of(checkpoint),
            model_options=new_hyperparameter_names(checkpoint.get("hyper_parameters") or {}),
            data_options=checkpoint.get("datamodule_hyper_parameters") or {},
            data=saved.get("data", {}),
            layout={name: value for name, value in saved.items() if name not in ("order", "data", "log_version")},
            log_version=saved.get("log_version"),
            checkpoint=checkpoint,
        )


def _data_description(datamodule: Any) -> dict[str, Any]:
    """What ``export`` and ``predict`` need to know of the data the run trained on: its class names, and the mean
    and std its images were normalised with (an image folder's were measured)."""
    description = {}
    if classes := getattr(datamodule, "classes", None):
        description["classes"] = list(classes)
    if stats := getattr(datamodule, "known_stats", None):  # a data module of ours, its mean and std known
        description["mean"], description["std"] = (list(values) for values in stats)
    return description


class RunMetadata(Callback):
    """Stores in each checkpoint how it was made and where training stands (``TrainingPosition``), under the key
    ``"multigpu"``; on resume, gives the position to the data module and to the loop counters that Lightning restores
    next, and says in one line what the layout kept and changed: the one callback that saves and loads the position.

    The CLI reads ``log_version`` back on ``--ckpt_path`` so that a resumed run
    continues the same TensorBoard run.
    """

    def __init__(self) -> None:
        # Whether torchrun or SLURM started the processes, as the environment said before the launch (``note_launch``).
        self.started_outside: bool | None = None

    def note_launch(self, trainer: Trainer) -> None:
        """Record who starts the processes, before ``trainer`` launches any: after, Lightning's launcher has set the
        variables that would make its own processes look started from outside."""
        environment = getattr(trainer.strategy, "cluster_environment", None)
        self.started_outside = environment.creates_processes_externally if environment is not None else None

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Who started the processes: Lightning, or torchrun or SLURM (creates_processes_externally), as the
        # environment said before Lightning's launcher put LOCAL_RANK into the first process's variables too.
        environment = getattr(trainer.strategy, "cluster_environment", None)
        if environment is not None and trainer.world_size > 1:
            outside = self.started_outside
            if outside is None:
                outside = environment.creates_processes_externally
            started = "started outside Lightning" if outside else "started by Lightning"
            rank_zero_info(
                f"{type(environment).__name__}: {trainer.world_size} process(es) on {trainer.num_nodes} node(s), "
                f"{started}."
            )

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        position = TrainingPosition.now(trainer)  # before the loop counters below are reopened
        checkpoint[KEY] = {
            "log_version": trainer.logger.version if trainer.logger else None,
            **asdict(LayoutRecord.of(trainer, pl_module)),
            "data": _data_description(datamodule_of(trainer)),
            **({"order": position.record()} if position is not None else {}),
        }
        if "loops" in checkpoint:  # an epoch a limit cut short resumes inside it
            reopen_cut_epoch(checkpoint["loops"]["fit_loop"])

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        if trainer.state.fn != TrainerFn.FITTING:  # the layout and the order only matter to training
            return
        point, data = ResumePoint.of(checkpoint), datamodule_of(trainer)
        position, accumulation, where = point.training, trainer.accumulate_grad_batches, ""
        resumed = None
        if position is not None and isinstance(data, FollowsOrder):
            resumed = position.give_to(data, accumulation)
        if resumed is not None:  # inside an epoch
            where = f"; epoch {position.epoch} goes on after its first {resumed.start} of {resumed.samples} images"
            if "loops" in checkpoint:
                count_steps_as_done(checkpoint["loops"]["fit_loop"], resumed.skipped_steps, accumulation)
        now = LayoutRecord.of(trainer, pl_module)
        _report_layout(now.before(point.layout), now, where)


def _report_layout(saved: LayoutRecord, now: LayoutRecord, where: str) -> None:
    """Say in one line what a layout resumed from ``saved`` kept and changed, and ``where`` it goes on."""
    changes = [
        f"{name} {before} -> {after}"
        for name, before, after in (
            ("strategy", saved.strategy, now.strategy),
            ("world size", saved.world_size, now.world_size),
            ("replicas", saved.replicas, now.replicas),
            ("accumulated batches", saved.accumulated_batches, now.accumulated_batches),
        )
        if before != after
    ]
    kept: list[str] = []
    changed: list[str] = []
    for what, before, after in (
        ("the global batch", saved.global_batch_size, now.global_batch_size),
        ("images per forward pass", saved.forward_batch, now.forward_batch),
    ):
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
    if saved.global_batch_size != now.global_batch_size:
        parts.append("the learning rate keeps the checkpoint's scaling")
    elif not changed:
        parts.append("so the same steps train the same images")
    rank_zero_info(f"{opening}: {', '.join(parts)}{where}.")
