"""What ``predict`` reads: the test split, or a folder of the user's own images, each sample with its index.

``ImageFiles`` takes every PNG and JPEG file under a folder (in sorted order), of any size:
each is resized (its shorter side to the run's image size, 32 for CIFAR, then cropped to the centre square) and
normalised as the network's training images were. A file that cannot be read as an image is
left out with one warning line; a missing or empty folder stops the run before anything is built.
"""

import sys
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_only
from PIL import Image, UnidentifiedImageError
from torch import Tensor
from torch.utils.data import Dataset
from torchvision.transforms import v2

from multigpu.data.cifar import CIFAR10_MEAN, CIFAR10_STD
from multigpu.data.source import images_in
from multigpu.data.transforms import eval_transform
from multigpu.errors import UsageError

__all__ = ["IMAGE_SUFFIXES", "ImageFiles", "Indexed"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


@rank_zero_only
def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


class ImageFiles(Dataset):
    """The PNG and JPEG images under ``folder`` as ``(image, -1)``: no label (see the module's docstring)."""

    def __init__(
        self,
        folder: str | Path,
        image_size: int = 32,
        stats: tuple[tuple[float, ...], tuple[float, ...]] | None = (CIFAR10_MEAN, CIFAR10_STD),
    ) -> None:
        root = Path(folder)
        if not root.is_dir():
            raise UsageError(
                f"--data.predict_dir={folder} is not a folder: give the folder that holds your PNG or JPEG images."
            )
        self.paths = []
        for path in sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()):
            try:
                with Image.open(path) as image:
                    image.verify()
                self.paths.append(path)
            except (OSError, UnidentifiedImageError, SyntaxError) as error:
                _warn(f"{path} cannot be read as an image ({error}); it is left out.")
        if not self.paths:
            raise UsageError(
                f"--data.predict_dir={folder} holds no readable PNG or JPEG image: put some there, or point it at "
                "another folder."
            )
        # An image folder's own mean and std are those its checkpoint's run measured (``normalized_as``).
        self.resize = v2.Compose([v2.Resize(image_size), v2.CenterCrop(image_size)])
        self.transform = v2.Compose([self.resize, eval_transform(*stats)]) if stats else None

    def normalized_as(self, stats: tuple[tuple[float, ...], tuple[float, ...]]) -> None:
        """Normalise with ``stats`` (the training data's mean and std)."""
        self.transform = v2.Compose([self.resize, eval_transform(*stats)])

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        with Image.open(self.paths[index]) as image:
            pixels = v2.functional.pil_to_tensor(image.convert("RGB"))
        assert self.transform is not None, "normalized_as gives the training data's stats first"
        return self.transform(pixels), -1


class Indexed(Dataset):
    """``dataset``'s samples with their index appended: ``(image, label, index)``."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return images_in(self.dataset)

    def __getitem__(self, index: int) -> tuple:
        return (*self.dataset[index], index)
