"""CIFAR-10 and CIFAR-100 as in-memory tensors: the source ``CifarFiles``.

The official files are read once, in torchvision's layout, into one uint8 tensor
(N, 3, 32, 32); augmentation runs per sample on that tensor (``multigpu.data.transforms``).
"""

import os
import pickle
from pathlib import Path
from urllib.error import URLError

import torch
from torch import Tensor
from torch.utils.data import Dataset
from torchvision.datasets import CIFAR10, CIFAR100
from torchvision.datasets.utils import check_integrity

from multigpu.data.source import Stats
from multigpu.data.transforms import ImageTensorDataset, eval_transform, train_transform
from multigpu.errors import UsageError

__all__ = [
    "CIFAR",
    "CIFAR_CLASS_COUNTS",
    "CifarFiles",
    "CIFAR10_CLASSES",
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "CIFAR100_MEAN",
    "CIFAR100_STD",
    "cifar_classes",
    "cifar_root",
    "ensure_cifar",
    "load_cifar_split",
]

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)
CIFAR = {"cifar10": CIFAR10, "cifar100": CIFAR100}  # torchvision's classes: their file lists and folder
CIFAR_CLASS_COUNTS = {"cifar10": 10, "cifar100": 100}
_NAMES = {CIFAR10: "CIFAR-10", CIFAR100: "CIFAR-100"}
_LABELS = {CIFAR10: "labels", CIFAR100: "fine_labels"}


def _files(which: type[CIFAR10]) -> list[list[str]]:
    return which.train_list + which.test_list + [[which.meta["filename"], which.meta["md5"]]]


def cifar_root(data_dir: str | os.PathLike, which: type[CIFAR10] = CIFAR10) -> Path:
    """The folder that holds ``cifar-10-batches-py/`` (``cifar-100-python/``): ``data_dir``, or its parent where
    ``data_dir`` is that inner folder itself (it holds the ``meta`` file or bears its name)."""
    folder = Path(os.fspath(data_dir))
    inner = folder.name == which.base_folder or (folder / which.meta["filename"]).is_file()
    return folder.parent if inner else folder


def _missing_files(root: Path, which: type[CIFAR10]) -> list[str]:
    folder = root / which.base_folder
    return [name for name, _ in _files(which) if not (folder / name).is_file()]


def _corrupt_files(root: Path, which: type[CIFAR10]) -> list[str]:
    folder = root / which.base_folder
    return [name for name, md5 in _files(which) if not check_integrity(str(folder / name), md5)]


def _check_not_the_other(data_dir: str, which: type[CIFAR10]) -> None:
    """Refuse a folder that holds the other CIFAR where this one is missing: it is the wrong ``--data.dataset``."""
    other = CIFAR100 if which is CIFAR10 else CIFAR10
    holds_other = (cifar_root(data_dir, other) / other.base_folder).is_dir()
    if holds_other and _missing_files(cifar_root(data_dir, which), which):
        option = next(name for name, kind in CIFAR.items() if kind is other)
        raise UsageError(
            f"{data_dir} holds {_NAMES[other]} ({other.base_folder}/), not {_NAMES[which]}: add "
            f"--data.dataset={option}, or point --data.data_dir at {_NAMES[which]}."
        )


def ensure_cifar(data_dir: str, download: bool, verify_checksums: bool, which: type[CIFAR10] = CIFAR10) -> None:
    """Make sure the python version of CIFAR-10 (or CIFAR-100, ``which``) is under ``data_dir``, or stop with a
    clear message.

    Downloads it with torchvision when it is missing and ``download`` is set; a download that fails takes back
    what it wrote (the folders it made, a partial archive).
    """
    _check_not_the_other(data_dir, which)
    name = _NAMES[which]
    root = cifar_root(data_dir, which)
    missing = _missing_files(root, which)
    if missing and download:
        made = [folder for folder in (root, *root.parents) if not folder.exists()]
        archive = root / which.filename
        had_archive = archive.exists()
        try:
            which(str(root), train=True, download=True)
            return  # torchvision has just verified the checksums of what it downloaded
        except (URLError, OSError) as error:
            reason, fetch = f"the download failed ({error})", "run again once connected to the network"
            if not had_archive:
                archive.unlink(missing_ok=True)
            for folder in made:  # innermost first; each only if the download left it empty
                if folder.is_dir() and not any(folder.iterdir()):
                    folder.rmdir()
    elif missing:
        reason, fetch = "data.download is false", "run with --data.download=true on a machine with a network"
    if missing:
        raise UsageError(
            f"{name} is not in {root.resolve()} ({missing[0]} is missing) and {reason}. "
            f"Either {fetch}, or put the python "
            f"version of {name} (the folder {which.base_folder}/) there or point --data.data_dir at "
            f"the folder that holds it (add --data.verify_checksums=false for a partial copy)."
        )
    if verify_checksums and (corrupt := _corrupt_files(root, which)):
        raise UsageError(
            f"{name} files in {root.resolve() / which.base_folder} fail their checksum ({', '.join(corrupt)}). "
            f"Delete the folder and let --data.download=true fetch it again, or, for your own "
            f"copy or a subset, run with --data.verify_checksums=false."
        )


def load_cifar_split(data_dir: str, train: bool, which: type[CIFAR10] = CIFAR10) -> tuple[Tensor, Tensor]:
    """The official training or test split as uint8 images (N, 3, 32, 32) and int64 labels (CIFAR-100's 100
    fine labels).

    The batches are read as torchvision's ``CIFAR10`` reads them, without its md5 check: ``ensure_cifar``
    has checked the files once, before the model was built, and a subset is read without one.
    """
    folder = cifar_root(data_dir, which) / which.base_folder
    images, labels = [], []
    for name, _ in which.train_list if train else which.test_list:
        with open(folder / name, "rb") as file:
            batch = pickle.load(file, encoding="latin1")
        images.append(torch.from_numpy(batch["data"]).view(-1, 3, 32, 32))  # rows of 3 x 32 x 32, channel first
        labels.extend(batch[_LABELS[which]])
    return torch.cat(images), torch.tensor(labels, dtype=torch.int64)


def cifar_classes(data_dir: str, which: type[CIFAR10]) -> list[str]:
    """The class names the dataset's ``meta`` file lists, in label order."""
    with open(cifar_root(data_dir, which) / which.base_folder / which.meta["filename"], "rb") as file:
        return list(pickle.load(file, encoding="latin1")[which.meta["key"]])


class CifarFiles:
    """CIFAR-10's or CIFAR-100's official files in torchvision's layout (``--data.dataset``), read into memory, the
    official test split validated on, or ``val_split`` training images held out instead (the same on every run)."""

    def __init__(
        self, data_dir: str, dataset: str, download: bool, verify_checksums: bool, val_split: int, stats: Stats
    ) -> None:
        self.data_dir, self.which, self.val_split, self.stats = data_dir, CIFAR[dataset], val_split, stats
        self.download, self.verify_checksums = download, verify_checksums
        self.classes: list[str] | None = list(CIFAR10_CLASSES) if dataset == "cifar10" else None
        self.num_classes = CIFAR_CLASS_COUNTS[dataset]

    def prepare(self) -> None:
        ensure_cifar(self.data_dir, self.download, self.verify_checksums, self.which)

    def measured_stats(self) -> Stats:
        return self.stats

    def splits(self, device: torch.device | None) -> dict[str, Dataset]:
        if self.classes is None:
            self.classes = cifar_classes(self.data_dir, self.which)
        images, labels = load_cifar_split(self.data_dir, train=True, which=self.which)
        test_images, test_labels = load_cifar_split(self.data_dir, train=False, which=self.which)
        test = ImageTensorDataset(test_images, test_labels, eval_transform(*self.stats))
        if not self.val_split:
            return {
                "train": ImageTensorDataset(images, labels, train_transform(*self.stats)),
                "val": test,
                "test": test,
            }
        if self.val_split >= len(labels):
            raise UsageError(
                f"data.val_split={self.val_split} leaves no training images: {self.data_dir} has {len(labels)}."
            )
        # A fixed generator holds out the same images on every run and every rank.
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
        train_idx, val_idx = order[: -self.val_split], order[-self.val_split :]
        return {
            "train": ImageTensorDataset(images[train_idx], labels[train_idx], train_transform(*self.stats)),
            "val": ImageTensorDataset(images[val_idx], labels[val_idx], eval_transform(*self.stats)),
            "test": test,
        }
