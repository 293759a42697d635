"""The layouts the tests' training scripts run under, in one table: ``tests/layout_training.py`` (resume on any
layout) and ``tests/network_training.py`` (every torchvision family under every strategy) each name the ones they
train. A layout here is what it is everywhere in the project: a strategy with its options on a number of devices,
the images of each loader batch and the batches accumulated per step."""

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from lightning.pytorch.strategies import Strategy

from multigpu.strategies import FullyShardedStrategy, ManualModelParallelStrategy, PipelineStrategy

__all__ = ["LAYOUTS", "RunLayout"]


@dataclass(frozen=True)
class RunLayout:
    """``strategy`` (Lightning's name, or what builds ours: one instance per run) on ``devices`` CPU devices,
    ``batch_size`` images per loader batch, ``accumulate`` batches per optimizer step, ``replicas`` processes that
    read different samples."""

    strategy: str | Callable[[], Strategy]
    devices: int
    batch_size: int
    accumulate: int = 1
    replicas: int = 1

    def trainer_strategy(self) -> str | Strategy:
        """What the Trainer's ``strategy`` is given."""
        return self.strategy() if callable(self.strategy) else self.strategy


_PIPE = partial(PipelineStrategy, micro_batches=2, balance_by="params")

LAYOUTS = {
    # layout_training.py: a global batch of 16 (one device accumulating 4, 2 or 4 replicas, a replicated pipeline)
    "one_device_x4": RunLayout("auto", 1, 4, 4),
    "ddp_2_x2": RunLayout("ddp", 2, 4, 2, replicas=2),
    "ddp_4": RunLayout("ddp", 4, 4, replicas=4),
    "fsdp_4": RunLayout(FullyShardedStrategy, 4, 4, replicas=4),
    # ... and of 8
    "one_device_x2": RunLayout("auto", 1, 4, 2),
    "ddp_2": RunLayout("ddp", 2, 4, replicas=2),
    "fsdp_2": RunLayout(FullyShardedStrategy, 2, 4, replicas=2),
    "pipeline_2_replicas": RunLayout(
        partial(PipelineStrategy, num_stages=2, micro_batches=2, balance=[2, 1]), 4, 4, replicas=2
    ),
    # network_training.py: a global batch of 16 in forward groups of 8 images
    "one_device": RunLayout("auto", 1, 8, 2),
    "mmp": RunLayout(partial(ManualModelParallelStrategy, balance_by="params"), 2, 8, 2),
    "pipe_1f1b": RunLayout(partial(_PIPE, schedule="1f1b"), 2, 16),
    "pipe_interleaved": RunLayout(partial(_PIPE, schedule="Interleaved1F1B", stages_per_process=2), 2, 16),
    "ddp": RunLayout("ddp", 2, 8, replicas=2),
    "fsdp": RunLayout(partial(FullyShardedStrategy, accumulate_whole_gradients=True), 2, 8, replicas=2),
}
