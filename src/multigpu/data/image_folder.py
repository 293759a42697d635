"""A folder of the user's labelled images in ImageNet's layout (``--data.dataset=imagefolder``).

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
from PIL import Image, UnidentifiedImageError
from torch import Tensor
from torch.utils.data import Dataset
from torchvision.transforms import v2

from multigpu.data.cifar10 import ImageTensorDataset
from multigpu.errors import UsageError

__all__ = ["IMAGE_SUFFIXES", "ImageFolderSplit", "folder_classes", "folder_stats", "read_image", "verified"]

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
