"""What the strategies that split the network into stages share (``manual_model_parallel``, ``pipeline``).

Each block of ``pl_module.net`` goes straight to the device of its stage, or to none in
a process that does not hold its stage: a network built as ``LazyBlocks`` is
materialised block by block in ``configure_model`` (see ``multigpu.model.lazy_blocks``),
and any other network is moved block by block, its foreign blocks to the meta device.
The whole network is never on one device, and optimizer state exists only for the
parameters a process holds.
"""

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from multigpu.contracts import Parallelism
from multigpu.model.lazy_blocks import is_materialized, placed
from multigpu.strategies.network_lookup import block_sequence

__all__ = ["SplitNetworkStrategy"]

META = torch.device("meta")


@contextmanager
def _without_child(module: nn.Module, name: str) -> Iterator[nn.Module]:
    """``module`` without its child ``name``, which the context yields, then puts back in its place: the children
    after it are set again behind it, so that the module's parameters (its optimizer's state, its checkpoints) keep
    their order."""
    names = [key for key, _ in module.named_modules(remove_duplicate=False) if key and "." not in key]  # every child
    child = getattr(module, name)
    delattr(module, name)
    try:
        yield child
    finally:
        setattr(module, name, child)
        for key in names[names.index(name) + 1 :]:
            later = getattr(module, key)
            delattr(module, key)
            setattr(module, key, later)


class SplitNetworkStrategy(DDPStrategy, Parallelism):
    """A DDP-launched strategy that places each block of the network itself (see the module's docstring)."""

    strategy_name: str  # each subclass's, the name it is registered under

    def place_blocks(self) -> list[torch.device | None]:
        """Decide, the first time, where the blocks go (the strategy times them, balances them over its stages and
        says so), and give the device of each block in this process; None for the blocks other processes hold."""
        raise NotImplementedError

    @contextmanager
    @override
    def model_sharded_context(self) -> Iterator[None]:
        devices = self.place_blocks()
        with placed(devices.__getitem__):
            yield

    @override
    def model_to_device(self) -> None:
        pl_module = self.lightning_module
        assert pl_module is not None
        blocks = block_sequence(pl_module, self.strategy_name)
        devices = self.place_blocks()
        with _without_child(pl_module, "net"):
            pl_module.to(self.root_device)  # metrics, loss and any other state: where the step runs
        for block, device in zip(blocks, devices, strict=True):
            block.to(META if device is None else device)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        # Only the entries of the blocks this process holds: loading into the meta device would do nothing,
        # with a warning per tensor.
        pl_module = self.lightning_module
        assert pl_module is not None
        unbuilt = {
            name for name, tensor in (*pl_module.named_parameters(), *pl_module.named_buffers()) if tensor.is_meta
        }
        held = {name: value for name, value in checkpoint["state_dict"].items() if name not in unbuilt}
        missing, unexpected = pl_module.load_state_dict(held, strict=False)
        missing = [name for name in missing if name not in unbuilt]
        if strict and (missing or unexpected):
            raise RuntimeError(f"the checkpoint does not fit the model: missing {missing}, unexpected {unexpected}")

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        # Lightning's version moves all optimizer state to the root device. Here each state stays on its
        # parameter's device, where ``Optimizer.load_state_dict`` puts it, and none is kept for the
        # parameters of another process's stage (``load_state_dict`` put theirs on the meta device).
        optimizers: list[Optimizer] = self.optimizers
        for optimizer, state in zip(optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(state)
            for param in [param for param in optimizer.state if param.is_meta]:
                del optimizer.state[param]

    @override
    def teardown(self) -> None:
        pl_module = self.lightning_module
        net = getattr(pl_module, "net", None)
        if not isinstance(net, nn.Sequential) or all(is_materialized(block) for block in net):
            return super().teardown()
        assert pl_module is not None
        with _without_child(pl_module, "net"):  # Lightning moves the module to the CPU, which meta blocks refuse
            super().teardown()
        for block in net:
            if is_materialized(block):
                block.cpu()
