"""The whole state of a sharded network, in the layout of every other strategy's checkpoint.

A LightningModule's state dict, and an optimizer's state keyed by the index of each parameter
over the parameter groups (``Optimizer.state_dict()``'s own layout), so that a checkpoint of
``fsdp`` resumes under one device, ``ddp``, model parallel or a pipeline, and theirs under ``fsdp``.

Saving gathers one tensor at a time and keeps it on the first process's CPU: no process holds
more than one copy of the state, and the others one tensor at a time. Each gather is waited for
(``DTensor.full_tensor``) on every process, so none is left running when the process ends.
Loading gives each process the whole state, which it cuts into its own shards.
"""

from typing import Any

from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

from multigpu.errors import UsageError

__all__ = ["full_model_state", "full_optimizer_state", "load_full_optimizer_state"]


def _whole_on_first(value: Any, is_global_zero: bool) -> Any:
    """``value`` with each sharded tensor gathered whole, on the first process's CPU (None elsewhere)."""
    if isinstance(value, dict):
        return {key: _whole_on_first(item, is_global_zero) for key, item in value.items()}
    if isinstance(value, DTensor):
        value = value.full_tensor()  # a collective: every process takes part, and waits for it
    if isinstance(value, Tensor):
        return value.cpu() if is_global_zero else None
    return value


def full_model_state(module: nn.Module, is_global_zero: bool) -> dict[str, Any]:
    """``module.state_dict()`` with whole tensors on the first process's CPU; empty on the others."""
    state = _whole_on_first(get_model_state_dict(module), is_global_zero)
    return state if is_global_zero else {}


def full_optimizer_state(optimizer: Optimizer, is_global_zero: bool) -> dict[str, Any]:
    """``optimizer.state_dict()`` with whole tensors on the first process's CPU; empty on the others.

    Read from the optimizer as it is: torch's ``get_optimizer_state_dict`` would first take a step of
    zero gradients to create any state that does not exist yet, which changes SGD's momentum
    (weight decay) before the first real step.
    """
    state = optimizer.state_dict()  # parameters by index, in the order of their groups; values sharded
    whole = {index: _whole_on_first(value, is_global_zero) for index, value in state["state"].items()}
    return {**state, "state": whole} if is_global_zero else {}


def load_full_optimizer_state(optimizer: Optimizer, state: dict[str, Any]) -> None:
    """Load ``state`` (``optimizer.state_dict()``'s layout, whole tensors, from any strategy) into
    ``optimizer``, each tensor of a sharded parameter cut into that parameter's shard here."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    if any(not isinstance(index, int) for index in state["state"]):
        raise UsageError(
            "the checkpoint's optimizer state is keyed by parameter names (a sharded checkpoint of Lightning's own "
            "fsdp), which this fsdp does not read: resume it with the version that wrote it."
        )
    sharded = {}
    for index, values in state["state"].items():
        param = params[index]
        sharded[index] = {
            name: _shard_like(value, param) if isinstance(value, Tensor) and value.shape == param.shape else value
            for name, value in values.items()
        }
    optimizer.load_state_dict({**state, "state": sharded})


def _shard_like(value: Tensor, param: Tensor) -> Tensor:
    """``value``, a whole tensor of ``param``'s shape, as ``param`` is held here: this process's shard of it
    when ``param`` is sharded (cut here, nothing sent), else the tensor on ``param``'s device."""
    if not isinstance(param, DTensor):
        return value.to(param.device)
    return distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
