"""CIFAR-10 resident on the device (`data.on_device`): whole-batch augmentation, sharding and resuming."""

import torch
import torch.nn.functional as F
from helpers import SMOKE, cli_main, run_args

from multigpu.data.cifar import CIFAR10_MEAN, CIFAR10_STD
from multigpu.data.datamodule import ImageDataModule
from multigpu.data.on_device import DeviceBatches, cifar10_stats, normalize, random_crop_flip
from multigpu.data.sampling import ResumableSampler
from multigpu.data.transforms import eval_transform


def _module(data_dir, **kwargs) -> ImageDataModule:
    options = {"download": False, "verify_checksums": False, "batch_size": 8, "num_workers": 0, "on_device": True}
    return ImageDataModule(data_dir=str(data_dir), **(options | kwargs))


def test_each_image_is_a_crop_of_its_padded_self_some_flipped():
    images = torch.randint(256, (64, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    out = random_crop_flip(images, torch.Generator().manual_seed(1))
    assert out.shape == images.shape and out.dtype == torch.uint8
    padded = F.pad(images, (4, 4, 4, 4))
    flipped = offsets = 0
    for image, result in zip(padded, out):
        crops = {
            (dy, dx, flip)
            for dy in range(9)
            for dx in range(9)
            for flip in (False, True)
            if torch.equal(image[:, dy : dy + 32, dx : dx + 32].flip(2 if flip else ()), result)
        }
        assert crops, "an output image is no crop of its padded input"
        flipped += all(flip for _, _, flip in crops)
        offsets += any((dy, dx) != (4, 4) for dy, dx, _ in crops)
    assert 16 < flipped < 48 and offsets > 48  # about half flipped, most of them moved


def test_normalisation_matches_the_loader_path():
    images = torch.randint(256, (4, 3, 32, 32), dtype=torch.uint8)
    expected = torch.stack([eval_transform(CIFAR10_MEAN, CIFAR10_STD)(image) for image in images])
    torch.testing.assert_close(normalize(images, *cifar10_stats(images.device)), expected)


def test_ranks_read_the_distributed_samplers_shards_and_a_resumed_epoch_continues_exactly(tiny_cifar10):
    data = _module(tiny_cifar10)
    data.setup("fit")
    train = data.datasets["train"]
    shards, read = [], []
    for rank in range(2):
        sampler = ResumableSampler(train, 2, rank, batch_size=8, seed=3)
        sampler.set_epoch(1)
        batches = list(DeviceBatches(train, sampler, 8, augment=True))
        assert len(batches) == len(DeviceBatches(train, sampler, 8, augment=True)) == 50 // 8
        shards.append(batches)
        # The samples of each batch are the ones the DataLoader path would read, in the same order.
        order = [index for index, _ in sampler][: 6 * 8]
        read.append(set(order))
        for number, (images, labels) in enumerate(batches):
            assert torch.equal(labels, train.labels[order[number * 8 : (number + 1) * 8]])
    assert not read[0] & read[1]  # the two ranks' shards do not overlap
    # Resuming after 2 steps (the first 32 images of the epoch's order) gives the remaining batches bit for bit,
    # augmentation included.
    sampler = ResumableSampler(train, 2, 0, batch_size=8, seed=3)
    sampler.set_epoch(1)
    sampler.resume_at(1, 2 * 16)
    resumed = list(DeviceBatches(train, sampler, 8, augment=True))
    assert len(resumed) == len(shards[0]) - 2
    for (x, y), (expected_x, expected_y) in zip(resumed, shards[0][2:]):
        assert torch.equal(x, expected_x) and torch.equal(y, expected_y)


def test_fit_with_the_dataset_on_the_device(tmp_path, tiny_cifar10):
    cli_main(
        "fit",
        "--config",
        SMOKE,
        *run_args(tmp_path),
        "--data.on_device=true",
        "--data.synthetic=false",
        f"--data.data_dir={tiny_cifar10}",
        "--data.download=false",
        "--data.verify_checksums=false",
        "--model.stem=imagenet",
        "--trainer.max_steps=3",
    )
    last = torch.load(tmp_path / "checkpoints" / "test" / "last.ckpt")
    assert last["global_step"] == 3


def test_synthetic_data_on_the_device_is_uint8_images_augmented_there():
    data = ImageDataModule(synthetic=True, synthetic_size=32, batch_size=8, on_device=True)
    data.setup("fit")
    assert data.datasets["train"].images.dtype == torch.uint8
    x, y = next(iter(data.train_dataloader()))
    assert x.shape == (8, 3, 32, 32) and x.dtype == torch.float32 and y.shape == (8,)
    assert len(data.val_dataloader()) == 1  # 8 evaluation images, one batch, not dropped
