"""CIFAR-10 as in-memory tensors, and a synthetic stand-in of the same shape.

The official files are read once, in torchvision's layout, into one uint8 tensor
(N, 3, 32, 32); augmentation runs per sample on that tensor with
``torchvision.transforms.v2``, which avoids a round trip through PIL.
"""

import os
import pickle
from pathlib import Path
from urllib.error import URLError

import torch
from torch import Tensor
from torch.utils.data import Dataset
from torchvision.datasets import CIFAR10
from torchvision.datasets.utils import check_integrity
from torchvision.transforms import v2

from multigpu.errors import UsageError

__all__ = [
    "CIFAR10_CLASSES",
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "ImageTensorDataset",
    "SyntheticCIFAR10",
    "cifar10_root",
    "ensure_cifar10",
    "eval_transform",
    "load_cifar10_split",
    "synthetic_images",
    "train_transform",
]

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
_FILES = CIFAR10.train_list + CIFAR10.test_list + [[CIFAR10.meta["filename"], CIFAR10.meta["md5"]]]


def _normalize() -> list[v2.Transform]:
    return [v2.ToDtype(torch.float32, scale=True), v2.Normalize(CIFAR10_MEAN, CIFAR10_STD)]


def train_transform() -> v2.Compose:
    """Random crop 32 with padding 4, horizontal flip, then normalisation."""
    return v2.Compose([v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip(), *_normalize()])


def eval_transform() -> v2.Compose:
    return v2.Compose(_normalize())


class ImageTensorDataset(Dataset):
    """Samples ``(transform(images[i]), labels[i])`` from uint8 images of shape (N, 3, H, W)."""

    def __init__(self, images: Tensor, labels: Tensor, transform: v2.Transform) -> None:
        self.images, self.labels, self.transform = images, labels, transform

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
    return ImageTensorDataset(images, labels, train_transform())


def cifar10_root(data_dir: str | os.PathLike) -> Path:
    """The folder that holds ``cifar-10-batches-py/``: ``data_dir``, or its parent where ``data_dir`` is that inner
    folder itself (it holds ``batches.meta`` or bears its name)."""
    folder = Path(os.fspath(data_dir))
    inner = folder.name == CIFAR10.base_folder or (folder / CIFAR10.meta["filename"]).is_file()
    return folder.parent if inner else folder


def _missing_files(root: Path) -> list[str]:
    folder = root / CIFAR10.base_folder
    return [name for name, _ in _FILES if not (folder / name).is_file()]


def _corrupt_files(root: Path) -> list[str]:
    folder = root / CIFAR10.base_folder
    return [name for name, md5 in _FILES if not check_integrity(str(folder / name), md5)]


def ensure_cifar10(data_dir: str, download: bool, verify_checksums: bool) -> None:
    """Make sure the python version of CIFAR-10 is under ``data_dir``, or stop with a clear message.

    Downloads it with torchvision when it is missing and ``download`` is set; a download that fails takes back
    what it wrote (the folders it made, a partial archive).
    """
    root = cifar10_root(data_dir)
    missing = _missing_files(root)
    if missing and download:
        made = [folder for folder in (root, *root.parents) if not folder.exists()]
        archive = root / CIFAR10.filename
        had_archive = archive.exists()
        try:
            CIFAR10(str(root), train=True, download=True)
            return  # torchvision has just verified the checksums of what it downloaded
        except (URLError, OSError) as error:
            reason = f"the download failed ({error})"
            if not had_archive:
                archive.unlink(missing_ok=True)
            for folder in made:  # innermost first; each only if the download left it empty
                if folder.is_dir() and not any(folder.iterdir()):
                    folder.rmdir()
    elif missing:
        reason = "data.download is false"
    if missing:
        raise UsageError(
            f"CIFAR-10 is not in {root.resolve()} ({missing[0]} is missing) and {reason}. "
            f"Either connect to the network and run with --data.download=true, or put the python "
            f"version of CIFAR-10 (the folder {CIFAR10.base_folder}/) there or point --data.data_dir at "
            f"the folder that holds it (add --data.verify_checksums=false for a partial copy)."
        )
    if verify_checksums and (corrupt := _corrupt_files(root)):
        raise UsageError(
            f"CIFAR-10 files in {root.resolve() / CIFAR10.base_folder} fail their checksum ({', '.join(corrupt)}). "
            f"Delete the folder and let --data.download=true fetch it again, or, for your own "
            f"copy or a subset, run with --data.verify_checksums=false."
        )


def load_cifar10_split(data_dir: str, train: bool) -> tuple[Tensor, Tensor]:
    """The official training or test split as uint8 images (N, 3, 32, 32) and int64 labels.

    The batches are read as torchvision's ``CIFAR10`` reads them, without its md5 check: ``ensure_cifar10``
    has checked the files once, before the model was built, and a subset is read without one.
    """
    folder = cifar10_root(data_dir) / CIFAR10.base_folder
    images, labels = [], []
    for name, _ in CIFAR10.train_list if train else CIFAR10.test_list:
        with open(folder / name, "rb") as file:
            batch = pickle.load(file, encoding="latin1")
        images.append(torch.from_numpy(batch["data"]).view(-1, 3, 32, 32))  # rows of 3 x 32 x 32, channel first
        labels.extend(batch["labels"])
    return torch.cat(images), torch.tensor(labels, dtype=torch.int64)
