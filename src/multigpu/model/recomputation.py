"""Activation recomputation, applied to a network's blocks from outside the network.

torch calls it activation checkpointing (``torch.utils.checkpoint``); this project says
*recomputation*, so that a *checkpoint* is always a file a run resumes from.

``recompute_blocks(net)`` makes each block of an ``nn.Sequential`` run its forward pass
under ``torch.utils.checkpoint`` (non-reentrant) while gradients are recorded: only the
block's input is kept, and the block's forward pass runs again during the backward pass
to recompute what the gradients need. Activation memory then scales with the number of
blocks' inputs rather than with every intermediate tensor, for about one more forward pass.

It changes no maths: the recomputation gives the same values, so the gradients are the
same bit for bit. The one side effect a recomputation would have, a second update of
BatchNorm's running statistics, is undone: BatchNorm's buffers are put back as they
were after the first pass.

The block keeps its module, its parameters and their names (its class becomes a subclass
that wraps ``forward``), so state dicts, strategies and ``DataParallel`` see the same network.
"""

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from functools import cache
from typing import Any, SupportsIndex

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from typing_extensions import override

from multigpu.compat import BatchNormBase

__all__ = ["recompute_blocks", "is_recomputed", "is_recomputing"]

_recomputing: ContextVar[bool] = ContextVar("recomputing", default=False)


def is_recomputing() -> bool:
    """True while a recomputed block runs its forward pass again, during the backward pass."""
    return _recomputing.get()


@contextmanager
def _recomputation(module: nn.Module) -> Iterator[None]:
    """The second forward pass: ``is_recomputing()`` holds, and BatchNorm's buffers come out as they went in.

    The recomputation must run the same operations as the first pass (``torch.utils.checkpoint``
    checks the tensors it saves), so BatchNorm updates its buffers, and they are put back.
    The buffers are written through ``.data``: autograd keeps them for the backward pass,
    which in training mode does not read them, and must not see a new version.
    """
    buffers = [buffer for norm in module.modules() if isinstance(norm, BatchNormBase) for buffer in norm.buffers()]
    kept = [buffer.clone() for buffer in buffers]
    token = _recomputing.set(True)
    try:
        yield
    finally:
        _recomputing.reset(token)
        for buffer, value in zip(buffers, kept):
            buffer.data.copy_(value)


class _Recomputed(nn.Module):
    """Mixed into a block's class: its forward pass is recomputed in the backward pass while gradients are recorded."""

    @override
    def forward(self, *args: Any) -> Any:
        forward = super().forward
        if not torch.is_grad_enabled():
            return forward(*args)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=lambda: (nullcontext(), _recomputation(self)))

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple:
        # The class is made at run time, so pickle (torch.save of a module, spawned processes) rebuilds it.
        return _rebuild, (type(self).__bases__[1], self.__dict__)


def _rebuild(base: type[nn.Module], state: dict) -> nn.Module:
    recomputed = _recomputed_class(base)  # type: ignore[arg-type]  # a class is hashable: mypy reads Module's __hash__
    block = recomputed.__new__(recomputed)
    block.__setstate__(state)
    return block


@cache
def _recomputed_class(cls: type[nn.Module]) -> type[nn.Module]:
    return type(f"Recomputed{cls.__name__}", (_Recomputed, cls), {})


def is_recomputed(block: nn.Module) -> bool:
    return isinstance(block, _Recomputed)


def recompute_blocks(net: nn.Sequential) -> None:
    """Recompute the activations of every block of ``net`` (in place; again is a no-op)."""
    for block in net:
        if not is_recomputed(block):
            block.__class__ = _recomputed_class(type(block))  # type: ignore[arg-type]  # as in _rebuild
