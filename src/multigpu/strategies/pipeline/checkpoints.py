"""Full checkpoints from a pipeline: each stage's part, gathered on rank 0 from the first replica.

The result is the state dict and optimizer state of one device (every parameter, every
momentum buffer, in the same order), so ``ddp`` and one device load it and the other way round.
"""

from collections.abc import Collection
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

__all__ = ["gather_optimizer_state", "gather_state_dict"]


def _gather_stages(local: dict[str, Any], processes: int, first_replica: bool, is_global_zero: bool) -> list[dict]:
    """The entries of every process of the first replica (ranks 0 .. processes - 1) on rank 0; empty elsewhere."""
    gathered: list[Any] = [None] * dist.get_world_size() if is_global_zero else []
    dist.gather_object(local if first_replica else {}, gathered if is_global_zero else None, dst=0)
    return gathered[:processes]


def gather_state_dict(
    state: dict[str, Any], stage_blocks: Collection[int], processes: int, first_replica: bool, is_global_zero: bool
) -> dict[str, Any]:
    """``state`` (a LightningModule's state dict) with every block's entries from the process that trains it."""
    prefixes = tuple(f"net.{index}." for index in stage_blocks)
    mine = {key: value.cpu() for key, value in state.items() if key.startswith(prefixes)}
    for stage_state in _gather_stages(mine, processes, first_replica, is_global_zero):
        state.update(stage_state)
    return state


def gather_optimizer_state(
    optimizer: Optimizer,
    full: dict[str, Any],
    stage: nn.Module,
    processes: int,
    first_replica: bool,
    is_global_zero: bool,
) -> dict[str, Any]:
    """``full`` (``optimizer.state_dict()``) with the state of every stage's parameters."""
    owned = {id(param) for param in stage.parameters()}
    params = [param for group in optimizer.param_groups for param in group["params"]]
    mine = {
        index: {key: value.cpu() if isinstance(value, Tensor) else value for key, value in state.items()}
        for index, state in full["state"].items()
        if id(params[index]) in owned
    }
    merged = {}
    for stage_state in _gather_stages(mine, processes, first_replica, is_global_zero):
        merged.update(stage_state)
    return {**full, "state": dict(sorted(merged.items()))}
