"""The training sampler: one global order per epoch, cut into global batches, whatever the layout.

Every epoch is one permutation of the training set (``data.shuffle_seed`` + epoch, as
``DistributedSampler`` draws it). The epoch trains it in global batches of ``G`` images,
``G = batch_size x replicas x accumulated batches``: optimizer step ``k`` trains the
positions ``[kG, (k+1)G)`` of the permutation, and only the global batches that are whole
(``drop_last`` for the global batch: at most ``G - 1`` images of an epoch are left out).

A global batch is cut into consecutive loader batches of ``batch_size`` images;
replica ``r`` takes, for its ``a``-th accumulated batch, loader batch ``a x replicas + r``.
So which images meet in one forward pass (BatchNorm's groups) depends on the batch size
alone, not on how many processes compute the step: one device accumulating 4 batches of
4 images, ``ddp`` over 2 processes accumulating 2, and ``ddp`` over 4 train the same 4
groups of 4 in every step.

The position of a run in its epoch is then one number, the images of the permutation
already trained (a prefix of it), and a run resumed on another layout goes on from there
(``EpochOrder``): no image is trained twice in the epoch, none is skipped.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset, DistributedSampler
from typing_extensions import override

from multigpu.data.source import images_in
from multigpu.run.replicas import global_batch_size

__all__ = ["EpochOrder", "ResumableSampler", "TrainingOrder"]


@dataclass(frozen=True)
class EpochOrder:
    """How one pass over an epoch of ``samples`` images trains it in global batches of ``global_batch``,
    starting after its first ``start`` positions (a resumed epoch; 0 otherwise).

    Lightning counts an epoch in loader batches of a fixed number; a resumed epoch is counted as
    if its first ``skipped_steps`` steps were done, so that it ends where every whole epoch ends.
    """

    samples: int
    global_batch: int
    start: int = 0

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in a whole epoch."""
        return self.samples // self.global_batch

    @property
    def steps(self) -> int:
        """Optimizer steps this pass trains: the whole global batches left after ``start``."""
        return max(self.samples - self.start, 0) // self.global_batch

    @property
    def skipped_steps(self) -> int:
        """Steps a resumed epoch counts as done before it starts."""
        return self.steps_per_epoch - self.steps

    def position(self, steps_counted: int) -> int:
        """The images of the permutation trained once Lightning has counted ``steps_counted`` steps of the epoch."""
        return self.start + (steps_counted - self.skipped_steps) * self.global_batch


@dataclass(frozen=True)
class TrainingOrder:
    """The order a data module trains in, as a run's start gives it (``checkpointing.position``): its first pass goes
    over ``epoch`` after the first ``start`` images of that epoch's order, shuffled with ``shuffle_seed``.

    Attributes:
        epoch: the epoch of the first pass.
        start: the images of its order trained before (a run resumed inside an epoch; 0 otherwise).
        shuffle_seed: the seed a checkpoint's run shuffled with, over ``--data.shuffle_seed``; ``None`` for the data
            module's own.
        seed_by_default: the seed where neither gives one, in place of the run's ``seed_everything``: 0 for a
            checkpoint of an earlier version, which kept no seed.
    """

    epoch: int = 0
    start: int = 0
    shuffle_seed: int | None = None
    seed_by_default: int | None = None


class ResumableSampler(DistributedSampler):
    """This replica's loader batches of each epoch's global order (the module's docstring says which).

    It yields ``(index, sample_seed)``: the dataset seeds the random augmentation of each
    sample with ``sample_seed``, a function of (seed, epoch, index) alone, so a sample
    is augmented the same way whenever and wherever it is loaded (any worker, any layout,
    before or after a restart). ``resume_at(epoch, position)`` makes the next pass over that
    epoch start after the first ``position`` images of its order.

    Being a ``DistributedSampler``, Lightning keeps it instead of putting its own in.

    Args:
        dataset: the training set.
        num_replicas: data-parallel replicas (processes, or pipelines, that read different images).
        rank: this process's replica.
        batch_size: images per loader batch.
        accumulation: loader batches per replica and optimizer step.
        seed: the shuffle's seed.
    """

    def __init__(
        self, dataset: Dataset, num_replicas: int, rank: int, batch_size: int, accumulation: int = 1, seed: int = 0
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.batch_size, self.accumulation = batch_size, accumulation
        self.global_batch = global_batch_size(batch_size, num_replicas, accumulation)
        self._resume: tuple[int, int] | None = None  # (epoch, position)
        self.current = EpochOrder(images_in(dataset), self.global_batch)  # the order of the epoch under way

    def resume_at(self, epoch: int, position: int) -> None:
        """Make the next pass the one over ``epoch``, after its first ``position`` images.

        The epoch is set here, not only by Lightning's ``set_epoch``: Lightning creates the
        resumed epoch's loader iterator before it sets the epoch, and a loader with workers
        draws its first indices from the sampler at that moment.
        """
        self.set_epoch(epoch)
        self._resume = (epoch, position)

    def next_order(self) -> EpochOrder:
        """The order of the current epoch that ``__iter__`` trains next, from where it resumes."""
        start = self._resume[1] if self._resume is not None and self._resume[0] == self.epoch else 0
        return EpochOrder(images_in(self.dataset), self.global_batch, start)

    def sample_seed(self, index: int) -> int:
        return ((self.seed * 1_000_003 + self.epoch) * 1_000_003 + index) % 2**63

    @override
    def __len__(self) -> int:
        """The images this replica trains in a whole epoch (Lightning counts every epoch as a whole one)."""
        return (
            EpochOrder(images_in(self.dataset), self.global_batch).steps_per_epoch * self.accumulation * self.batch_size
        )

    @override
    def __iter__(self) -> Iterator[tuple[int, int]]:  # type: ignore[override]
        epoch_order = self.current = self.next_order()
        self._resume = None
        generator = torch.Generator().manual_seed(self.seed + self.epoch)  # DistributedSampler's permutation
        order = torch.randperm(images_in(self.dataset), generator=generator).tolist()
        keys = []
        for step in range(epoch_order.steps):
            for batch in range(self.accumulation):
                first = (
                    epoch_order.start
                    + step * self.global_batch
                    + (batch * self.num_replicas + self.rank) * self.batch_size
                )
                keys += [(index, self.sample_seed(index)) for index in order[first : first + self.batch_size]]
        return iter(keys)
