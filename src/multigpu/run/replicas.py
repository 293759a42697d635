"""How many processes train on different samples: what the global batch and throughput count."""

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from lightning.pytorch import LightningModule, Trainer

from multigpu.contracts import parallelism_of
from multigpu.errors import UsageError
from multigpu.typed_options import ModuleOptions

__all__ = [
    "accumulation_for",
    "data_parallel_rank",
    "data_parallel_size",
    "global_batch_size",
    "LayoutRecord",
    "micro_batches_per_batch",
    "replica_group",
]


def data_parallel_size(trainer: Trainer) -> int:
    """The number of data-parallel replicas (``Parallelism.data_parallel_size``): the world size, but for a
    pipeline, whose processes share their samples."""
    return parallelism_of(trainer).data_parallel_size


def data_parallel_rank(trainer: Trainer) -> int:
    """This process's replica, 0 .. ``data_parallel_size - 1``: the shard of the data it reads.

    Consecutive ranks form a replica (the stages of one pipeline, say).
    """
    return trainer.global_rank // (trainer.world_size // data_parallel_size(trainer))


def replica_group(trainer: Trainer):
    """The process group of the replicas that hold the same layers as this process: a pipeline's processes of
    the same stages, else all processes (``None``, the default group)."""
    return parallelism_of(trainer).replica_group


def micro_batches_per_batch(trainer: Trainer) -> int:
    """The micro-batches each loader batch is cut into for its forward passes: a pipeline's, else 1."""
    return parallelism_of(trainer).micro_batches


def global_batch_size(batch_size: int, replicas: int, accumulation: int) -> int:
    """Images per optimizer step over all replicas, each of which accumulates ``accumulation`` loader batches of
    ``batch_size``: the batch the learning rate scales with and an epoch's order steps by (``accumulation_for`` is
    its inverse)."""
    return batch_size * replicas * accumulation


def accumulation_for(global_batch_size: int, batch_size: int, replicas: int) -> int:
    """The loader batches each of ``replicas`` accumulates per step for a global batch of ``global_batch_size``,
    or a ``UsageError`` that says what to pass when it does not split into whole batches of ``batch_size``."""
    per_step = batch_size * replicas
    if global_batch_size % replicas:
        raise UsageError(
            f"--data.global_batch_size={global_batch_size} does not split over this layout's {replicas} replicas: "
            f"pass a multiple of {per_step}, or use a device count that divides {global_batch_size}."
        )
    if global_batch_size % per_step:
        each = global_batch_size // replicas
        raise UsageError(
            f"--data.global_batch_size={global_batch_size} leaves each of {replicas} replica(s) {each} images a step, "
            f"not whole batches of --data.batch_size={batch_size}: pass a --data.batch_size that divides {each}, "
            f"or a global batch that is a multiple of {per_step}."
        )
    return global_batch_size // per_step


@dataclass(frozen=True)
class LayoutRecord:
    """How a run trains, as its checkpoints record it (under ``checkpointing.position.KEY``): its strategy, processes,
    replicas, accumulated batches, global batch and images per forward pass."""

    strategy: str
    world_size: int
    replicas: int
    accumulated_batches: int
    global_batch_size: int | None
    forward_batch: int | None

    @classmethod
    def of(cls, trainer: Trainer, pl_module: LightningModule) -> "LayoutRecord":
        """How ``trainer`` trains ``pl_module``."""
        batch_size = ModuleOptions.of(pl_module).batch_size
        return cls(
            strategy=type(trainer.strategy).__name__,
            world_size=trainer.world_size,
            replicas=data_parallel_size(trainer),
            accumulated_batches=trainer.accumulate_grad_batches,
            global_batch_size=getattr(pl_module, "global_batch_size", None),
            forward_batch=batch_size // micro_batches_per_batch(trainer) if batch_size else None,
        )

    def before(self, saved: Mapping[str, Any]) -> "LayoutRecord":
        """The record a checkpoint ``saved``, read against this one: what an older checkpoint did not record is taken
        to be as now."""
        return replace(self, **{entry.name: saved[entry.name] for entry in fields(self) if entry.name in saved})
