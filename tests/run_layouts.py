"""The layouts the tests' training scripts run under, in one table: ``tests/layout_training.py`` (resume on any
layout), ``tests/network_training.py`` (every torchvision family under every strategy) and
``tests/strategy_training.py`` (each strategy against one device, bit for bit) each name the ones they train. A
layout here is what it is everywhere in the project: a strategy with its options on a number of devices, the images
of each loader batch and the batches accumulated per step."""

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from lightning.pytorch.strategies import Strategy

from multigpu.strategies import (
    DataParallelStrategy,
    FullyShardedStrategy,
    ManualModelParallelStrategy,
    PipelineStrategy,
)

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


_MMP, _PIPELINE = ManualModelParallelStrategy, PipelineStrategy
_PIPE = partial(_PIPELINE, micro_batches=2, balance_by="params")
_FSDP_WHOLE = partial(FullyShardedStrategy, accumulate_whole_gradients=True)  # ddp's gradients, once a step

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
        partial(_PIPELINE, num_stages=2, micro_batches=2, balance=[2, 1]), 4, 4, replicas=2
    ),
    # network_training.py: a global batch of 16 in forward groups of 8 images
    "one_device": RunLayout("auto", 1, 8, 2),
    "mmp": RunLayout(partial(_MMP, balance_by="params"), 2, 8, 2),
    "pipe_1f1b": RunLayout(partial(_PIPE, schedule="1f1b"), 2, 16),
    "pipe_interleaved": RunLayout(partial(_PIPE, schedule="Interleaved1F1B", stages_per_process=2), 2, 16),
    "ddp": RunLayout("ddp", 2, 8, replicas=2),
    "fsdp": RunLayout(_FSDP_WHOLE, 2, 8, replicas=2),
    # strategy_training.py (b: the images of a loader batch), on four blocks of linear layers: a step of 16 samples ...
    "one_device_b16": RunLayout("auto", 1, 16),
    "mmp_2_2": RunLayout(partial(_MMP, balance=[2, 2]), 2, 16),
    "mmp_2_2_replicas": RunLayout(partial(_MMP, balance=[2, 2], devices_per_replica=2), 4, 8, replicas=2),
    "mmp_params": RunLayout(partial(_MMP, balance_by="params"), 2, 16),
    "pipe_gpipe_2_2": RunLayout(partial(_PIPELINE, micro_batches=4, schedule="gpipe", balance=[2, 2]), 2, 16),
    "pipe_1f1b_1_3": RunLayout(partial(_PIPELINE, micro_batches=4, schedule="1f1b", balance=[1, 3]), 2, 16),
    "pipe_params": RunLayout(partial(_PIPELINE, micro_batches=4, balance_by="params"), 2, 16),
    "pipe_2_2_replicas": RunLayout(partial(_PIPELINE, num_stages=2, micro_batches=2, balance=[2, 2]), 4, 8, replicas=2),
    "pipe_params_replicas": RunLayout(
        partial(_PIPELINE, num_stages=2, micro_batches=2, balance_by="params"), 4, 8, replicas=2
    ),
    "fsdp_2x2_shards": RunLayout(partial(FullyShardedStrategy, shard_size=2), 4, 4, replicas=4),
    # ... (and ddp_4, fsdp_4, ddp above); of 16 samples in two accumulated batches ...
    "one_device_b8_x2": RunLayout("auto", 1, 8, 2),
    "pipe_gpipe_2_2_x2": RunLayout(partial(_PIPELINE, micro_batches=2, schedule="gpipe", balance=[2, 2]), 2, 8, 2),
    "ddp_b8_x2": RunLayout("ddp", 2, 8, 2, replicas=2),
    "fsdp_b8_x2": RunLayout(FullyShardedStrategy, 2, 8, 2, replicas=2),
    # ... and on ResNet-50's blocks (helpers.tiny_resnet or ResNet-50 itself): a step of 8 images (and one_device_x2)
    "dp_b4_x2": RunLayout(DataParallelStrategy, 1, 4, 2),
    "mmp_2_6_x2": RunLayout(partial(_MMP, balance=[2, 6]), 2, 4, 2),
    "pipe_gpipe_2_6": RunLayout(partial(_PIPELINE, micro_batches=2, schedule="gpipe", balance=[2, 6]), 2, 8),
    "pipe_1f1b_2_6": RunLayout(partial(_PIPELINE, micro_batches=2, schedule="1f1b", balance=[2, 6]), 2, 8),
    "pipe_1f1b_12_22": RunLayout(partial(_PIPELINE, micro_batches=2, schedule="1f1b", balance=[12, 22]), 2, 8),
    "pipe_deferred_2_6": RunLayout(partial(_PIPELINE, micro_batches=2, balance=[2, 6], deferred_batch_norm=True), 2, 8),
    "ddp_b2_x2": RunLayout("ddp", 2, 2, 2, replicas=2),
    "fsdp_b2_x2": RunLayout(_FSDP_WHOLE, 2, 2, 2, replicas=2),
    "fsdp_kept_b2_x2": RunLayout(partial(_FSDP_WHOLE, reshard_after_forward=False), 2, 2, 2, replicas=2),
}
