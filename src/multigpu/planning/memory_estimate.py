"""How much memory each device of a layout will hold, estimated from the network on the meta device.

For each block, ``block_memory`` counts its parameters and what its forward pass keeps for the
backward pass (every tensor autograd saves, found with ``saved_tensors_hooks``) per image, on
the meta device: shapes, no memory, no arithmetic. ``estimate`` then adds up, per device, the
parameters, gradients and optimizer state of the blocks it holds, and the activations of the
images in flight through them:

- one device, ``ddp`` and ``fsdp``: the whole batch through every block; ``ddp`` adds its
  gradient buckets (one more copy of the gradients), ``fsdp`` holds 1/N of the state plus one
  block's parameters gathered whole, the next one's gathered ahead, and one block's whole gradients;
- ``dp``: each device a slice of the batch; the first one also holds the optimizer state;
- ``manual_model_parallel``: each device its stage's blocks, for the whole batch;
- ``pipeline``: each process its stages' blocks, for one micro-batch times the micro-batches
  in flight (GPipe and LoopedBFS run every forward pass first: all of them; the others at
  most as many as there are stages after this one).

With activation recomputation a block keeps only its input, and recomputes its activations
one block at a time. Under 16-bit mixed precision activations take 2 bytes per value.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from multigpu.model.classifier import IMAGE_SHAPE
from multigpu.model.lazy_blocks import BlockFactory, LazyBlocks
from multigpu.planning.layouts import Layout
from multigpu.strategies.partition import stage_ranges

__all__ = ["BlockMemory", "block_memory", "estimate"]

_ALL_AT_ONCE = ("gpipe", "loopedbfs")  # schedules that run every micro-batch's forward pass before a backward


@dataclass(frozen=True)
class BlockMemory:
    """Per block: bytes of parameters, bytes per image of what it saves for backward and of its input, and its
    number of parameter tensors."""

    params: list[int]
    activations: list[float]
    inputs: list[float]
    tensors: list[int]


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


def _activations(
    memory: BlockMemory, blocks: Sequence[int], images: float, recompute: bool, in_flight: int = 1
) -> float:
    """What ``blocks`` keep for ``in_flight`` batches of ``images``; with recomputation, the blocks' inputs for
    each, and the activations of one block of one batch, recomputed at a time."""
    if not blocks:
        return 0.0
    if recompute:
        return images * (in_flight * sum(memory.inputs[i] for i in blocks) + max(memory.activations[i] for i in blocks))
    return in_flight * images * sum(memory.activations[i] for i in blocks)


def estimate(layout: Layout, memory: BlockMemory, optimizer_states: int) -> list[list[int]]:
    """Bytes each device of each process of ``layout`` holds at its peak, process by process, with
    ``optimizer_states`` tensors of optimizer state per parameter."""
    batch_size = layout.batch_size
    every = range(len(memory.params))
    held = lambda blocks: sum(memory.params[i] for i in blocks)  # noqa: E731
    state = lambda blocks: held(blocks) * (2 + optimizer_states)  # noqa: E731
    recompute = layout.recompute
    if layout.strategy in ("auto", "ddp"):
        extra = held(every) if layout.strategy == "ddp" else 0
        device = state(every) + extra + _activations(memory, every, batch_size, recompute)
        return [[int(device)] for _ in range(layout.processes)]
    if layout.strategy == "fsdp":
        # 1/N of the state; whole at once only a block's parameters (the one computing and the next, gathered
        # ahead) and, in the backward pass, its gradients before they are reduce-scattered.
        gathered = 3 * max(memory.params)
        device = state(every) / layout.devices + gathered + _activations(memory, every, batch_size, recompute)
        return [[int(device)] for _ in range(layout.processes)]
    if layout.strategy == "dp":
        images = -(-batch_size // layout.devices)
        activations = _activations(memory, every, images, recompute)
        return [[int(state(every) + activations)] + [int(2 * held(every) + activations)] * (layout.devices - 1)]
    if layout.balance is None:
        raise ValueError("a split layout needs its balance before its memory is estimated")
    stages = stage_ranges(layout.balance)
    if layout.strategy == "manual_model_parallel":
        replicated = layout.replicas > 1
        devices = [
            int(
                state(blocks)
                + (held(blocks) if replicated else 0)
                + _activations(memory, blocks, batch_size, recompute)
            )
            for blocks in stages
        ]
        return [devices for _ in range(layout.processes)]
    pipeline, micro_batch = layout.pipeline, batch_size / layout.micro_batches
    per_process = []
    for process in range(pipeline.processes):
        total = 0.0
        for stage in pipeline.stages_of(process):
            in_flight = layout.micro_batches
            if layout.schedule not in _ALL_AT_ONCE:
                in_flight = min(in_flight, pipeline.num_stages - stage)
            total += state(stages[stage]) + _activations(memory, stages[stage], micro_batch, recompute, in_flight)
        per_process.append([int(total)])
    return per_process * layout.replicas
