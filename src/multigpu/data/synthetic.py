"""Synthetic images of CIFAR's shape (``--data.synthetic``): the source ``SyntheticImages``, which reads no disk."""

import torch
from torch import Tensor
from torch.utils.data import Dataset

from multigpu.data.cifar import CIFAR10_MEAN, CIFAR10_STD
from multigpu.data.source import Stats
from multigpu.data.transforms import ImageTensorDataset, train_transform

__all__ = ["SyntheticCIFAR10", "SyntheticImages", "synthetic_images"]


class SyntheticCIFAR10(Dataset):
    """``length`` random normalised 3x32x32 images with random labels, made per index.

    Sample ``i`` is the same on every call, in every process, without touching the disk.
    """

    def __init__(self, length: int, num_classes: int = 10, seed: int = 0) -> None:
        self.length, self.num_classes, self.seed = length, num_classes, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[Tensor, int]:
        index = key[0] if isinstance(key, tuple) else key  # no augmentation to seed
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        label = int(torch.randint(self.num_classes, (), generator=generator))
        return torch.randn(3, 32, 32, generator=generator), label


def synthetic_images(length: int, num_classes: int = 10, seed: int = 0) -> ImageTensorDataset:
    """``length`` random uint8 3x32x32 images with random labels, the same for a given ``seed``.

    The stand-in for CIFAR-10 where images are augmented as whole batches (``data.on_device``).
    """
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(256, (length, 3, 32, 32), dtype=torch.uint8, generator=generator)
    labels = torch.randint(num_classes, (length,), generator=generator)
    return ImageTensorDataset(images, labels, train_transform(CIFAR10_MEAN, CIFAR10_STD))


class SyntheticImages:
    """``size`` training images of ``num_classes`` classes, and a quarter of it for validation and for test, each
    split from a seed of its own; on the device, uint8 images that go through the same augmentation as CIFAR's."""

    def __init__(self, size: int, num_classes: int, classes: list[str] | None, stats: Stats) -> None:
        self.size, self.num_classes, self.classes, self.stats = size, num_classes, classes, stats

    def prepare(self) -> None:
        pass  # nothing on disk

    def measured_stats(self) -> Stats:
        return self.stats

    def splits(self, device: torch.device | None) -> dict[str, Dataset]:
        make = synthetic_images if device is not None else SyntheticCIFAR10
        evaluated = max(1, self.size // 4)
        return {
            "train": make(self.size, self.num_classes, seed=0),
            "val": make(evaluated, self.num_classes, seed=1),
            "test": make(evaluated, self.num_classes, seed=2),
        }
