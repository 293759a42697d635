"""BatchNorm's running statistics when replicas train: those one device would keep (``multigpu.model.step_batch_norm``).

The LightningModule asks ``records_step_statistics(trainer)`` whether to record them when it builds its network,
and gets ``ReplicaStatistics`` from its ``configure_callbacks``, so that any Trainer it runs in commits them: one
all-reduce a step, over the replicas that hold the same layers. The module itself talks to no other process.
"""

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from multigpu.compat import layer_sync
from multigpu.contracts import holds_network
from multigpu.model.step_batch_norm import commit_step_statistics
from multigpu.run.replicas import data_parallel_rank, data_parallel_size, micro_batches_per_batch, replica_group

__all__ = ["ReplicaStatistics", "records_step_statistics", "micro_batches_per_step"]


def records_step_statistics(trainer: Trainer) -> bool:
    """Whether this training runs replicas, each of which sees its own micro-batches of each step, and no
    ``SyncBatchNorm`` normalises over all of them: BatchNorm's running statistics are then recorded per
    micro-batch and committed each step, as one device's would be."""
    fitting = trainer.state.fn == TrainerFn.FITTING
    strategy = trainer.strategy  # replicas: a ParallelStrategy
    return (
        fitting
        and data_parallel_size(trainer) > 1
        and isinstance(strategy, ParallelStrategy)
        and layer_sync(strategy) is None
    )


def micro_batches_per_step(trainer: Trainer) -> int:
    """The forward passes of one replica in a step: the records each BatchNorm layer keeps room for."""
    return trainer.accumulate_grad_batches * micro_batches_per_batch(trainer)


class ReplicaStatistics(Callback):
    """Commits the step's BatchNorm statistics of every replica before the optimizer step (one all-reduce). It
    counts the step's training batches itself: the layers' own counts are on the device, and reading them would
    make the host wait for it."""

    def __init__(self) -> None:
        self._batches = 0  # training batches since the last commit

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._batches += 1

    @override
    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        batches, self._batches = self._batches, 0
        replicas = data_parallel_size(trainer)
        if replicas > 1:
            assert holds_network(pl_module), "a strategy of ours or Lightning's DDP, which train pl_module.net"
            rank, micro_batches = data_parallel_rank(trainer), micro_batches_per_batch(trainer)
            commit_step_statistics(
                pl_module.net, batches * micro_batches, replicas, rank, micro_batches, replica_group(trainer)
            )
