"""What a data module reads its images from: a *source* (CIFAR's files, an image folder, synthetic images).

A source says which classes there are and how its images are normalised, checks (or downloads) its files before
anything is built, and makes the training, validation and test splits. The data module (``datamodule``) picks one
from ``--data.*`` and keeps what every source shares: loaders and their workers, sharding over the replicas, the
on-device path and the resumable training order.
"""

from collections.abc import Sized
from typing import Protocol, cast

import torch
from torch.utils.data import Dataset

__all__ = ["ImageSource", "Stats", "images_in"]

Stats = tuple[tuple[float, ...], tuple[float, ...]]  # per-channel mean and standard deviation, in [0, 1]


class ImageSource(Protocol):
    """Where a data module's images come from."""

    @property
    def classes(self) -> list[str] | None:
        """The class names by label, where known before ``splits`` (CIFAR-100's are read from its files)."""

    num_classes: int

    @property
    def stats(self) -> Stats | None:
        """How the images are normalised; ``None`` until measured (an image folder's, unless given)."""

    def prepare(self) -> None:
        """Check (and download where allowed) the files, before anything is built: once per machine."""

    def measured_stats(self) -> Stats:
        """``stats``, measured first where unknown."""

    def splits(self, device: torch.device | None) -> dict[str, Dataset]:
        """The ``train``, ``val`` and ``test`` datasets; with ``device`` (``--data.on_device``), each an
        ``ImageTensorDataset`` of uint8 images that fits on it, for the data module to move there."""


def images_in(dataset: Dataset) -> int:
    """The samples of ``dataset``: torch's ``Dataset`` declares no ``__len__`` (a dataset may have none), every
    source's has one."""
    return len(cast(Sized, dataset))
