"""How much memory each device of a layout will hold, estimated from the network on the meta device.

For each block, ``block_memory`` counts its parameters and what its forward pass keeps for the
backward pass (every tensor autograd saves, found with ``saved_tensors_hooks``) per image, on
the meta device: shapes, no memory, no arithmetic. Each layout then adds up, per device, the
parameters, gradients and optimizer state of the blocks it holds, and the activations of the
images in flight through them (``Layout.device_memory``, each strategy's in ``strategies/<package>/layouts.py``).

With activation recomputation a block keeps only its input, and recomputes its activations
one block at a time. Under 16-bit mixed precision activations take 2 bytes per value.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from multigpu.model.classifier import IMAGE_SHAPE
from multigpu.model.lazy_blocks import BlockFactory, LazyBlocks
from multigpu.strategies.layout import BlockMemory

__all__ = ["block_memory"]


def _bytes(tensors) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def block_memory(factories: Sequence[BlockFactory], half_activations: bool) -> BlockMemory:
    """Count, on the meta device, what each block of the network of ``factories`` holds (see the module's
    docstring)."""
    blocks = LazyBlocks(factories, seed=0).train()
    images = 2  # BatchNorm in training mode needs two
    x: Tensor | tuple[Tensor, ...] = torch.zeros(images, *IMAGE_SHAPE, device="meta")
    scale = 0.5 if half_activations else 1.0
    params, activations, inputs, tensors = [], [], [], []
    for block in blocks:
        own = {id(param) for param in block.parameters()}
        saved: dict[int, Tensor] = {}

        def pack(tensor: Tensor) -> Tensor:
            if id(tensor) not in own:
                saved[id(tensor)] = tensor  # kept alive, so that no other tensor takes its id
            return tensor

        inputs.append(_bytes(x if isinstance(x, tuple) else [x]) * scale / images)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            x = block(x)
        params.append(_bytes(block.parameters()))
        tensors.append(len(list(block.parameters())))
        activations.append(_bytes(saved.values()) * scale / images)
    return BlockMemory(params, activations, inputs, tensors)
