"""The training sampler: a per-epoch shuffle that a resumed run continues from where it stopped."""

from collections.abc import Iterator

from torch.utils.data import Dataset, DistributedSampler
from typing_extensions import override

__all__ = ["ResumableSampler"]


class ResumableSampler(DistributedSampler):
    """``DistributedSampler``'s shuffle (seed + epoch, one shard per replica), resumable mid-epoch.

    It yields ``(index, sample_seed)``: the dataset seeds the random augmentation of each
    sample with ``sample_seed``, a function of (seed, epoch, index) alone, so a sample
    is augmented the same way whenever and wherever it is loaded (any worker, before
    or after a restart). ``resume_at(epoch, batches)`` makes the next pass over that
    epoch skip the batches a checkpoint already trained on.

    Being a ``DistributedSampler``, Lightning keeps it instead of putting its own in.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, batch_size: int, seed: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.batch_size = batch_size
        self._resume: tuple[int, int] | None = None

    def resume_at(self, epoch: int, batches: int) -> None:
        """Make the next pass the one over ``epoch``, after its first ``batches`` batches.

        The epoch is set here, not only by Lightning's ``set_epoch``: Lightning creates the
        resumed epoch's loader iterator before it sets the epoch, and a loader with workers
        draws its first indices from the sampler at that moment.
        """
        self.set_epoch(epoch)
        self._resume = (epoch, batches)

    def sample_seed(self, index: int) -> int:
        return ((self.seed * 1_000_003 + self.epoch) * 1_000_003 + index) % 2**63

    @override
    def __iter__(self) -> Iterator[tuple[int, int]]:  # type: ignore[override]
        skip = 0
        if self._resume is not None and self._resume[0] == self.epoch:
            skip = self._resume[1] * self.batch_size
        self._resume = None
        indices = list(super().__iter__())
        return iter([(index, self.sample_seed(index)) for index in indices[skip:]])
