"""A network whose blocks are built later, one at a time, each where the strategy in charge wants it.

``LazyBlocks(factories)`` is an ``nn.Sequential`` whose block ``i`` is
``factories[i]()``. It starts on the meta device: names, shapes and parameter
counts are there, but no memory. ``materialize()`` then builds each block for real,
alone, from its own seed, and moves it where ``placed()`` says: a strategy that
splits the network (model or pipeline parallel) materialises each block straight
on its stage's device, or not at all in a process that does not hold it, so the
whole network never has to fit in one place. Without such a strategy every block
is built on the default device (the one Lightning's ``configure_model`` runs on).

A block's weights depend only on its seed (``seed + i``), never on which blocks
were built before it, so every layout starts from the same weights as one device.
LightningModules build their network on the meta device in ``__init__`` and call
``materialize()`` in ``configure_model``, as Lightning recommends for large models.
"""

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any, overload

import torch
from torch import Tensor, nn
from typing_extensions import override

from multigpu.compat import BuiltBlocksMove

__all__ = ["BlockFactory", "LazyBlocks", "Placement", "is_materialized", "placed"]

BlockFactory = Callable[[], nn.Module]
Placement = Callable[[int], torch.device | None]
"""Where block ``i`` goes: a device, or None to leave it on the meta device (another process holds it)."""

_placement: ContextVar[Placement | None] = ContextVar("placement", default=None)


@contextmanager
def placed(where: Placement) -> Iterator[None]:
    """Within this context, ``LazyBlocks.materialize()`` puts block ``i`` on ``where(i)``."""
    token = _placement.set(where)
    try:
        yield
    finally:
        _placement.reset(token)


def is_materialized(module: nn.Module) -> bool:
    """True unless a parameter or buffer of ``module`` is on the meta device."""
    return not any(tensor.is_meta for tensor in (*module.parameters(), *module.buffers()))


class LazyBlocks(BuiltBlocksMove):
    """An ``nn.Sequential`` of blocks built by ``factories``, on the meta device until materialised.

    Args:
        factories: one function per block, each building that block (on the current default device).
        seed: block ``i`` is built under ``torch.manual_seed(seed + i)``; default one drawn from
            torch's global generator, so that ``seed_everything`` fixes it.
    """

    def __init__(self, factories: Sequence[BlockFactory], seed: int | None = None) -> None:
        with torch.device("meta"):
            super().__init__(*(factory() for factory in factories))
        self.factories = list(factories)
        # Factories cut from one network (``architectures.NetworkBlocks``) keep it while blocks are built in turn.
        self._holding = getattr(factories, "holding", nullcontext)
        self._release = getattr(factories, "release", None)
        self.seed = int(torch.randint(0, 2**62, (), device="cpu").item()) if seed is None else seed
        self._complete = False  # every block built: checked in forward, where a loop over tensors would cost
        self._materialized = False  # materialize() has run (else a state dict loaded into it builds it first)
        self.register_load_state_dict_pre_hook(_build_before_loading)

    def build(self, index: int) -> nn.Module:
        """A new copy of block ``index`` with its initial weights, on the CPU (whatever the default device)."""
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.default_generator.manual_seed(self.seed + index)  # the CPU's alone: GPU generators untouched
            return self.factories[index]()

    def building(self) -> AbstractContextManager:
        """Within it, ``build`` calls in turn share what their factories have in common (one network built once)."""
        return self._holding()

    @property
    def pending(self) -> list[int]:
        """Indices of the blocks still on the meta device."""
        return [index for index, block in enumerate(self) if not is_materialized(block)]

    def materialize(self) -> None:
        """Build every block still on the meta device, one at a time, where ``placed()`` says."""
        where = _placement.get() or (lambda index: torch.get_default_device())
        devices = [where(index) for index in range(len(self))]
        pending = self.pending
        if self._materialized and not self._complete and any(devices[index] is not None for index in pending):
            raise RuntimeError(
                f"blocks {pending} of this network were left to other processes (one stage of a split run): "
                "building them here from their initial weights would mix them with trained ones. Load a full "
                "checkpoint into a new LightningModule instead."
            )
        with self.building():
            for index in pending:
                device = devices[index]
                if device is not None and device.type != "meta":  # meta: shapes only, as asked
                    self[index] = self.build(index).to(device)
        self._materialized = True
        self._complete = not self.pending
        if self._release is not None:
            self._release()

    @overload
    def __getitem__(self, index: slice) -> nn.Sequential: ...

    @overload
    def __getitem__(self, index: int) -> nn.Module: ...

    @override
    def __getitem__(self, index: int | slice) -> nn.Module:
        if isinstance(index, slice):  # a stage: a plain Sequential that shares the blocks
            return nn.Sequential(OrderedDict(list(self.named_children())[index]))
        return super().__getitem__(index)

    @override
    def is_built(self, block: nn.Module) -> bool:
        # Blocks not built (yet, or in this process) are placeholders: moves to a device or dtype pass them
        # by, so that Lightning may move the module (to the CPU at teardown, say) whatever is built.
        return is_materialized(block)

    @override
    def forward(self, x: Tensor) -> Tensor:
        if not self._complete:
            raise RuntimeError(
                f"blocks {self.pending} of the network are not built yet: call the LightningModule's "
                "configure_model() first (a Trainer does)."
            )
        return super().forward(x)


def _build_before_loading(module: LazyBlocks, *args: Any) -> None:
    """A network never materialised (in the main process of ddp_spawn, which gets the workers' weights back) is
    built before the weights land; a stage of a split run keeps its other blocks unbuilt."""
    if not module._materialized:
        module.materialize()
