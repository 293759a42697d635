"""What differs between the torch releases we support (``pyproject.toml``: 2.11 to 2.15), in one place.

Each switch names the release behaviour it works around, and ``tests/test_compat.py`` names
each private hook it relies on, so that a release which moves one fails there, by name.
"""

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

__all__ = ["STAGE_HOOKS_OF_TORCH_211", "pipeline_stage"]

STAGE_HOOKS_OF_TORCH_211 = ("_shape_inference", "_get_init_p2p_neighbors_ops")
"""torch 2.11's two ``PipelineStage`` steps that change a run, each overridden below where torch has it:

- ``_shape_inference``: a stage finds its shapes by running its module once, in training mode, on zeros,
  before the first micro-batch, and BatchNorm's running statistics keep that pass (2.15 backs the buffers up
  and puts them back);
- ``_get_init_p2p_neighbors_ops``: each schedule first exchanges a tensor with every neighbouring stage, which
  gloo cannot do where both stages are in one process (the V-shaped ``ZBVZeroBubble`` and ``DualPipeV``): "Pair
  is not connected".

2.15 has neither step."""


class _StageOfTorch211(PipelineStage):
    """``PipelineStage`` that keeps its buffers through shape inference and greets only other processes
    (``STAGE_HOOKS_OF_TORCH_211``)."""

    def _shape_inference(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
        # Private in 2.11, no public switch: the pass that finds the shapes must not update BatchNorm's statistics.
        kept = [(buffer, buffer.detach().clone()) for buffer in self.submod.buffers()]
        try:
            return super()._shape_inference(args, kwargs)
        finally:
            with torch.no_grad():  # the pass ran under no_grad: nothing it saved reads these versions
                for buffer, value in kept:
                    buffer.copy_(value)

    def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
        # Private in 2.11, no public switch: a warm-up send to a neighbouring stage held by this same process
        # fails under gloo; the stages of one process pass their tensors without any send.
        return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank]


def pipeline_stage(module: torch.nn.Module, stage_index: int, num_stages: int, device: torch.device,
                   group: dist.ProcessGroup) -> PipelineStage:
    """``PipelineStage(module, stage_index, num_stages, device, group=group)``, with the same maths on every
    supported torch."""
    # An override of a step this torch lacks is never called.
    stage_class = _StageOfTorch211 if any(hasattr(PipelineStage, hook) for hook in STAGE_HOOKS_OF_TORCH_211) else PipelineStage
    return stage_class(module, stage_index, num_stages, device, group=group)
