"""What a pipeline does with its gradients between the schedule and the optimizer step.

Each process holds one stage's gradients, so the operations that need all of them
(the clipping norm, 16-mixed's overflow check) combine them over the pipeline, and
the replicas of a stage average theirs as DDP does.
"""

from collections.abc import Sequence

import torch
import torch.distributed as dist
from lightning.pytorch.plugins import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn
from torch.optim import Optimizer

__all__ = ["average_between_replicas", "clip_over_stages"]


def average_between_replicas(params: Sequence[nn.Parameter], group: dist.ProcessGroup, replicas: int) -> None:
    """Average the gradients of the processes that hold the same stage, as DDP does."""
    if replicas == 1:
        return
    for param in params:
        if param.grad is not None:
            dist.all_reduce(param.grad, group=group)
            param.grad /= replicas


def _clip_norm_over_stages(params: Sequence[nn.Parameter], clip_val: float, group: dist.ProcessGroup,
                          device: torch.device) -> None:
    """Clip this stage's gradients by the norm of the gradients of every stage of the pipeline."""
    params = [param for param in params if param.grad is not None]
    squares = torch.zeros((), device=device)
    for param in params:
        squares += param.grad.detach().float().pow(2).sum()
    dist.all_reduce(squares, group=group)
    torch.nn.utils.clip_grads_with_norm_(params, clip_val, squares.sqrt())


def _share_overflow(precision_plugin: Precision, optimizer: Optimizer, device: torch.device) -> None:
    """Under 16-mixed, an overflow on any process skips the step on all (each sees only its stage's)."""
    scaler = getattr(precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return
    # GradScaler keeps its per-device overflow flags here; it has no public way to set them.
    found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    flags = [flag.to(device).sum() for flag in found.values()]
    anywhere = torch.stack(flags).sum() if flags else torch.zeros((), device=device)
    dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)
    if anywhere.item() > 0:
        found[device] = torch.ones(1, device=device)


def clip_over_stages(precision_plugin: Precision, optimizer: Optimizer, clip_val: float,
                     algorithm: GradClipAlgorithmType, params: Sequence[nn.Parameter], group: dist.ProcessGroup,
                     device: torch.device) -> None:
    """Lightning's clipping step (``Precision.clip_gradients``), made pipeline-wide.

    Lightning calls it after unscaling and before the optimizer step, with or without
    clipping, so it is also where a 16-mixed overflow on one stage skips the step on all.
    """
    _share_overflow(precision_plugin, optimizer, device)
    if clip_val <= 0:
        return
    if algorithm == GradClipAlgorithmType.VALUE:
        precision_plugin.clip_grad_by_value(optimizer, clip_val)
    else:
        _clip_norm_over_stages(params, clip_val, group, device)
