"""What a strategy measures of the network's blocks before it places them: their time per input, and whether a
training micro-batch can go through them."""

from collections.abc import Sequence
from itertools import chain

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import Strategy
from torch import Tensor, nn
from torch.func import functional_call

from multigpu.strategies.partition import block_times

__all__ = ["block_times_in", "micro_batch_refusal", "time_blocks"]


def time_blocks(strategy: Strategy, blocks: nn.Sequential, micro_batches: int = 1) -> list[float] | None:
    """Seconds of each block per input on the strategy's root device, in its precision (``block_times``).

    The input is the LightningModule's ``example_input_array`` grown to one training batch
    (``hparams.batch_size``) divided by ``micro_batches``; None when the module gives no example.
    """
    pl_module = strategy.lightning_module
    example = pl_module.example_input_array
    if not isinstance(example, Tensor):
        return None
    batch_size = max(1, pl_module.hparams.get("batch_size", len(example)) // micro_batches)
    example = example[:1].expand(batch_size, *example.shape[1:])
    return block_times_in(strategy.precision_plugin, blocks, example, strategy.root_device, micro_batches)


def block_times_in(
    precision: Precision, blocks: nn.Sequential, example: Tensor, device: torch.device, micro_batches: int
) -> list[float]:
    """``block_times`` in the precision of a Lightning precision plugin: its input conversion and its autocast."""
    with precision.train_step_context():
        return block_times(blocks, precision.convert_input(example), device, micro_batches)


def micro_batch_refusal(blocks: nn.Sequential, image_shape: Sequence[int], images: int) -> str | None:
    """Why a training micro-batch of ``images`` inputs of ``image_shape`` cannot go through ``blocks`` (BatchNorm
    given one value per channel, a kernel larger than its input), or None when it can.

    The blocks run on the meta device, on meta copies of their parameters and buffers: nothing is
    computed, the network is left as it is, and it may still be unbuilt (``LazyBlocks``).
    """
    x: Tensor | tuple[Tensor, ...] = torch.empty(images, *image_shape, device="meta")
    try:
        for block in blocks:
            state = {name: tensor.to("meta") for name, tensor in chain(block.named_parameters(), block.named_buffers())}
            x = functional_call(block, state, (x,))
    except NotImplementedError:  # an operation the meta device lacks: this check cannot tell
        return None
    except (RuntimeError, ValueError) as error:
        return str(error).splitlines()[0]
    return None
