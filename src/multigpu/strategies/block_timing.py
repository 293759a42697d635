"""Timing the network's blocks on a device: what the split strategies balance by when they place the blocks, and
what ``plan``'s profile builds its forecasts from. Every clock read here (and in ``plan``'s timed runs) waits for
the device the same way, with ``multigpu.run.device_sync.synchronize``."""

import copy
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import Strategy
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn

from multigpu.model.lazy_blocks import LazyBlocks
from multigpu.run.device_sync import synchronize
from multigpu.typed_options import ModuleOptions, options_of

__all__ = [
    "block_pass_times",
    "block_pass_times_together",
    "block_times",
    "block_times_in",
    "cut_from_graph",
    "sgd_options",
    "time_blocks",
    "timed_update",
]


def cut_from_graph(value: Any, needs_grad: bool = True) -> Any:
    """``value``'s tensors (one, or a collection: the halves of a bottleneck pass two) cut from the autograd graph,
    the floating-point ones needing gradients again when ``needs_grad``: a block's or a run of blocks' input, timed
    apart from what came before it."""
    return apply_to_collection(value, Tensor, lambda t: t.detach().requires_grad_(needs_grad and t.is_floating_point()))


@dataclass(frozen=True)
class _UpdateCost:
    """The SGD options an update's cost depends on (``sgd_options``), plain SGD's where a module has none."""

    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0


def sgd_options(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The options of the recipe's SGD that set what its update costs, from a model's ``--model.*`` settings or
    hyperparameters: momentum, Nesterov's and weight decay each add a pass over the parameters (timed with plain
    momentum alone, the blocks' updates came out well short of the recipe's: docs/plan.md, "What a forecast is
    built from"). A module without them is taken to update with plain SGD.
    The learning rate costs nothing and is 0, so that a timed update changes no parameter."""
    cost = options_of(_UpdateCost, settings)
    return {
        "momentum": cost.momentum,
        "nesterov": bool(cost.nesterov) and cost.momentum > 0,
        "weight_decay": cost.weight_decay,
    }


def timed_update(params: list[nn.Parameter], sgd: Mapping[str, Any]) -> torch.optim.SGD:
    """The recipe's SGD over ``params`` with the options ``sgd`` (``sgd_options``), at learning rate 0: a step costs
    what the recipe's does and changes no parameter."""
    return torch.optim.SGD(params, lr=0.0, **sgd)


def block_times(
    blocks: nn.Sequential,
    example: Tensor,
    device: torch.device,
    sgd: Mapping[str, Any],
    micro_batches: int = 1,
    repeats: int = 3,
) -> list[float]:
    """Seconds each block costs on ``device`` in one step of ``micro_batches`` inputs like ``example``, per input:
    one forward and backward pass, plus a ``micro_batches``-th of one update of its parameters
    (SGD with the options ``sgd``, the recipe's: ``sgd_options``), which comes once per step (``block_pass_times``)."""
    return [
        forward + backward + update / micro_batches
        for forward, backward, update in block_pass_times(blocks, example, device, sgd, repeats)
    ]


def block_pass_times(
    blocks: nn.Sequential, example: Tensor, device: torch.device, sgd: Mapping[str, Any], repeats: int = 3
) -> list[tuple[float, float, float]]:
    """Seconds of each block's forward pass, backward pass and update (SGD with the options ``sgd``) on
    ``device`` for one input like ``example``.

    Each block is timed on a copy of its own, so the network's parameters and BatchNorm
    statistics stay as they are and only one block's copy is on the device at a time; the
    copy of a block of ``LazyBlocks`` is built anew, so the network itself may still be on
    the meta device. One warm-up pass comes before the ``repeats`` that are timed, and the
    fastest counts (the others were slowed by something else).
    """
    return block_pass_times_together(blocks, [example], [None], device, sgd, repeats)[0]


def block_pass_times_together(
    blocks: nn.Sequential,
    examples: Sequence[Tensor],
    threads: Sequence[int | None],
    device: torch.device,
    sgd: Mapping[str, Any],
    repeats: int = 3,
) -> list[list[tuple[float, float, float]]]:
    """``block_pass_times`` for each input of ``examples``, with as many CPU threads as ``threads`` gives it (None:
    as they are), timed together: each block's copy runs every input in turn (its untimed pass, then its timed
    ones) before the next block comes, so that a slow moment of the machine falls on all of them alike, not on
    the inputs timed then."""
    if isinstance(blocks, LazyBlocks):
        with blocks.building():
            return _pass_times(blocks, blocks.build, examples, threads, device, sgd, repeats)
    return _pass_times(blocks, lambda index: copy.deepcopy(blocks[index]), examples, threads, device, sgd, repeats)


def _pass_times(
    blocks: nn.Sequential,
    fresh: Callable[[int], nn.Module],
    examples: Sequence[Tensor],
    threads: Sequence[int | None],
    device: torch.device,
    sgd: Mapping[str, Any],
    repeats: int,
) -> list[list[tuple[float, float, float]]]:
    times: list[list[tuple[float, float, float]]] = [[] for _ in examples]
    inputs, before = [example.to(device) for example in examples], torch.get_num_threads()
    try:
        for index in range(len(blocks)):
            block = fresh(index).to(device).train()
            params = [param for param in block.parameters() if param.requires_grad]
            update = timed_update(params, sgd) if params else None
            inputs = [cut_from_graph(x, needs_grad=index > 0) for x in inputs]
            passes: list[tuple[list[float], list[float], list[float]]] = [([], [], []) for _ in examples]
            outputs = list(inputs)
            for which, x in enumerate(inputs):  # each after its own untimed pass: another thread count, say
                torch.set_num_threads(threads[which] or before)
                for _ in range(repeats + 1):
                    outputs[which] = _timed_pass(block, x, update, device, passes[which])
            for which, (forwards, backwards, updates) in enumerate(passes):
                times[which].append((min(forwards[1:]), min(backwards[1:]), min(updates[1:])))
            inputs = outputs
    finally:
        torch.set_num_threads(before)
    return times


def _timed_pass(block: nn.Module, x, update: torch.optim.Optimizer | None, device: torch.device, passes: tuple):
    """One forward pass, backward pass and update of ``block``, each one's seconds appended to ``passes``; returns
    the block's output."""
    forwards, backwards, updates = passes
    synchronize(device)
    start = time.perf_counter()
    out = block(x)
    synchronize(device)
    middle = time.perf_counter()
    outputs = [output for output in ([out] if isinstance(out, Tensor) else out) if output.requires_grad]
    if outputs:  # none where a block without parameters is first (nothing before it needs gradients)
        torch.autograd.backward(outputs, [torch.ones_like(output) for output in outputs])
    synchronize(device)
    end = time.perf_counter()
    if update is not None:
        update.step()
        synchronize(device)
    forwards.append(middle - start)
    backwards.append(end - middle)
    updates.append(time.perf_counter() - end if update is not None else 0.0)  # a block without parameters: none
    return out


def time_blocks(strategy: Strategy, blocks: nn.Sequential, micro_batches: int = 1) -> list[float] | None:
    """Seconds of each block per input on the strategy's root device, in its precision (``block_times``).

    The input is the LightningModule's ``example_input_array`` grown to one training batch
    (``hparams.batch_size``) divided by ``micro_batches``; None when the module gives no example.
    """
    pl_module = strategy.lightning_module
    assert pl_module is not None
    example = pl_module.example_input_array
    if not isinstance(example, Tensor):
        return None
    batch_size = max(1, (ModuleOptions.of(pl_module).batch_size or len(example)) // micro_batches)
    example = example[:1].expand(batch_size, *example.shape[1:])
    sgd = sgd_options(pl_module.hparams)
    return block_times_in(strategy.precision_plugin, blocks, example, strategy.root_device, sgd, micro_batches)


def block_times_in(
    precision: Precision,
    blocks: nn.Sequential,
    example: Tensor,
    device: torch.device,
    sgd: Mapping[str, Any],
    micro_batches: int,
) -> list[float]:
    """``block_times`` in the precision of a Lightning precision plugin: its input conversion and its autocast."""
    with precision.train_step_context():
        return block_times(blocks, precision.convert_input(example), device, sgd, micro_batches)
