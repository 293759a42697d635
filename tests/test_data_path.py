"""The training images reach the network as a plain ``DataLoader(shuffle=True)`` with torchvision's transforms
would bring them, over many epochs of a real ``fit``: each image once an epoch, augmented afresh every epoch,
and batches that share no more between epochs, or between runs of other seeds, than independent shuffles do.

Every image is its own ruler: its first channel holds its index, its second its row and its third its column,
so each training image tells which image it is, where it was cropped and whether it was flipped.
"""

import importlib.util
from collections import Counter
from itertools import combinations

import numpy as np
import pytest
import torch
from helpers import REPO, write_cifar10_files
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader
from torchvision.transforms import v2

from multigpu.data.cifar import CIFAR10_MEAN, CIFAR10_STD
from multigpu.data.datamodule import ImageDataModule

IMAGES, BATCH, EPOCHS = 44, 8, 40  # 5 whole batches an epoch: 4 images left out of each, as with drop_last
CELLS = 9 * 9 * 2  # crop offsets (0..8 each way) and flip


def ruler_images(count: int) -> np.ndarray:
    images = np.zeros((count, 3, 32, 32), dtype=np.uint8)
    images[:, 0] = (np.arange(count) + 1)[:, None, None]
    images[:, 1] = (np.arange(32) + 100)[None, :, None]
    images[:, 2] = (np.arange(32) + 100)[None, None, :]
    return images


def read_rulers(batch: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """(index, top, left, flipped) of each normalised training image of ``batch``."""
    mean, std = torch.tensor(CIFAR10_MEAN).view(3, 1, 1), torch.tensor(CIFAR10_STD).view(3, 1, 1)
    pixels = torch.round((batch * std + mean) * 255).int()
    found = []
    for image in pixels:
        # Rows and columns 8 and 23 of a crop lie inside the image for every offset (padding 4).
        index, top = int(image[0, 16, 16]) - 1, int(image[1, 8, 16]) - 104
        at8, at23 = int(image[2, 16, 8]), int(image[2, 16, 23])
        found.append((index, top, min(at8, at23) - 104, int(at8 > at23)))
    return found


class Recorder(LightningModule):
    """Trains nothing; keeps what each training batch held, per epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(()))
        self.epochs: list[list[list[tuple[int, int, int, int]]]] = []

    def training_step(self, batch, batch_idx):
        if batch_idx == 0:
            self.epochs.append([])
        self.epochs[-1].append(read_rulers(batch[0]))
        return self.weight * batch[0].mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    images = ruler_images(IMAGES)
    return write_cifar10_files(tmp_path_factory.mktemp("rulers"), images, [0] * IMAGES, images[:4], [0] * 4)


def app_epochs(data, seed: int) -> list[list[list[tuple[int, int, int, int]]]]:
    """The batches of a real ``fit`` of the app's data module (official files, a persistent loader worker)."""
    seed_everything(seed)
    datamodule = ImageDataModule(
        str(data), download=False, verify_checksums=False, batch_size=BATCH, num_workers=1, persistent_workers=True
    )
    recorder = Recorder()
    trainer = Trainer(
        accelerator="cpu", devices=1, max_epochs=EPOCHS, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(recorder, datamodule=datamodule)
    return recorder.epochs


def plain_epochs(data, seed: int) -> list[list[list[tuple[int, int, int, int]]]]:
    """The batches of ``DataLoader(shuffle=True, drop_last=True)`` over torchvision's reading and transforms."""
    spec = importlib.util.spec_from_file_location("plain_cifar10", REPO / "benchmarks" / "plain_cifar10.py")
    plain = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plain)
    transform = v2.Compose(
        [v2.ToImage(), v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip(), v2.ToDtype(torch.float32, scale=True),
         v2.Normalize(CIFAR10_MEAN, CIFAR10_STD)]
    )  # fmt: skip
    torch.manual_seed(seed)
    loader = DataLoader(plain.CIFAR10Files(str(data), True, transform), BATCH, shuffle=True, drop_last=True)
    return [[read_rulers(x) for x, _ in loader] for _ in range(EPOCHS)]


def together_again(first, second) -> float:
    """Of the pairs of images that shared a batch in ``first`` (an epoch), the share that share one in ``second``."""
    pairs = [set(combinations(sorted(image[0] for image in batch), 2)) for batch in first]
    again = set().union(*(set(combinations(sorted(image[0] for image in batch), 2)) for batch in second))
    shared = set().union(*pairs)
    return len(shared & again) / len(shared)


def statistics(runs) -> dict[str, float]:
    """What the test compares, for two runs of other seeds (``runs``, each a list of epochs)."""
    first, second = runs
    counts = Counter(image[0] for epoch in first for batch in epoch for image in batch)
    once = all(len({image[0] for batch in epoch for image in batch}) == sum(map(len, epoch)) for epoch in first)
    augmentations = {index: [] for index in range(IMAGES)}
    for epoch in first:
        for batch in epoch:
            for index, *augmentation in batch:
                augmentations[index].append(tuple(augmentation))
    tops = Counter(top for values in augmentations.values() for top, _, _ in values)
    flips = [np.mean([flip for *_, flip in values]) for values in augmentations.values()]
    same_augmentation = [
        a[1:] == b[1:]
        for epoch_a, epoch_b in zip(first, second)
        for a, b in zip(sorted(i for batch in epoch_a for i in batch), sorted(i for batch in epoch_b for i in batch))
        if a[0] == b[0]
    ]
    return {
        "once_an_epoch": float(once),
        "images_an_epoch": sum(map(len, first[0])),
        "least_epochs_of_an_image": min(counts.values()),
        "distinct_augmentations": np.mean([len(set(values)) / len(values) for values in augmentations.values()]),
        "top_offsets_chi2": sum((n - len(sum(augmentations.values(), [])) / 9) ** 2 for n in tops.values())
        / (len(sum(augmentations.values(), [])) / 9),
        "flip_rate_spread": float(np.std(flips)),
        "together_next_epoch": np.mean([together_again(a, b) for a, b in zip(first, first[1:])]),
        "together_other_seed": np.mean([together_again(a, b) for a, b in zip(first, second)]),
        "same_augmentation_other_seed": float(np.mean(same_augmentation)),
    }


def test_training_batches_are_distributed_as_a_plain_shuffled_loaders(data):
    app = statistics([app_epochs(data, seed) for seed in (1, 2)])
    plain = statistics([plain_epochs(data, seed) for seed in (1, 2)])
    print("\n".join(f"{name:30} app {app[name]:8.4f}   plain {plain[name]:8.4f}" for name in app))
    independent = (BATCH - 1) / (IMAGES - 1)  # the chance that two images share a batch of an independent shuffle
    for figures in (app, plain):
        assert figures["once_an_epoch"] == 1.0 and figures["images_an_epoch"] == IMAGES // BATCH * BATCH
        assert figures["least_epochs_of_an_image"] >= EPOCHS // 2  # every image trains, the left-out ones vary
        # 40 draws from 162 cells: about 0.89 distinct; the same augmentation every epoch would give 1/40.
        assert figures["distinct_augmentations"] > 0.8
        assert figures["top_offsets_chi2"] < 26.1  # chi-square, 8 degrees of freedom: p = 0.001
        assert figures["flip_rate_spread"] < 0.12  # binomial: sqrt(0.25 / 40) = 0.079
        for name in ("together_next_epoch", "together_other_seed"):
            assert abs(figures[name] - independent) < 0.06, name
        assert figures["same_augmentation_other_seed"] < 0.03  # 1 / 162 for independent draws
