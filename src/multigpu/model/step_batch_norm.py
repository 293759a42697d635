"""BatchNorm's running statistics over replicas: those of one device that ran the step's forward passes in order.

One device that accumulates the ``M`` forward passes of a step updates each BatchNorm layer's
running mean ``M`` times: ``rm <- (1 - m) rm + m x_i`` for the ``i``-th micro-batch's mean ``x_i``,
which adds up to ``(1 - m)^M rm + sum_i m (1 - m)^(M-1-i) x_i`` (likewise for the variance, and
``1 / tracked`` in place of ``m`` for a cumulative average). Replicas that each run some of those
micro-batches would each keep only their own (and DDP keeps the first process's). Here every
replica records its micro-batches' statistics, weighted by their places in the global batch
(``multigpu.data.sampling`` says which micro-batch is which), the weighted sums are all-reduced once
per step, and every replica applies the same update: running statistics that do not depend on
how many processes computed the step (the order of the sums aside).

Each micro-batch is still normalised by its own statistics, as plain BatchNorm does: the forward
and backward passes are unchanged. The records are buffers outside the state dict, so
checkpoints stay interchangeable with every layout.
"""

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from multigpu.compat import AnyDimBatchNorm
from multigpu.model.deferred_batch_norm import replace_batch_norm
from multigpu.model.recomputation import is_recomputing

__all__ = ["StepBatchNorm", "commit_step_statistics", "record_step_statistics"]


class StepBatchNorm(AnyDimBatchNorm):
    """BatchNorm that records each training micro-batch's mean and unbiased variance, up to ``micro_batches`` a step,
    and leaves its running statistics to ``commit_step_statistics``."""

    # BatchNorm's running statistics (``track_running_stats=True``) and the records, all buffers.
    running_mean: Tensor
    running_var: Tensor
    num_batches_tracked: Tensor
    _recorded: Tensor
    _statistics: Tensor
    _batch: Tensor

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        micro_batches: int = 1,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True)
        self.register_buffer("_recorded", torch.zeros((), dtype=torch.long), persistent=False)
        self.register_buffer("_statistics", torch.zeros(micro_batches, 2, num_features), persistent=False)
        self.register_buffer("_batch", torch.zeros(2, num_features), persistent=False)

    @override
    def forward(self, input: Tensor) -> Tensor:
        if not self.training:
            return super().forward(input)
        # With a momentum of 1, BatchNorm's update leaves the batch's mean and unbiased variance in the buffers.
        # A recomputation runs the same operation (torch.utils.checkpoint checks it) but records nothing: its first
        # pass was recorded, and the buffers come out of it as they went in (``multigpu.model.recomputation``).
        output = F.batch_norm(input, self._batch[0], self._batch[1], self.weight, self.bias, True, 1.0, self.eps)
        if not is_recomputing():
            with torch.no_grad():
                self._statistics.index_copy_(0, self._recorded.view(1), self._batch.unsqueeze(0))
                self._recorded += 1
        return output


def record_step_statistics(module: nn.Module, micro_batches: int) -> nn.Module:
    """Replace every plain BatchNorm layer of ``module`` that tracks running statistics by a ``StepBatchNorm`` with
    room for ``micro_batches`` micro-batches a step, in place (``replace_batch_norm``). Returns ``module``."""
    return replace_batch_norm(
        module,
        lambda child: (
            type(child) in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d) and bool(child.track_running_stats)
        ),
        lambda child: StepBatchNorm(child.num_features, child.eps, child.momentum, child.affine, micro_batches),
    )


def _cumulative_weights(norm: StepBatchNorm, places: tuple[int, ...], total: int) -> tuple[float, list[float]]:
    """What the running statistics of a cumulative average (``momentum=None``) keep, and each recorded micro-batch's
    weight, for ``total`` micro-batches of which this replica ran those at ``places``: they depend on the count so
    far, which the device holds (a wait, for these layers alone)."""
    tracked = int(norm.num_batches_tracked)
    return tracked / (tracked + total), [1 / (tracked + total)] * len(places)


def _momentum_weights(momentum: float, places: tuple[int, ...], total: int) -> tuple[float, list[float]]:
    """The same for a running average of ``momentum``."""
    keep = 1 - momentum
    return keep**total, [momentum * keep ** (total - 1 - place) for place in places]


@functools.cache
def _weights_on(momentum: float, places: tuple[int, ...], total: int, device: torch.device) -> tuple[float, Tensor]:
    """``_momentum_weights`` with the weights on ``device``, made once per layout: a tensor made from Python numbers
    is a copy to the device, which the host waits for."""
    keep, weights = _momentum_weights(momentum, places, total)
    return keep, torch.tensor(weights, dtype=torch.float64, device=device)


def commit_step_statistics(
    module: nn.Module,
    recorded: int,
    replicas: int,
    replica: int,
    per_batch: int = 1,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Update the running statistics of every ``StepBatchNorm`` of ``module`` that ran this step, as one device
    that ran all ``replicas``' micro-batches in order would, and start the next step's records.

    Each layer recorded ``recorded`` micro-batches this step (the host counts them: the layers' own counts are on
    the device, and reading them would make it wait). This replica's ``k``-th micro-batch of the step is micro-batch
    ``(a x replicas + replica) x per_batch + j`` of the global batch, with ``a, j = divmod(k, per_batch)``: its
    ``a``-th loader batch, cut into ``per_batch`` micro-batches (a pipeline's; 1 otherwise). Every process of
    ``group`` (the replicas that hold these layers; default all) calls it at the same point. The sums travel on
    the first layer's device.
    """
    norms = [norm for norm in module.modules() if isinstance(norm, StepBatchNorm)]
    norms = [norm for norm in norms if norm.running_mean.device.type != "meta"]
    if not norms or not recorded:
        return
    device = norms[0].running_mean.device
    sums, updates = [], []
    places = tuple((k // per_batch * replicas + replica) * per_batch + k % per_batch for k in range(recorded))
    for norm in norms:
        if norm.momentum is None:
            keep, weights = _cumulative_weights(norm, places, recorded * replicas)
            weighted = torch.tensor(weights, dtype=torch.float64, device=norm._statistics.device)
        else:
            keep, weighted = _weights_on(norm.momentum, places, recorded * replicas, norm._statistics.device)
        sums.append((norm._statistics[:recorded].double() * weighted[:, None, None]).sum(0).flatten().to(device))
        updates.append((norm, keep, recorded * replicas))
    summed = torch.cat(sums)
    if replicas > 1:
        dist.all_reduce(summed, group=group)
    for (norm, keep, total), part in zip(updates, summed.split([2 * norm.num_features for norm, _, _ in updates])):
        mean, variance = part.view(2, -1).to(norm.running_mean.device)
        norm.running_mean.copy_(norm.running_mean.double() * keep + mean)
        norm.running_var.copy_(norm.running_var.double() * keep + variance)
        norm.num_batches_tracked += total
        norm._recorded.zero_()
