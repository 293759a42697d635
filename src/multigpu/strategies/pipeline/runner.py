"""One batch through one process's pipeline stage: the process groups, the schedule's step, and the output
every stage gets, which the LightningModule's own step then reads as its network's output."""

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins import Precision
from torch import Tensor, nn
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
from typing_extensions import override

from multigpu.compat import pipeline_stage
from multigpu.contracts import HoldsNetwork
from multigpu.errors import UsageError
from multigpu.strategies.pipeline.forward import ForwardOnly
from multigpu.strategies.pipeline.schedule_clock import ScheduleClock
from multigpu.strategies.pipeline.stage_placement import StagePlacement, schedule_class

__all__ = ["StageBlocks", "StageRunner", "create_groups", "network_returns"]


def create_groups(
    processes: int, replicas: int, pipe_index: int, replica_index: int
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This process's pipeline (the ranks of its replica) and stage group (the ranks that hold its stages).

    Ranks ``r*S .. r*S+S-1`` form replica ``r``; every process creates every group, in the same order.
    """
    pipe_group = stage_group = None
    for replica in range(replicas):
        group = dist.new_group(list(range(replica * processes, (replica + 1) * processes)))
        if replica == replica_index:
            pipe_group = group
    for index in range(processes):
        group = dist.new_group(list(range(index, processes * replicas, processes)))
        if index == pipe_index:
            stage_group = group
    assert isinstance(pipe_group, dist.ProcessGroup) and isinstance(stage_group, dist.ProcessGroup)  # a member of both
    return pipe_group, stage_group


class StageBlocks(nn.Sequential):
    """One stage's consecutive blocks. The schedule passes what the previous stage sent as arguments: one
    tensor, or the tensors of a tuple (a split inside a bottleneck sends its output and its shortcut)."""

    @override
    def forward(self, *inputs: Tensor) -> Any:
        for tensor in inputs:  # their gradients go back to the previous stage
            if tensor.requires_grad:
                tensor.register_hook(torch.Tensor.contiguous)
        out = super().forward(inputs[0] if len(inputs) == 1 else inputs)
        # Sends need contiguous tensors (channels_last ones are not). And zero-bubble schedules detach a
        # stage's outputs in place once their input gradients are computed, while its weight gradients
        # still need what the blocks saved; the shortcut a bottleneck's entry passes on is its first
        # convolution's saved input: a tuple goes as copies.
        if isinstance(out, tuple):
            return tuple(tensor.clone(memory_format=torch.contiguous_format) for tensor in out)
        return out.contiguous()


class Replay(nn.Module):
    """Stands in for the network: returns the pipeline's output for the batch it was computed on."""

    def __init__(self, output: Tensor) -> None:
        super().__init__()
        self.output = output

    @override
    def forward(self, x: Tensor) -> Tensor:
        return self.output


@contextmanager
def network_returns(pl_module: HoldsNetwork, output: Tensor) -> Iterator[None]:
    """Within the context, ``pl_module.net`` returns ``output`` (the pipeline's, for the batch at hand)."""
    net = pl_module.net
    pl_module.net = Replay(output)
    try:
        yield
    finally:
        pl_module.net = net


class StageRunner:
    """Runs batches through ``schedule`` on this process's stages (``stage_module``).

    The schedule's shapes are fixed by the first training batch; evaluation, which runs without
    the schedule (``ForwardOnly``), takes batches of any size, before training or after it. The
    last stage's output (the logits) is broadcast to the other stages of the pipeline, so that
    every process runs the LightningModule's step on it.
    The gradients the schedule computes are kept apart until ``take_gradients``: Lightning
    zeroes the gradients between ``training_step``, where the schedule runs, and ``backward``.
    """

    def __init__(
        self,
        schedule: PipelineScheduleSingle | PipelineScheduleMulti,
        forward_only: ForwardOnly,
        stage_module: nn.Module,
        is_first: bool,
        is_last: bool,
        last_rank: int,
        group: dist.ProcessGroup,
        device: torch.device,
        precision_plugin: Precision,
        clock: ScheduleClock,
    ) -> None:
        self.schedule = schedule
        self.forward_only = forward_only
        self.stage_module = stage_module
        self.is_first, self.is_last = is_first, is_last
        self.last_rank = last_rank
        self.group = group
        self.device = device
        self.precision_plugin = precision_plugin
        self.train_batch_size: int | None = None
        self._output_width: int | None = None
        self._held_grads: list[tuple[nn.Parameter, Tensor | None]] = []
        self.clock = clock

    @classmethod
    def build(
        cls,
        modules: nn.ModuleList,
        placement: StagePlacement,
        pipe_index: int,
        rank_of: Callable[[int], int],
        micro_batches: int,
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        group: dist.ProcessGroup,
        device: torch.device,
        precision_plugin: Precision,
    ) -> "StageRunner":
        """The runner of this process's stages (``modules``, placed by ``placement``) under the placement's schedule."""
        held = placement.stages_of(pipe_index)
        stages = [
            pipeline_stage(module, stage, placement.num_stages, device, group) for module, stage in zip(modules, held)
        ]
        schedule = schedule_class(placement.schedule)(
            # a stage for a single-stage schedule, the list for a multi-stage one: the union is no type of either
            stages[0] if placement.is_single else stages,  # type: ignore[arg-type]
            micro_batches,
            loss_fn=loss_fn,
            scale_grads=False,
        )
        forward_only = ForwardOnly(modules, held, rank_of, placement.num_stages, micro_batches, device)
        last = placement.num_stages - 1
        return cls(
            schedule,
            forward_only,
            modules,
            0 in held,
            last in held,
            rank_of(last),
            group,
            device,
            precision_plugin,
            ScheduleClock(stages, device),
        )

    def run(self, batch: Any, train: bool, shared: bool = True, timed: bool = False) -> Tensor:
        """Run the batch through the pipeline; every stage gets the last stage's output, or with ``shared`` false
        only the last stage, the others zeros of its shape (no collective: a training step whose figures nobody
        reads). ``timed``: a training step's computations timed by ``clock``."""
        x, y = batch[0], batch[1]
        size = len(x)
        if train and self.train_batch_size is None:
            self.train_batch_size = size
        if train and size != self.train_batch_size:
            raise UsageError(
                f"pipeline shapes are fixed by the first training batch ({self.train_batch_size} images), but a batch "
                f"has {size}: drop the last training batch (drop_last) and keep one batch size."
            )
        with self.precision_plugin.forward_context():
            if train:
                inputs = (x,) if self.is_first else ()
                with self._gradients_held(), self.clock.timing() if timed else nullcontext():
                    output = self.schedule.step(*inputs, target=y if self.is_last else None)
            else:  # forward only; inference tensors would end up in the stage's buffers
                with torch.inference_mode(False), torch.no_grad():
                    output = self.forward_only.run(x if self.is_first else None, size)
        return self._share_output(output, size, shared)

    def _share_output(self, output: Tensor | None, size: int, shared: bool) -> Tensor:
        if self._output_width is None:
            width = torch.tensor([output.shape[1] if output is not None and self.is_last else 0], device=self.device)
            dist.broadcast(width, src=self.last_rank, group=self.group)
            self._output_width = int(width.item())
        if self.is_last:
            assert output is not None, "the last stage's schedule returns its output"
            everyones = output.detach().float().contiguous()
        elif shared:
            everyones = torch.empty(size, self._output_width, device=self.device)  # every stage reads the same batch
        else:
            return torch.zeros(size, self._output_width, device=self.device)
        if shared:
            dist.broadcast(everyones, src=self.last_rank, group=self.group)
        return everyones

    @contextmanager
    def _gradients_held(self) -> Iterator[None]:
        params = [param for param in self.stage_module.parameters() if param.requires_grad]
        earlier = [param.grad for param in params]
        for param in params:
            param.grad = None
        try:
            yield
        finally:
            self._held_grads = [(param, param.grad) for param in params]
            for param, grad in zip(params, earlier):
                param.grad = grad

    def take_gradients(self) -> None:
        """Add the gradients of the last training step's schedule to the parameters' own."""
        for param, grad in self._held_grads:
            if grad is not None:
                param.grad = grad if param.grad is None else param.grad + grad
        self._held_grads = []
