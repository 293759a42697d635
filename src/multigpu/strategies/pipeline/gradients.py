"""What a pipeline does with its gradients between the schedule and the optimizer step.

Each process holds one stage's gradients, so the operations that need all of them
(the clipping norm, 16-mixed's overflow check) combine them over the pipeline, and
the replicas of a stage average theirs as DDP does.
"""

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.plugins import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor, nn
from torch.optim import Optimizer

from multigpu.compat import found_inf_flags
from multigpu.contracts import TrainsNetwork

__all__ = ["average_between_replicas", "clip_over_stages", "micro_batch_loss", "norm_over_stages", "over_stages"]


def average_between_replicas(params: Sequence[nn.Parameter], group: dist.ProcessGroup, replicas: int) -> None:
    """Average the gradients of the processes that hold the same stage, as DDP does."""
    if replicas == 1:
        return
    for param in params:
        if param.grad is not None:
            dist.all_reduce(param.grad, group=group)
            param.grad /= replicas


def norm_over_stages(params: Sequence[nn.Parameter], group: dist.ProcessGroup, device: torch.device) -> Tensor:
    """The 2-norm of the gradients of every stage of the pipeline, from this stage's ``params`` (one all-reduce)."""
    squares = torch.zeros((), device=device)
    for param in params:
        if param.grad is not None:
            squares += param.grad.detach().float().pow(2).sum()
    dist.all_reduce(squares, group=group)
    return squares.sqrt()


def _clip_norm_over_stages(
    params: Sequence[nn.Parameter], clip_val: float, group: dist.ProcessGroup, device: torch.device
) -> None:
    """Clip this stage's gradients by the norm of the gradients of every stage of the pipeline."""
    params = [param for param in params if param.grad is not None]
    torch.nn.utils.clip_grads_with_norm_(params, clip_val, norm_over_stages(params, group, device))


def _share_overflow(precision_plugin: Precision, optimizer: Optimizer, device: torch.device) -> None:
    """Under 16-mixed, an overflow on any process skips the step on all (each sees only its stage's)."""
    scaler = getattr(precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return
    found = found_inf_flags(scaler, optimizer)
    flags = [flag.to(device).sum() for flag in found.values()]
    anywhere = torch.stack(flags).sum() if flags else torch.zeros((), device=device)
    dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)
    if anywhere.item() > 0:
        found[device] = torch.ones(1, device=device)


def clip_over_stages(
    precision_plugin: Precision,
    optimizer: Optimizer,
    clip_val: float,
    algorithm: GradClipAlgorithmType,
    params: Sequence[nn.Parameter],
    group: dist.ProcessGroup,
    device: torch.device,
) -> None:
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


class _ClipsOverStages:
    """Placed before a precision plugin's class: its ``clip_gradients`` works over the pipeline's stages."""

    stage_params: Callable[[], list[nn.Parameter]]
    pipe_group: dist.ProcessGroup
    stage_device: torch.device

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        assert isinstance(self, Precision), "placed before a precision plugin's class by over_stages"
        clip_over_stages(
            self, optimizer, clip_val, gradient_clip_algorithm, self.stage_params(), self.pipe_group, self.stage_device
        )


def over_stages(
    plugin: Precision,
    stage_params: Callable[[], list[nn.Parameter]],
    pipe_group: dist.ProcessGroup,
    device: torch.device,
) -> Precision:
    """``plugin``, as an instance of a subclass of its own class whose ``clip_gradients`` (``clip_over_stages``)
    clips by the norm over every stage and skips a 16-mixed overflow on all of them; the same state otherwise
    (its loss scaler included)."""
    base = type(plugin)
    if not isinstance(plugin, _ClipsOverStages):
        base = type(f"{base.__name__}OverStages", (_ClipsOverStages, base), {"__module__": __name__})
    over = base.__new__(base)
    assert isinstance(over, _ClipsOverStages)
    over.__dict__.update(vars(plugin))
    over.stage_params, over.pipe_group, over.stage_device = stage_params, pipe_group, device
    return over


def micro_batch_loss(
    pl_module: TrainsNetwork, trainer: Trainer, micro_batches: int, precision_plugin: Precision
) -> Callable[[Tensor, Tensor], Tensor]:
    """The loss the last stage computes for each micro-batch: its share of the mean over the batch and the
    accumulated batches of ``trainer``, scaled as 16-mixed scales the loss."""

    def loss(logits: Tensor, target: Tensor) -> Tensor:
        accumulated = trainer.accumulate_grad_batches
        share = pl_module.criterion(logits, target) / (micro_batches * accumulated)
        scaler = getattr(precision_plugin, "scaler", None)
        return scaler.scale(share) if scaler is not None else share

    return loss
