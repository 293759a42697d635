"""A folder of the user's labelled images in ImageNet's layout (``--data.dataset=imagefolder``): the source
``ImageFolderSource``.

    DATA_DIR/train/<class>/*.png|jpg|jpeg
    DATA_DIR/val/<class>/*.png|jpg|jpeg

The classes are ``train/``'s subfolders, in sorted order (as torchvision's ``ImageFolder`` numbers them); ``val/``
may lack a class, never add one. Every image, of any size, is resized (its shorter side to ``image_size``) and
cropped to the centre square, then augmented for training as CIFAR is (a random crop with padding of an eighth,
a horizontal flip) and normalised with the folder's own mean and std (measured on up to 512 training images) or
the ones given. Each sample is read from its file in the loader's workers, and accepts the ``(index, seed)`` keys of
``ResumableSampler``, so sharding, workers, exact resume and resume on another layout hold as for CIFAR.
"""

from pathlib import Path

import torch
from lightning.pytorch.utilities import rank_zero_info
from PIL import Image, UnidentifiedImageError
from torch import Tensor
from torch.utils.data import Dataset
from torchvision.transforms import v2

from multigpu.data.on_device import free_memory
from multigpu.data.source import Stats
from multigpu.data.transforms import ImageTensorDataset, eval_transform, train_transform
from multigpu.errors import UsageError

__all__ = [
    "IMAGE_SUFFIXES",
    "ImageFolderSource",
    "ImageFolderSplit",
    "folder_classes",
    "folder_stats",
    "read_image",
    "verified",
]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
SPLITS = ("train", "val")


def read_image(path: Path) -> Tensor:
    """The image at ``path`` as uint8 RGB (3, H, W)."""
    with Image.open(path) as image:
        return v2.functional.pil_to_tensor(image.convert("RGB"))


def _images(folder: Path) -> list[Path]:
    return sorted(path for path in folder.rglob("*") if path.suffix.lower() in IMAGE_SUFFIXES and path.is_file())


def folder_classes(data_dir: str) -> list[str]:
    """The classes of the folder: ``train/``'s subfolders; a folder without that layout, a class without images, or
    a class in ``val/`` that ``train/`` lacks is refused in one line."""
    root = Path(data_dir)
    train = root / "train"
    classes = sorted(path.name for path in train.iterdir() if path.is_dir()) if train.is_dir() else []
    if not classes:
        raise UsageError(
            f"--data.data_dir={data_dir} has no train/<class>/ folders: --data.dataset=imagefolder reads "
            "train/<class>/*.png|jpg and val/<class>/*.png|jpg (ImageNet's layout)."
        )
    if not (root / "val").is_dir():
        raise UsageError(f"--data.data_dir={data_dir} has no val/ folder: put val/<class>/ images beside train/.")
    extra = sorted({path.name for path in (root / "val").iterdir() if path.is_dir()} - set(classes))
    if extra:
        raise UsageError(
            f"{root / 'val' / extra[0]} is a class that {train} lacks: every class of val/ needs its training images."
        )
    empty = [name for name in classes if not _images(train / name)]
    if empty:
        raise UsageError(f"{train / empty[0]} holds no PNG or JPEG image: add some, or remove the class.")
    if not _images(root / "val"):
        raise UsageError(f"{root / 'val'} holds no PNG or JPEG image: put val/<class>/ images there.")
    return classes


def verified(data_dir: str, classes: list[str]) -> None:
    """Open every image of both splits once; the first that cannot be read is named in one line."""
    for split in SPLITS:
        for path in _images(Path(data_dir) / split):
            try:
                with Image.open(path) as image:
                    image.verify()
            except (OSError, UnidentifiedImageError, SyntaxError) as error:
                raise UsageError(f"{path} cannot be read as an image ({error}): repair or remove it.") from None


class ImageFolderSplit(Dataset):
    """The images of one split (``train`` or ``val``) as ``(transform(image), class index)``.

    Args:
        data_dir: the folder of ``train/`` and ``val/``.
        split: ``train`` or ``val``.
        classes: the class names, in label order (``folder_classes``).
        image_size: the side of the square each image is resized and cropped to.
        transform: what follows the resizing (augmentation, normalisation).
    """

    def __init__(self, data_dir: str, split: str, classes: list[str], image_size: int, transform: v2.Transform):
        folder = Path(data_dir) / split
        self.samples = [(path, label) for label, name in enumerate(classes) for path in _images(folder / name)]
        self.resize = v2.Compose([v2.Resize(image_size), v2.CenterCrop(image_size)])
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def resized(self, index: int) -> Tensor:
        """Image ``index``, resized and cropped, uint8."""
        return self.resize(read_image(self.samples[index][0]))

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[Tensor, int]:
        """Sample ``key``, or ``(index, seed)``: its random augmentation then depends on ``seed`` alone."""
        index, seed = key if isinstance(key, tuple) else (key, None)
        image, label = self.resized(index), self.samples[index][1]
        if seed is None:
            return self.transform(image), label
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.transform(image), label

    def in_memory(self) -> ImageTensorDataset:
        """Every image decoded and resized into one uint8 tensor (N, 3, S, S), for ``data.on_device``."""
        images = torch.stack([self.resized(index) for index in range(len(self))])
        labels = torch.tensor([label for _, label in self.samples], dtype=torch.int64)
        return ImageTensorDataset(images, labels, self.transform)


def folder_stats(split: ImageFolderSplit, images: int = 512) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std, in [0, 1], of up to ``images`` resized training images spread over the split."""
    step = max(1, len(split) // images)
    pixels = torch.stack([split.resized(index) for index in range(0, len(split), step)[:images]]).float() / 255
    return tuple(pixels.mean((0, 2, 3)).tolist()), tuple(pixels.std((0, 2, 3)).tolist())


class ImageFolderSource:
    """The images under ``data_dir/train/`` and ``data_dir/val/``, validated and tested on ``val/``, at
    ``image_size``, normalised with ``stats`` (measured on the training images when ``None``)."""

    def __init__(self, data_dir: str, image_size: int, stats: Stats | None) -> None:
        self.data_dir, self.image_size, self.stats = data_dir, image_size, stats
        self.classes = folder_classes(data_dir)
        self.num_classes = len(self.classes)

    def prepare(self) -> None:
        verified(self.data_dir, self.classes)

    def _split(self, split: str, transform: v2.Transform) -> ImageFolderSplit:
        return ImageFolderSplit(self.data_dir, split, self.classes, self.image_size, transform)

    def measured_stats(self) -> Stats:
        if self.stats is None:
            self.stats = folder_stats(self._split("train", v2.Identity()))
        return self.stats

    def splits(self, device: torch.device | None) -> dict[str, Dataset]:
        given = "as given (--data.mean and --data.std, or the run's checkpoint)" if self.stats else "measured"
        stats = self.measured_stats()
        train = self._split("train", train_transform(*stats, size=self.image_size))
        val = self._split("val", eval_transform(*stats))
        classes = ", ".join(self.classes[:5]) + (", ..." if len(self.classes) > 5 else "")
        mean, std = (", ".join(f"{value:.3f}" for value in values) for values in stats)
        size = f"{self.image_size}x{self.image_size}"
        rank_zero_info(
            f"image folder {self.data_dir}: {len(self.classes)} classes ({classes}), {len(train)} training and "
            f"{len(val)} validation images at {size}, normalised with mean ({mean}) and std ({std}), {given}."
        )
        if device is None:
            return {"train": train, "val": val, "test": val}
        needed = (len(train) + len(val)) * 3 * self.image_size**2
        if needed > free_memory(device):
            raise UsageError(
                f"data.on_device=true: the image folder's {len(train) + len(val)} images take {needed / 2**30:.1f} "
                f"GiB at {size}, more than {device} has free: drop --data.on_device, or lower --data.image_size."
            )
        train_images, val_images = train.in_memory(), val.in_memory()
        return {"train": train_images, "val": val_images, "test": val_images}
