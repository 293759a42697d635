"""What every image source does to its images: augmentation and normalisation (``torchvision.transforms.v2``, on
uint8 tensors, without a round trip through PIL), and ``ImageTensorDataset``, images in memory as one uint8 tensor."""

import torch
from torch import Tensor
from torch.utils.data import Dataset
from torchvision.transforms import v2

__all__ = ["ImageTensorDataset", "eval_transform", "train_transform"]


def _normalize(mean: tuple[float, ...], std: tuple[float, ...]) -> list[v2.Transform]:
    return [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)]


def train_transform(mean: tuple[float, ...], std: tuple[float, ...], size: int = 32) -> v2.Compose:
    """Random crop ``size`` with padding ``size / 8`` (4 for CIFAR), horizontal flip, then normalisation."""
    return v2.Compose([v2.RandomCrop(size, padding=size // 8), v2.RandomHorizontalFlip(), *_normalize(mean, std)])


def eval_transform(mean: tuple[float, ...], std: tuple[float, ...]) -> v2.Compose:
    return v2.Compose(_normalize(mean, std))


class ImageTensorDataset(Dataset):
    """Samples ``(transform(images[i]), labels[i])`` from uint8 images of shape (N, 3, H, W)."""

    def __init__(self, images: Tensor, labels: Tensor, transform: v2.Transform) -> None:
        self.images, self.labels, self.transform = images, labels, transform

    def __getstate__(self) -> dict:
        """Pickled for a loader worker as plain arrays through its pipe, not as torch's shared memory: a worker
        started from the fork server gets its own copy, and 150 MB of CIFAR-10 never has to fit ``/dev/shm``
        (64 MB in a default Docker container)."""
        return {**self.__dict__, "images": self.images.numpy(force=True), "labels": self.labels.numpy(force=True)}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, images=torch.from_numpy(state["images"]), labels=torch.from_numpy(state["labels"]))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[Tensor, int]:
        """Sample ``key``, or ``(index, seed)``: its random augmentation then depends on ``seed`` alone."""
        index, seed = key if isinstance(key, tuple) else (key, None)
        image, label = self.images[index], int(self.labels[index])
        if seed is None:
            return self.transform(image), label
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.transform(image), label
