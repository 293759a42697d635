"""A dataset resident on the training device (CIFAR, or an image folder decoded once): batches are gathered,
augmented and normalised there.

No loader workers, and one host-to-device copy per epoch (the shard's order): the uint8
images (150 MB for the whole training set) sit on the device, and each batch is one
gather, one random crop and flip of the whole batch, and one normalisation. The same
code runs on the CPU.
"""

import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DistributedSampler

from multigpu.data.cifar import CIFAR10_MEAN, CIFAR10_STD
from multigpu.data.transforms import ImageTensorDataset

__all__ = ["DeviceBatches", "cifar10_stats", "free_memory", "normalize", "random_crop_flip"]


def random_crop_flip(images: Tensor, generator: torch.Generator, padding: int = 4) -> Tensor:
    """Each image of (B, C, H, W) cropped at a random offset after zero ``padding``, and flipped
    horizontally with probability 1/2: torchvision's ``RandomCrop(H, padding)`` and
    ``RandomHorizontalFlip()``, drawn for a whole batch at once."""
    b, c, h, w = images.shape
    device = images.device
    padded = F.pad(images, (padding,) * 4)
    offsets = torch.randint(0, 2 * padding + 1, (2, b, 1), device=device, generator=generator)
    rows = offsets[0] + torch.arange(h, device=device)  # (B, H)
    cols = offsets[1] + torch.arange(w, device=device)  # (B, W)
    batch = torch.arange(b, device=device)[:, None, None, None]
    channels = torch.arange(c, device=device)[None, :, None, None]
    cropped = padded[batch, channels, rows[:, None, :, None], cols[:, None, None, :]]
    flip = torch.rand(b, device=device, generator=generator) < 0.5
    return torch.where(flip[:, None, None, None], cropped.flip(3), cropped)


def cifar10_stats(
    device: torch.device, stats: tuple[tuple[float, ...], tuple[float, ...]] = (CIFAR10_MEAN, CIFAR10_STD)
) -> tuple[Tensor, Tensor]:
    """Per-channel mean and std (CIFAR-10's by default) on ``device``, shaped (1, 3, 1, 1)."""
    mean, std = (torch.tensor(values, device=device)[None, :, None, None] for values in stats)
    return mean, std


def free_memory(device: torch.device) -> int:
    """Bytes free on ``device``: an accelerator's own count, the machine's available memory for the CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def normalize(images: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """uint8 images to float32, scaled to [0, 1] and normalised with ``mean`` and ``std`` (``cifar10_stats``)."""
    return (images.float() / 255 - mean) / std


class DeviceBatches:
    """Batches ``(images, labels)`` of a dataset held on a device, in the order of ``sampler``.

    ``sampler`` gives this rank's shard: a ``ResumableSampler`` for training, whose
    ``(index, seed)`` keys also seed each batch's augmentation (with the first sample's
    seed, so a resumed run augments a batch as the uninterrupted one did), or a
    ``DistributedSampler`` without shuffling for evaluation. Lightning sets the epoch of
    ``self.sampler`` as it does a DataLoader's, and passes the batches on unchanged.
    """

    def __init__(
        self,
        dataset: ImageTensorDataset,
        sampler: DistributedSampler,
        batch_size: int,
        augment: bool,
        stats: tuple[tuple[float, ...], tuple[float, ...]] = (CIFAR10_MEAN, CIFAR10_STD),
    ) -> None:
        self.images, self.labels = dataset.images, dataset.labels
        self.sampler, self.batch_size, self.augment = sampler, batch_size, augment
        self.batch_sampler = None  # as a DataLoader built with a sampler: Lightning inspects both
        self.drop_last = augment  # training drops the last short batch, as its DataLoader does
        self._stats = cifar10_stats(self.images.device, stats)

    def __len__(self) -> int:
        if self.drop_last:
            return len(self.sampler) // self.batch_size
        return -(-len(self.sampler) // self.batch_size)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        keys = list(self.sampler)
        end = len(keys) - len(keys) % self.batch_size if self.drop_last else len(keys)
        order = torch.tensor([key[0] if isinstance(key, tuple) else key for key in keys], device=self.images.device)
        generator = torch.Generator(device=self.images.device)
        for start in range(0, end, self.batch_size):
            index = order[start : start + self.batch_size]
            images = self.images[index]
            if self.augment:
                generator.manual_seed(keys[start][1])
                images = random_crop_flip(images, generator, padding=images.shape[-1] // 8)
            yield normalize(images, *self._stats), self.labels[index]
