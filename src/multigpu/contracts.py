"""The two contracts between the strategies and the rest of the project, written down and checked by mypy.

``Parallelism``: what the data module, the metrics, the callbacks, the timing and the CLI read from a strategy. A
base class whose bodies are the default, stated once here: each process holds the whole network on its root device
and is a replica of its own, one forward pass per loader batch, nothing to refuse before launch. Lightning's
strategies (one device, ``ddp``, ``ddp_spawn``) are read through ``parallelism_of``, which gives them that default;
ours subclass ``Parallelism`` and say what differs.

``HoldsNetwork`` and ``TrainsNetwork``: what a strategy reads from the LightningModule: the network it places, wraps
or splits (``net``, a plain ``nn.Module``; the splitting ones need an ``nn.Sequential`` of blocks), and the loss a
pipeline's last stage computes (``criterion``). A pipeline swaps ``net`` for its own module while it runs. The code
that reads them takes these protocols; ``holds_network`` and ``trains_network`` check a module at run time and
narrow its type (``isinstance`` with a protocol does not look where a module keeps its children from Python 3.12 on).
"""

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor
from typing_extensions import TypeIs

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

__all__ = ["HoldsNetwork", "Parallelism", "TrainsNetwork", "holds_network", "parallelism_of", "trains_network"]


class Parallelism(ABC):
    """What the project reads from a strategy, with the default of a whole network in every process."""

    replica_group: ProcessGroup | None = None
    """The processes that hold the same layers as this one, one per replica; ``None``: all of them."""

    micro_batches: int = 1
    """The forward passes each loader batch is cut into."""

    @property
    @abstractmethod
    def world_size(self) -> int: ...  # Lightning's own

    @property
    @abstractmethod
    def root_device(self) -> torch.device: ...  # Lightning's own

    @property
    def data_parallel_size(self) -> int:
        """The replicas, the processes that train on different samples: what the global batch and the throughput
        count."""
        return self.world_size

    @property
    def process_devices(self) -> list[torch.device]:
        """The devices this process trains on, in the order of its stages."""
        return [self.root_device]

    def gradient_norm(self, pl_module: nn.Module) -> Tensor:
        """The 2-norm of all of the network's gradients, over every process that holds a part of them: the value
        ``torch.nn.utils.clip_grad_norm_`` would return on the whole network's. On the device: read it at log steps
        only. A sharded gradient (a DTensor) is reduced over its processes."""
        norm = torch.nn.utils.get_total_norm([param.grad for param in pl_module.parameters() if param.grad is not None])
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def step_figures(self) -> dict[str, float]:
        """What the strategy measured of the last log step, by the name it is logged under, read once the device has
        finished the step: none by default; a pipeline's idle share of its schedule's step, and the schedule's
        ideal."""
        return {}

    def check_model(self, pl_module: "LightningModule") -> object:
        """Refuse, before any process is launched, a LightningModule this strategy cannot run."""
        return None

    def check_training(self, pl_module: "LightningModule") -> None:
        """Refuse, before any process is launched, what this strategy cannot train (it may evaluate it)."""
        return None


class _WholeNetworkInEachProcess(Parallelism):
    """A strategy of Lightning's, read through the default."""

    def __init__(self, trainer: "Trainer") -> None:
        self._trainer = trainer

    @property
    def world_size(self) -> int:
        return self._trainer.world_size

    @property
    def root_device(self) -> torch.device:
        return self._trainer.strategy.root_device


def parallelism_of(trainer: "Trainer") -> Parallelism:
    """What ``trainer``'s strategy says of itself: ours answer, Lightning's get the default."""
    strategy = trainer.strategy
    if isinstance(strategy, Parallelism):
        return strategy
    return _WholeNetworkInEachProcess(trainer)


class HoldsNetwork(Protocol):
    """What every strategy of ours reads from the LightningModule."""

    net: nn.Module
    """The network as a plain module; for the strategies that split it, an ``nn.Sequential`` of blocks."""


class TrainsNetwork(HoldsNetwork, Protocol):
    """What a pipeline reads from the LightningModule besides its network."""

    criterion: nn.Module
    """The loss of the network's output and the targets, which a pipeline's last stage computes."""


def holds_network(pl_module: object) -> TypeIs[HoldsNetwork]:
    """Whether ``pl_module`` holds its network as a module in ``net``."""
    return isinstance(getattr(pl_module, "net", None), nn.Module)


def trains_network(pl_module: object) -> TypeIs[TrainsNetwork]:
    """Whether ``pl_module`` holds its network and its loss as modules in ``net`` and ``criterion``."""
    return holds_network(pl_module) and isinstance(getattr(pl_module, "criterion", None), nn.Module)
