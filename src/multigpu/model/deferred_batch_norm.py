"""BatchNorm whose running statistics are those of the whole batch, not of the last micro-batch.

A pipeline cuts each batch into micro-batches, and plain BatchNorm updates its running
mean and variance once per micro-batch, from that micro-batch alone. ``DeferredBatchNorm``
(after torchgpipe's deferred batch norm) still normalises each micro-batch by its own
statistics during training, as plain BatchNorm does, so the forward and backward passes
are unchanged; but it only accumulates the micro-batches' statistics, and after the
``micro_batches``-th micro-batch updates the running statistics once, with the mean and the
unbiased variance of the whole batch, as BatchNorm given the whole batch at once would.

The micro-batches are combined with Chan et al.'s parallel formula (per micro-batch mean
and sum of squared deviations), which is as stable as BatchNorm's own. The accumulators
are not in the state dict: state dicts keep BatchNorm's keys, and checkpoints stay
interchangeable with every other strategy.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from multigpu.compat import AnyDimBatchNorm, BatchNormBase
from multigpu.model.recomputation import is_recomputing

__all__ = ["DeferredBatchNorm", "defer_batch_norm", "replace_batch_norm"]


class DeferredBatchNorm(AnyDimBatchNorm):
    """A BatchNorm layer that updates its running statistics once per ``micro_batches`` training micro-batches."""

    # BatchNorm's running statistics (``track_running_stats=True``) and the accumulators, all buffers.
    running_mean: Tensor
    running_var: Tensor
    num_batches_tracked: Tensor
    _tracked: Tensor
    _count: Tensor
    _mean: Tensor
    _squares: Tensor

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        micro_batches: int = 1,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True)
        self.micro_batches = micro_batches
        # Micro-batches so far, elements per feature, their mean, and their sum of squared deviations from it:
        # buffers, which the pipeline stage's metadata inference (a real forward pass) backs up and restores.
        self.register_buffer("_tracked", torch.zeros((), dtype=torch.long), persistent=False)
        for name in ("_count", "_mean", "_squares"):
            self.register_buffer(name, torch.zeros(num_features, dtype=torch.float64), persistent=False)

    def _track(self, input: Tensor) -> None:
        dims = [0, *range(2, input.dim())]
        x = input.detach().float()
        count = x.numel() // x.shape[1]
        variance, mean = torch.var_mean(x, dims, correction=0)  # per channel, then combined in float64
        mean, squares = mean.double(), variance.double() * count
        total = self._count + count
        delta = mean - self._mean
        self._squares += squares + delta.pow(2) * self._count * count / total
        self._mean += delta * count / total
        self._count.copy_(total)
        self._tracked += 1

    def _commit_when_complete(self) -> None:
        """After the ``micro_batches``-th micro-batch, update the running statistics and start again; without
        asking the device whether it is (no synchronisation): the update is weighted by 0 until then."""
        complete = self._tracked == self.micro_batches
        self.num_batches_tracked += complete.long()
        if self.momentum is None:  # a cumulative average, as BatchNorm's
            factor = complete.double() / self.num_batches_tracked.clamp(min=1).double()
        else:
            factor = complete.double() * self.momentum
        variance = self._squares / (self._count - 1).clamp(min=1)  # unbiased, as BatchNorm's running_var
        self.running_mean.mul_(1 - factor).add_((self._mean * factor).to(self.running_mean.dtype))
        self.running_var.mul_(1 - factor).add_((variance * factor).to(self.running_var.dtype))
        for buffer in (self._tracked, self._count, self._mean, self._squares):
            buffer.masked_fill_(complete, 0)  # (a product with 0 would keep a NaN)

    @override
    def forward(self, input: Tensor) -> Tensor:
        if not self.training:
            return super().forward(input)
        if not is_recomputing():  # recomputation's second pass was tracked the first time
            with torch.no_grad():
                self._track(input)
                self._commit_when_complete()
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)


def replace_batch_norm(
    module: nn.Module, replaces: Callable[[nn.Module], bool], build: Callable[[BatchNormBase], BatchNormBase]
) -> nn.Module:
    """Replace every layer of ``module`` that ``replaces`` by ``build(layer)``, in place, the new layer holding
    the same parameters and buffers (the optimizer's parameters stay the ones it has). Returns ``module``."""
    for name, child in module.named_children():
        if replaces(child):
            assert isinstance(child, BatchNormBase), "replaces chooses BatchNorm layers"
            new = build(child)
            assert child.running_mean is not None, "replaces chooses layers that track running statistics"
            new.to(child.running_mean.device).train(child.training)
            new.weight, new.bias = child.weight, child.bias
            new.running_mean, new.running_var = child.running_mean, child.running_var
            new.num_batches_tracked = child.num_batches_tracked
            setattr(module, name, new)
        else:
            replace_batch_norm(child, replaces, build)
    return module


def defer_batch_norm(module: nn.Module, micro_batches: int) -> nn.Module:
    """Replace every BatchNorm layer in ``module`` that tracks running statistics by a ``DeferredBatchNorm``
    that commits every ``micro_batches`` micro-batches, in place (``replace_batch_norm``). Returns ``module``."""
    return replace_batch_norm(
        module,
        lambda child: (
            isinstance(child, BatchNormBase) and child.track_running_stats and not isinstance(child, DeferredBatchNorm)
        ),
        lambda child: DeferredBatchNorm(child.num_features, child.eps, child.momentum, child.affine, micro_batches),
    )
