"""What every DDP wrapper of this project is given: Lightning's ``ddp`` names (``multigpu.strategies``) and
``manual_model_parallel``'s replicas."""

import inspect
from typing import Any

from torch.nn.parallel import DistributedDataParallel

__all__ = ["ddp_options"]


def ddp_options() -> dict[str, Any]:
    """What Lightning's ``ddp`` names (``ddp``, ``ddp_spawn``, ``ddp_fork``...) give torch's DDP wrapper here: the
    gradients kept in DDP's buckets, with no copy between the two (``gradient_as_bucket_view``), and no broadcast
    of the first process's buffers before every forward pass. BatchNorm's, the only buffers a torchvision
    classifier has, are the same in every process already (``multigpu.model.step_batch_norm`` commits one device's
    statistics on each, and ``SyncBatchNorm`` computes the same on each); torch would send all of them (159 in
    ResNet-50) every step. torch 2.13 renamed the option ``forward_sync_buffers`` (which still syncs them as DDP
    starts); before it, ``broadcast_buffers=False`` also leaves out that first sync, which the runs' shared seed and
    checkpoint make unneeded."""
    takes = inspect.signature(DistributedDataParallel).parameters
    buffers = "forward_sync_buffers" if "forward_sync_buffers" in takes else "broadcast_buffers"
    return {"gradient_as_bucket_view": True, buffers: False}
