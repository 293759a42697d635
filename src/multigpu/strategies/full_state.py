"""The whole state of a sharded network, in the layout of every other strategy's checkpoint.

A LightningModule's state dict, and an optimizer's state keyed by the index of each parameter
over the parameter groups (``Optimizer.state_dict()``'s own layout), so that a checkpoint of
``fsdp`` resumes under one device, ``ddp``, model parallel or a pipeline, and theirs under ``fsdp``.

Saving gathers one tensor at a time and keeps it on the first process's CPU: no process holds
more than one copy of the state, and the others one tensor at a time. Each gather is waited for
(``DTensor.full_tensor``) on every process, so none is left running when the process ends.
Loading gives each process the whole state, which ``set_optimizer_state_dict`` cuts into its shards.
"""

from typing import Any

from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

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


def _parameter_names(module: nn.Module, optimizer: Optimizer) -> list[str]:
    """The name of each of the optimizer's parameters, in the order of its groups: index i is parameter i."""
    names = {id(param): name for name, param in module.named_parameters()}
    return [names[id(param)] for group in optimizer.param_groups for param in group["params"]]


def full_model_state(module: nn.Module, is_global_zero: bool) -> dict[str, Any]:
    """``module.state_dict()`` with whole tensors on the first process's CPU; empty on the others."""
    state = _whole_on_first(get_model_state_dict(module), is_global_zero)
    return state if is_global_zero else {}


def full_optimizer_state(module: nn.Module, optimizer: Optimizer, is_global_zero: bool) -> dict[str, Any]:
    """``optimizer.state_dict()`` of the whole network on the first process's CPU; empty on the others."""
    by_name = get_optimizer_state_dict(module, optimizer)
    names = _parameter_names(module, optimizer)
    state = {
        name: _whole_on_first(by_name["state"][name], is_global_zero) for name in names if name in by_name["state"]
    }
    if not is_global_zero:
        return {}
    index = {name: position for position, name in enumerate(names)}
    return {
        "state": {index[name]: value for name, value in state.items()},
        "param_groups": [
            {**group, "params": [index[name] for name in group["params"]]} for group in by_name["param_groups"]
        ],
    }


def load_full_optimizer_state(module: nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> None:
    """Load ``state`` (``optimizer.state_dict()``'s layout, whole tensors) into the shards of ``optimizer``."""
    names = _parameter_names(module, optimizer)
    by_name = {
        "state": {names[position]: value for position, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [names[position] for position in group["params"]]} for group in state["param_groups"]
        ],
    }
    set_optimizer_state_dict(module, optimizer, by_name, options=StateDictOptions(full_state_dict=True))
