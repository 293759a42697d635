"""Whether a training micro-batch can go through the network's blocks, checked without computing anything: what
the pipeline refuses before it launches, and what ``plan`` leaves out."""

from collections.abc import Sequence
from itertools import chain

import torch
from torch import Tensor, nn
from torch.func import functional_call

__all__ = ["micro_batch_refusal"]


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
