"""Where a strategy finds the network it places or wraps: the LightningModule's ``net`` (``HoldsNetwork``),
checked."""

from lightning.pytorch import LightningModule
from torch import nn

from multigpu.contracts import holds_network
from multigpu.errors import UsageError

__all__ = ["block_sequence", "network"]


def network(pl_module: LightningModule, strategy: str) -> nn.Module:
    """The plain ``nn.Module`` in ``pl_module.net``; a ``UsageError`` names what is missing.

    Our strategies move, replicate or split the network's blocks, which a network compiled
    as a whole does not follow: they refuse ``compile``.
    """
    if not holds_network(pl_module):
        raise UsageError(
            f"strategy {strategy} needs the network as a module in `self.net` of the LightningModule; "
            f"{type(pl_module).__name__} has none."
        )
    if pl_module.hparams.get("compile"):
        raise UsageError(
            f"strategy {strategy} places the network's blocks itself and cannot run it compiled: "
            "drop --model.compile, or use ddp or one device."
        )
    return pl_module.net


def block_sequence(pl_module: LightningModule, strategy: str) -> nn.Sequential:
    """``pl_module.net`` as an ``nn.Sequential`` of blocks, each fed by the previous block's output alone."""
    net = network(pl_module, strategy)
    if not isinstance(net, nn.Sequential):
        raise UsageError(
            f"strategy {strategy} splits the network into stages of consecutive blocks, so "
            f"{type(pl_module).__name__}.net must be an nn.Sequential of blocks, not {type(net).__name__}."
        )
    return net
