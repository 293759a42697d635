"""The time of each block, which ``plan`` balances the split layouts by and builds its forecasts from.

``BlockProfile`` times each block's forward pass, backward pass and update (the recipe's SGD) on the first device,
in the run's precision, for every micro-batch size and, on the CPU, thread count it is asked for, all sizes together
block by block (``block_pass_times_together``): a process of a layout of ``P`` processes gets
``cores / P`` threads, as Lightning's launcher gives it. On the CPU a batch above ``CPU_IMAGES`` images is timed at that
size and scaled per image (the time per image is flat by then), which keeps a plan of large
batches short. Then the whole network's forward pass and its backward pass are timed at each size, in ``SEGMENTS``
runs of consecutive blocks cut apart as a pipeline's stages are, and each run's blocks' forward passes are scaled
to add up to its forward pass, their backward passes to its backward pass: a block timed on its own pays a call of
its own and finds its parameters in the caches, which a training step does not (the blocks add up to more than the
whole network, more at the smallest micro-batches), and the blocks do not divide a pass as the network does (timed
one by one, the early blocks' backward passes come out further above their stage's own than the late ones', so that
scaled to the whole network as one, the first stage's backward pass was forecast long, the others' short, and a
4-stage pipeline of 4 micro-batches fast; docs/plan.md, "Accuracy", has the figures).
Likewise the blocks' updates are scaled to add up to the whole network's, one optimizer step at each thread count, as
a layout's process takes it.
``split_backward`` gives how much longer the zero-bubble schedules' backward pass, split into its input and its
weight gradients, takes than a whole one.

On the CPU the same rounds also run, after each size's pass alone, as many copies of the whole network at once as a
layout of that size has processes, one per Python thread with the process's threads (``contention``): how much
slower every process computes when all compute at the same moment, set against the passes alone of the same rounds,
so that the level and its contention come from one moment of the machine. On a slow CPU the pass alone moved from
one plan to the next while `ddp`'s measured speed held: with a contention figure from another moment (a convolution
in the link probe's processes, set against the same convolution in ``plan``'s process), each plan's `ddp` forecast
moved with that level (docs/plan.md, "Accuracy").
"""

import copy
import statistics
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

from multigpu.compat import split_backward
from multigpu.model.classifier import IMAGE_SHAPE
from multigpu.model.lazy_blocks import LazyBlocks
from multigpu.run.device_sync import synchronize
from multigpu.strategies.block_timing import block_pass_times_together, cut_from_graph, timed_update
from multigpu.strategies.micro_batch_check import micro_batch_refusal
from multigpu.timing.busy_cores import threads_per_process

__all__ = ["CPU_IMAGES", "BlockProfile", "PassTimes", "precision_plugin"]

CPU_IMAGES = 32
# Timed passes of the whole network and its updates (their mean) and of the split ratio's (the fastest), after one
# untimed
REPEATS = 2
# Timed passes of each block per size, after one untimed: the whole network's passes set the level, the blocks only
# how it divides among them, and a second timed pass would lengthen the smoke plan by seconds
# (docs/plan.md, "Running it")
BLOCK_REPEATS = 1
# The whole network's passes are timed in this many runs of about as many consecutive blocks each, cut apart as a
# pipeline's stages are, and the blocks of each run scaled to its own figures: timed one by one, ResNet-50's early
# blocks' backward passes come out further above their stage's than the late ones', so that scaled to the whole
# network as one, the first stage's backward pass was forecast long and the others' short (docs/plan.md, "Accuracy").
SEGMENTS = 4


@dataclass(frozen=True)
class PassTimes:
    """Seconds of each block's forward pass, backward pass and update, for one input of the size it was timed at."""

    forward: list[float]
    backward: list[float]
    update: list[float]

    def scaled(self, factor: float) -> "PassTimes":
        """The passes ``factor`` times slower (more images, or a slower process); the update stays."""
        return PassTimes([t * factor for t in self.forward], [t * factor for t in self.backward], self.update)

    def with_update(self, seconds: float) -> "PassTimes":
        """The blocks' updates scaled to add up to ``seconds``, the whole network's update timed as one."""
        timed = sum(self.update)
        return PassTimes(self.forward, self.backward, [t * seconds / timed for t in self.update]) if timed else self

    def scaled_to(self, bounds: Sequence[int], passes: Sequence[tuple[float, float]]) -> "PassTimes":
        """Each run of blocks between consecutive ``bounds`` scaled to its figures in ``passes``: its forward passes to
        add up to the first, its backward passes to the second; the update stays."""
        forward, backward = list(self.forward), list(self.backward)
        for start, end, (run_forward, run_backward) in zip(bounds, bounds[1:], passes):
            for times, seconds in ((forward, run_forward), (backward, run_backward)):
                if timed := sum(times[start:end]):
                    times[start:end] = [t * seconds / timed for t in times[start:end]]
        return PassTimes(forward, backward, self.update)

    def cost(self, micro_batches: int) -> list[float]:
        """Per block: a forward and a backward pass, and a ``micro_batches``-th of the update (one per step)."""
        return [f + b + u / micro_batches for f, b, u in zip(self.forward, self.backward, self.update)]


def precision_plugin(precision: str, device: torch.device) -> Precision:
    """Lightning's precision plugin for ``--trainer.precision`` on ``device``: 16-bit mixed precision is
    bf16 on the CPU, as Lightning makes it there."""
    name = {"16": "16-mixed", "bf16": "bf16-mixed"}.get(precision, precision)
    if name in ("32", "32-true"):
        return Precision()
    mixed = "bf16-mixed" if device.type == "cpu" else name
    return MixedPrecision(mixed, device.type)  # type: ignore[arg-type]  # a name plan's options checked


@contextmanager
def _threads(count: int | None):
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class BlockProfile:
    """Each block's times on ``device`` under ``precision``, its update an SGD step with the options ``sgd`` (the
    recipe's: ``block_timing.sgd_options``), measured when first asked for and kept."""

    def __init__(self, blocks: LazyBlocks, precision: Precision, device: torch.device, sgd: Mapping[str, Any]) -> None:
        self.blocks, self.precision, self.device, self.sgd = blocks, precision, device, sgd
        self._times: dict[tuple[int, int | None], PassTimes | str] = {}
        self._splits: dict[int | None, float] = {}
        self._updates: dict[int | None, float] = {}  # the whole network's update, per thread count
        self._copies: dict[tuple[int, int | None], int] = {}  # the most processes a size was asked for with
        # a size's copies at once, and the seconds of its whole pass alone, then of its copies: their mean, the slowest
        self._together: dict[tuple[int, int | None], tuple[int, float, float, float]] = {}

    def split_backward(self, processes: int = 1) -> float:
        """How many times longer the whole network's backward pass takes in one of ``processes`` processes when
        split into its input gradients and then its weight gradients, as the zero-bubble schedules run it, than
        whole: timed once per thread count, at the smallest input the blocks were timed at (the ratio barely
        moves with the size: docs/plan.md, "What a forecast is built from"), the fastest of ``REPEATS`` after one
        untimed. 1 where the whole network does not fit on the device."""
        threads = self._key(1, processes)[1]
        if threads not in self._splits:
            timed = [
                size for (size, count), got in self._times.items() if count == threads and isinstance(got, PassTimes)
            ]
            self._splits[threads] = self._split_ratio(min(timed, default=1), threads)
        return self._splits[threads]

    def _whole_network(self) -> nn.Sequential:
        with self.blocks.building():
            net = nn.Sequential(*(self.blocks.build(index) for index in range(len(self.blocks))))
        return net.to(self.device).train()

    def _split_ratio(self, images: int, threads: int | None) -> float:
        try:
            net = self._whole_network()
            weights = [param for param in net.parameters() if param.requires_grad]
            whole, split = [], []
            with _threads(threads), self.precision.train_step_context():
                x = self.precision.convert_input(torch.zeros(images, *IMAGE_SHAPE)).to(self.device).requires_grad_()
                for _ in range(REPEATS + 1):
                    ((_, backward),) = self._pass_seconds(net, x, (0, len(net)))
                    whole.append(backward)
                    out = self._forward(net, x)
                    grads = [torch.ones_like(out)]  # made before the clock starts, as for the whole pass
                    split.append(self._seconds(lambda: split_backward([out], grads, [x], weights)()))
        except RuntimeError:  # out of memory: the network fits only split
            return 1.0
        finally:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        return min(split[1:]) / min(whole[1:])

    def _seconds(self, work) -> float:
        """Seconds of ``work()`` on the device, its queued work included."""
        synchronize(self.device)
        start = time.perf_counter()
        work()
        synchronize(self.device)
        return time.perf_counter() - start

    def times(self, images: int, processes: int = 1) -> PassTimes | str:
        """The blocks' times for an input of ``images`` images in one of ``processes`` processes (on the CPU, with
        its share of the cores), or why a micro-batch of that size cannot train."""
        key = self._key(images, processes)
        self.measure_together([(images, processes)])
        found = self._times[key]
        return found if isinstance(found, str) else found.scaled(images / key[0])

    def passes(self) -> dict[str, float]:
        """Seconds of the network's forward and backward pass at every size timed (the whole network's, where it was
        timed whole): the level of the forecasts, as ``plan.json`` records it."""
        return {
            _label(key): sum(times.forward + times.backward)
            for key, times in self._times.items()
            if isinstance(times, PassTimes)
        }

    def updates(self) -> dict[str, float]:
        """Seconds of the whole network's update at every thread count timed, as ``plan.json`` records it."""
        return {_on_threads(threads) or "on the device": seconds for threads, seconds in self._updates.items()}

    def splits(self) -> dict[str, float]:
        """``split_backward``'s factor at every thread count it was timed at, as ``plan.json`` records it."""
        return {_on_threads(threads) or "on the device": ratio for threads, ratio in self._splits.items()}

    def contention(self, processes: int) -> tuple[float, float]:
        """How much slower the whole network's pass went with ``processes`` copies at once than alone, in the same
        rounds (their mean against the passes alone, over every size timed so), and how much slower the slowest copy
        than that mean: what ``Links.slowdown`` scales the passes by. (1, 1) where no size was timed so (on GPUs,
        or where the copies did not fit)."""
        timed = [figures for copies, *figures in self._together.values() if copies == processes]
        if not timed:
            return 1.0, 1.0
        alone, mean, slowest = (sum(column) for column in zip(*timed))
        return max(1.0, mean / alone), max(1.0, slowest / mean)

    def measure_together(self, requests: Iterable[tuple[int, int]]) -> None:
        """Time the blocks for every (images, processes) of ``requests`` not timed yet, all in one pass over the
        blocks (``block_pass_times_together``): a slow moment of the machine then falls on every size alike,
        and the forecasts that compare them stay fair. Sizes that failed together (out of memory, say) are
        timed alone, each then keeping why it failed."""
        keys: dict[tuple[int, int | None], None] = {}
        for images, processes in requests:
            key = self._key(images, processes)
            if key[1] is not None:  # on the CPU: its copies at once, as many as its layouts' processes, the most
                self._copies[key] = max(self._copies.get(key, 1), processes)
            if key in self._times or key in keys:
                continue
            if why := micro_batch_refusal(self.blocks, IMAGE_SHAPE, key[0]):
                self._times[key] = f"micro-batches of {key[0]} image(s) do not train: {why}"
            else:
                keys[key] = None
        if keys:
            self._time(list(keys))

    def _time(self, keys: list[tuple[int, int | None]]) -> None:
        sizes = ", ".join(_label(key) for key in keys)
        print(f"timing the blocks for {sizes}{', together' if len(keys) > 1 else ''}", flush=True)
        try:
            with self.precision.train_step_context():
                examples = [self.precision.convert_input(torch.zeros(images, *IMAGE_SHAPE)) for images, _ in keys]
                timed = block_pass_times_together(
                    self.blocks, examples, [threads for _, threads in keys], self.device, self.sgd, BLOCK_REPEATS
                )
                wholes, together, updates = self._whole_passes(
                    examples, [threads for _, threads in keys], [self._copies.get(key, 1) for key in keys]
                )
        except RuntimeError as error:  # out of memory, say
            if len(keys) > 1:
                for key in keys:
                    self._time([key])
            else:
                self._times[keys[0]] = f"timing its blocks failed: {str(error).splitlines()[0]}"
            return
        finally:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self._updates.update(updates)
        for key, passes, whole in zip(keys, timed, wholes):
            times = PassTimes(*(list(column) for column in zip(*passes)))
            if key[1] in self._updates:
                times = times.with_update(self._updates[key[1]])
            self._times[key] = times.scaled_to(self._bounds(), whole) if whole else times
        for index, (mean, slowest) in together.items():
            whole = wholes[index]
            assert whole is not None  # timed together only where the whole network fits
            alone = sum(forward + backward for forward, backward in whole)
            self._together[keys[index]] = (self._copies[keys[index]], alone, mean, slowest)

    def _whole_passes(
        self, examples: list[torch.Tensor], threads: list[int | None], copies: list[int]
    ) -> tuple[list[list[tuple[float, float]] | None], dict[int, tuple[float, float]], dict[int | None, float]]:
        """Seconds of the whole network's forward pass and of its backward pass on each of ``examples`` with its
        threads (each backward pass writing its gradients anew), each of its ``SEGMENTS`` runs of blocks apart
        (``_pass_seconds``): the means of ``REPEATS`` rounds, each round one pass of every size in turn, after one
        untimed pass on the largest alone (the blocks have just run every size: only the largest's memory is new, and
        an untimed pass per size would lengthen the plan: docs/measurements.md, "Profile"). These passes set the level
        of every forecast, so a slow moment falls on every size alike, and the mean, not the fastest, stands for the
        steps a run takes (a slow CPU's passes in a row vary widely: docs/plan.md, "Running it"). None for each where
        the whole network does not fit on the device (out of memory), whose blocks then stay as timed. Where ``copies``
        is above 1 each round also times that many copies of the network at once right after the pass alone, the
        largest such size first untimed: by index, the copies' mean and slowest, over the rounds. Last, the seconds of
        the whole network's update at each thread count not timed yet (``_update_seconds``)."""
        try:
            nets = [self._whole_network()]
            nets += [copy.deepcopy(nets[0]) for _ in range(max(copies, default=1) - 1)]
        except RuntimeError:
            return [None] * len(examples), {}, {}
        inputs = [example.to(self.device) for example in examples]

        def seconds(index: int) -> list[tuple[float, float]] | None:
            try:
                with _threads(threads[index]):
                    return self._pass_seconds(nets[0], inputs[index], self._bounds())
            except RuntimeError:
                return None

        def at_once(index: int) -> list[float] | None:
            with _threads(threads[index]):
                return self._at_once(nets[: copies[index]], inputs[index])

        largest = lambda indices: max(indices, key=lambda index: len(inputs[index]))  # noqa: E731
        seconds(largest(range(len(inputs))))
        shared = [index for index in range(len(inputs)) if copies[index] > 1]
        if shared:
            at_once(largest(shared))
        rounds: list[list[list[tuple[float, float]] | None]] = []
        together: dict[int, list[list[float] | None]] = {index: [] for index in shared}
        for _ in range(REPEATS):
            rounds.append([])
            for index in range(len(inputs)):
                rounds[-1].append(seconds(index))
                if index in together:
                    together[index].append(at_once(index))
        mean = statistics.mean
        wholes = [
            None if None in passes else [tuple(map(mean, zip(*run))) for run in zip(*passes, strict=True)]
            for passes in zip(*rounds)
        ]
        figures: dict[int, tuple[float, float]] = {}
        for index, timed in together.items():
            finished = [each for each in timed if each is not None]
            if wholes[index] is not None and len(finished) == len(timed):
                figures[index] = (mean(mean(each) for each in finished), mean(max(each) for each in finished))
        updates = {}
        for count in dict.fromkeys(threads):  # each thread count once in a profile
            if count not in self._updates and (update := self._update_seconds(nets[0], count)) is not None:
                updates[count] = update
        return wholes, figures, updates

    def _update_seconds(self, net: nn.Module, threads: int | None) -> float | None:
        """Seconds of one update of all of ``net``'s parameters (the recipe's SGD, ``self.sgd``) with ``threads``
        threads: the mean of ``REPEATS`` after one untimed (which makes the momentum buffers); None where it does
        not fit on the device (out of memory). A layout's process updates its parameters in one optimizer step, not
        one per block: the smoke plan's blocks' updates, each timed alone, added up to more than one step over the
        whole network (docs/plan.md, "What a forecast is built from")."""
        params = [param for param in net.parameters() if param.requires_grad]
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        try:
            update = timed_update(params, self.sgd)
            with _threads(threads):
                seconds = [self._seconds(update.step) for _ in range(REPEATS + 1)]
        except RuntimeError:
            return None
        return statistics.mean(seconds[1:])

    def _at_once(self, nets: list[nn.Sequential], x: torch.Tensor) -> list[float] | None:
        """Seconds of each of ``nets``' whole passes on ``x``, timed as ``_pass_seconds`` times a pass alone, all
        started at once, one per Python thread (torch lets go of the interpreter in its operators, so they compute
        side by side as processes would, each with the calling thread's thread count); None where one failed (out of
        memory)."""
        times: list[float | None] = [None] * len(nets)
        count = torch.get_num_threads()

        def run(which: int) -> None:
            torch.set_num_threads(count)
            with self.precision.train_step_context():  # autocast holds per thread
                try:
                    runs = self._pass_seconds(nets[which], x, self._bounds())
                    times[which] = sum(forward + backward for forward, backward in runs)
                except RuntimeError:
                    return

        workers = [threading.Thread(target=run, args=(which,)) for which in range(len(nets))]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        finished = [seconds for seconds in times if seconds is not None]
        return finished if len(finished) == len(times) else None

    @staticmethod
    def _forward(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The forward pass of ``net`` (the whole network, or a run of its blocks), its gradients cleared first: each
        backward pass writes them anew (adding to them costs more)."""
        for param in net.parameters():
            param.grad = None
        return net(x)

    def _pass_seconds(self, net: nn.Sequential, x: torch.Tensor, bounds: Sequence[int]) -> list[tuple[float, float]]:
        """Seconds of the forward pass on ``x`` of each run of ``net``'s blocks between consecutive ``bounds``, and of
        its backward pass: the runs' inputs cut from the autograd graph before them, as a pipeline's stages run
        them, each backward pass from the gradient of the next run's input."""
        inputs: list[Any] = []  # a block's input or output: a tensor or a collection of them
        outputs: list[Any] = []
        forwards: list[float] = []
        for start, end in zip(bounds, bounds[1:]):
            run = x if start == 0 else cut_from_graph(outputs[-1])
            inputs.append(run)
            blocks = net[start:end]
            forwards.append(self._seconds(lambda run=run, blocks=blocks: outputs.append(self._forward(blocks, run))))
        backwards = []
        for index in reversed(range(len(outputs))):
            if index == len(outputs) - 1:
                pairs = [(outputs[index], torch.ones_like(outputs[index]))]  # made before the clock starts
            else:
                pairs = [
                    (out, cut.grad)
                    for out, cut in zip(_tensors(outputs[index]), _tensors(inputs[index + 1]))
                    if out.requires_grad and cut.grad is not None
                ]
            backwards.append(self._seconds(partial(_backward, pairs)))
        return list(zip(forwards, reversed(backwards)))

    def _bounds(self) -> list[int]:
        """Where the whole network's ``SEGMENTS`` runs of blocks begin, and its end."""
        count = len(self.blocks)
        return sorted({round(index * count / SEGMENTS) for index in range(SEGMENTS + 1)})

    def _key(self, images: int, processes: int) -> tuple[int, int | None]:
        """The size the blocks are timed at for ``images`` images in one of ``processes`` processes, and its
        threads (on the CPU: each process's share of the cores; a batch above ``CPU_IMAGES`` is scaled)."""
        if self.device.type != "cpu":
            return images, None
        return min(images, CPU_IMAGES), threads_per_process(processes)


def _tensors(value) -> list[torch.Tensor]:
    """The tensors a block passes on, in order: one, or a collection (the halves of a bottleneck pass two)."""
    found: list[torch.Tensor] = []
    apply_to_collection(value, torch.Tensor, found.append)
    return found


def _backward(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The backward pass from each output with its gradient; none where nothing before needs gradients."""
    if pairs:
        outputs, grads = zip(*pairs)
        torch.autograd.backward(outputs, grads)


def _label(key: tuple[int, int | None]) -> str:
    images, threads = key
    return f"{images} images" + (f" {_on_threads(threads)}" if threads else "")


def _on_threads(threads: int | None) -> str:
    """``on N thread(s)`` on the CPU, empty on a GPU (no thread count)."""
    return f"on {threads} thread(s)" if threads else ""
