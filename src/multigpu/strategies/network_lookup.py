"""Where a strategy finds the network it places or wraps: the LightningModule's ``net`` (``HoldsNetwork``),
checked."""

from lightning.pytorch import LightningModule
from torch import nn

from multigpu.contracts import holds_network
from multigpu.errors import UsageError
from multigpu.typed_options import ModuleOptions

__all__ = ["block_sequence", "check_not_compiled", "network"]


def network(pl_module: LightningModule, strategy: str) -> nn.Module:
    """The plain ``nn.Module`` in ``pl_module.net``; a ``UsageError`` names what is missing.

    A compiled network is refused (``check_not_compiled``).
    """
    if not holds_network(pl_module):
        raise UsageError(
            f"strategy {strategy} needs the network as a module in `self.net` of the LightningModule; "
            f"{type(pl_module).__name__} has none."
        )
    check_not_compiled(strategy, bool(ModuleOptions.of(pl_module).compile))
    return pl_module.net


def check_not_compiled(strategy: str, compiled: bool) -> None:
    """Refuse a compiled network: our strategies move, replicate or split its blocks, which a network compiled as
    a whole does not follow. The rule at launch and in ``plan``."""
    if compiled:
        raise UsageError(
            f"strategy {strategy} places the network's blocks itself and cannot run --model.compile: "
            "drop it, or use ddp or one device."
        )


def block_sequence(pl_module: LightningModule, strategy: str) -> nn.Sequential:
    """``pl_module.net`` as an ``nn.Sequential`` of blocks, each fed by the previous block's output alone."""
    net = network(pl_module, strategy)
    if not isinstance(net, nn.Sequential):
        raise UsageError(
            f"strategy {strategy} splits the network into stages of consecutive blocks, so "
            f"{type(pl_module).__name__}.net must be an nn.Sequential of blocks, not {type(net).__name__}."
        )
    return net
