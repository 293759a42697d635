"""Evaluation through a pipeline: every micro-batch forward, stage after stage, without a schedule."""

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["ForwardOnly"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 32  # int64s: tensor count, then for each tensor its dtype, its rank and its sizes


class ForwardOnly:
    """Evaluation: every micro-batch forward through the pipeline, stage after stage, without a schedule.

    PyTorch's multi-stage schedules run their backward actions in ``eval()`` too, which fails
    where one process holds two consecutive stages (``ZBVZeroBubble``, ``DualPipeV``). Here each
    micro-batch goes through the process's stages in order, and each output goes on with a
    header of shapes and dtypes (evaluation may come before any training step has shown them).
    """

    def __init__(
        self,
        modules: Iterable[nn.Module],
        stages: Sequence[int],
        rank_of: Callable[[int], int],
        num_stages: int,
        micro_batches: int,
        device: torch.device,
    ) -> None:
        self.modules, self.stages = list(modules), list(stages)
        self.num_stages, self.micro_batches, self.device = num_stages, micro_batches, device
        self.ranks = [rank_of(stage) for stage in range(num_stages)]  # global rank of each stage's process
        self.rank = dist.get_rank()

    def run(self, x: Tensor | None, size: int) -> Tensor | None:
        """The last stage's output for the batch ``x`` of ``size`` inputs (``x`` given where stage 0 is held, ``size``
        everywhere), where that stage is held. A batch smaller than ``micro_batches`` goes as micro-batches of one."""
        held: dict[tuple[int, int], Any] = {}
        sends: list[tuple[dist.Work | None, Tensor]] = []
        last: list[Tensor] = []
        count = min(self.micro_batches, size)
        micro_batch_inputs = x.tensor_split(count) if x is not None else None
        # Micro-batch after micro-batch, each through this process's stages in order: every process then
        # sends and receives in the one global order, which cannot deadlock even where a backend (NCCL
        # bound to a device) serialises point-to-point operations like collectives.
        for micro_batch in range(count):
            for module, stage in zip(self.modules, self.stages):
                if stage == 0:
                    assert micro_batch_inputs is not None, "x is given where stage 0 is held"
                    inputs: Tensor | tuple[Tensor, ...] = micro_batch_inputs[micro_batch]
                elif self.ranks[stage - 1] == self.rank:
                    inputs = held.pop((stage - 1, micro_batch))
                else:
                    inputs = self._receive(self.ranks[stage - 1], tag=stage)
                out = module(*inputs) if isinstance(inputs, tuple) else module(inputs)
                if stage == self.num_stages - 1:
                    last.append(out)
                elif self.ranks[stage + 1] == self.rank:
                    held[(stage, micro_batch)] = out
                else:
                    sends += self._send(out, self.ranks[stage + 1], tag=stage + 1)
        for work, _ in sends:
            assert work is not None  # None for a process outside the group only
            work.wait()
        return torch.cat(last) if last else None

    def _send(self, out: Tensor | tuple[Tensor, ...], dst: int, tag: int) -> list[tuple[dist.Work | None, Tensor]]:
        tensors = [out] if isinstance(out, Tensor) else list(out)
        fields = [len(tensors)]
        for tensor in tensors:
            fields += [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
        header = torch.tensor(fields + [0] * (_HEADER - len(fields)), device=self.device)
        sent = [tensor.contiguous() for tensor in (header, *tensors)]  # kept until the sends complete
        return [(dist.isend(tensor, dst, tag=tag), tensor) for tensor in sent]

    def _receive(self, src: int, tag: int) -> Tensor | tuple[Tensor, ...]:
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        dist.recv(header, src, tag=tag)
        values, position, tensors = header.tolist(), 1, []
        for _ in range(values[0]):
            dtype, rank = _DTYPES[values[position]], values[position + 1]
            tensor = torch.empty(values[position + 2 : position + 2 + rank], dtype=dtype, device=self.device)
            dist.recv(tensor, src, tag=tag)
            tensors.append(tensor)
            position += 2 + rank
        return tensors[0] if len(tensors) == 1 else tuple(tensors)
