import os
from pathlib import Path
from urllib.error import URLError

import pytest
import torch
from lightning.fabric.utilities.data import suggested_max_num_workers

from multigpu.checkpointing.position import TrainingPosition
from multigpu.data.datamodule import ImageDataModule
from multigpu.errors import UsageError


def _module(data_dir: Path, **kwargs) -> ImageDataModule:
    options = {"download": False, "verify_checksums": False, "batch_size": 8, "num_workers": 0} | kwargs
    return ImageDataModule(data_dir=str(data_dir), **options)


def test_reads_official_format_and_augmentation_keeps_shape_and_dtype(tiny_cifar10):
    data = _module(tiny_cifar10)
    data.setup("fit")
    assert len(data.datasets["train"]) == 100 and len(data.datasets["val"]) == 20
    x, y = next(iter(data.train_dataloader()))
    assert x.shape == (8, 3, 32, 32) and x.dtype == torch.float32
    assert y.shape == (8,) and y.dtype == torch.int64
    # Normalised: roughly zero mean, unit spread, not the 0..255 of the files.
    assert -3 < x.mean() < 3 and x.abs().max() < 5


def test_augmentation_crops_and_flips_but_evaluation_does_not(tiny_cifar10):
    data = _module(tiny_cifar10)
    data.setup("fit")
    train, val = data.datasets["train"], data.datasets["test"]
    torch.manual_seed(0)
    assert any(not torch.equal(train[0][0], train[0][0]) for _ in range(10))
    assert torch.equal(val[0][0], val[0][0])


def test_val_split_holds_out_the_same_images_every_time(tiny_cifar10):
    first, second = _module(tiny_cifar10, val_split=30), _module(tiny_cifar10, val_split=30)
    first.setup("fit"), second.setup("fit")
    assert len(first.datasets["train"]) == 70 and len(first.datasets["val"]) == 30
    assert torch.equal(first.datasets["val"].images, second.datasets["val"].images)
    held_out = {bytes(image.numpy()) for image in first.datasets["val"].images}
    assert not held_out & {bytes(image.numpy()) for image in first.datasets["train"].images}


def test_val_split_larger_than_the_training_set_is_refused(tiny_cifar10):
    data = _module(tiny_cifar10, val_split=100)
    with pytest.raises(UsageError, match="leaves no training images"):
        data.setup("fit")


def test_checksums_of_a_partial_copy_fail_with_the_way_out(tiny_cifar10):
    with pytest.raises(UsageError, match="fail their checksum.*verify_checksums=false"):
        _module(tiny_cifar10, verify_checksums=True)


def test_missing_dataset_without_download_names_the_folder_and_both_fixes(tmp_path):
    with pytest.raises(UsageError) as error:
        _module(tmp_path / "nothing")
    message = str(error.value)
    assert str((tmp_path / "nothing").resolve()) in message
    assert "--data.download=true" in message and "--data.data_dir" in message
    assert "\n" not in message


def test_missing_dataset_when_the_download_fails_leaves_nothing_behind(tmp_path, monkeypatch):
    def no_network(url, download_root, *args, **kwargs):  # as torchvision fails: its folder made, a part written
        Path(download_root).mkdir(parents=True, exist_ok=True)
        (Path(download_root) / "cifar-10-python.tar.gz").write_bytes(b"part of it")
        raise URLError("no network")

    monkeypatch.setattr("torchvision.datasets.cifar.download_and_extract_archive", no_network)
    with pytest.raises(UsageError, match="the download failed") as error:
        _module(tmp_path / "new" / "data", download=True)
    assert "run again once connected" in str(error.value) and "--data.download=true" not in str(error.value)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "mine.txt").write_text("the user's")
    with pytest.raises(UsageError, match="the download failed"):
        _module(tmp_path / "kept", download=True)
    assert [path.name for path in (tmp_path / "kept").iterdir()] == ["mine.txt"]


def test_the_inner_cifar10_folder_is_accepted_as_the_data_folder(tiny_cifar10):
    inner = _module(tiny_cifar10 / "cifar-10-batches-py")
    inner.setup("fit")
    assert len(inner.datasets["train"]) == 100 and len(inner.datasets["val"]) == 20


def test_synthetic_data_is_deterministic_and_touches_no_disk(tmp_path):
    data = _module(tmp_path / "absent", synthetic=True, synthetic_size=16)
    data.setup("fit")
    x, y = data.datasets["train"][3]
    assert x.shape == (3, 32, 32) and 0 <= y < 10
    assert torch.equal(x, data.datasets["train"][3][0])
    assert len(data.datasets["val"]) == 4
    assert not (tmp_path / "absent").exists()


def test_real_subset_from_environment():
    """Reads the real CIFAR-10 subset when MULTIGPU_CIFAR10_SUBSET points at it."""
    subset = os.environ.get("MULTIGPU_CIFAR10_SUBSET")
    if not subset:
        pytest.skip("set MULTIGPU_CIFAR10_SUBSET to the folder holding cifar-10-batches-py")
    data = _module(Path(subset))
    data.setup("fit")
    assert len(data.datasets["train"]) == 5085 and len(data.datasets["val"]) == 1017


def test_under_srun_only_the_first_task_of_each_node_checks_the_dataset(tmp_path, monkeypatch):
    """srun starts every task at once and sets SLURM_LOCALID, not LOCAL_RANK: local task 1 leaves the check
    (and a download) to local task 0, which stops at the missing files."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    missing = {"data_dir": str(tmp_path / "none"), "download": False}
    monkeypatch.setenv("SLURM_LOCALID", "1")
    ImageDataModule(**missing)  # waits for its node's first task when the process group is set up
    monkeypatch.setenv("SLURM_LOCALID", "0")
    with pytest.raises(UsageError, match="CIFAR-10 is not in"):
        ImageDataModule(**missing)


@pytest.mark.parametrize(
    ("shuffle_seed", "checkpoint", "expected"),
    [
        (None, None, 7),  # a new run: the run's seed_everything
        (3, None, 3),  # an explicit seed wins
        (None, {"epoch": 1, "position": 4, "global_batch": 4, "shuffle_seed": 5}, 5),  # a resumed run keeps its own
        (3, {"epoch": 1, "position": 4, "global_batch": 4, "shuffle_seed": 5}, 5),
        (None, {"epoch": 1, "position": 4, "global_batch": 4}, 0),  # a checkpoint of an earlier version: seed 0
    ],
)
def test_the_training_order_follows_the_runs_seed_and_a_resumed_run_keeps_its_checkpoints(
    tiny_cifar10, monkeypatch, shuffle_seed, checkpoint, expected
):
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")  # what seed_everything(7) sets
    data = ImageDataModule(
        data_dir=str(tiny_cifar10), download=False, verify_checksums=False, batch_size=4, num_workers=0,
        shuffle_seed=shuffle_seed,
    )  # fmt: skip
    data.setup("fit")
    if checkpoint:
        TrainingPosition.of({"multigpu": {"order": checkpoint}}).give_to(data, accumulation=1)
    assert data.train_dataloader().sampler.seed == expected


def test_the_default_loader_workers_follow_the_machines_cores(tiny_cifar10):
    data = ImageDataModule(data_dir=str(tiny_cifar10), download=False, verify_checksums=False, batch_size=8)
    data.setup("fit")
    assert data.train_dataloader().num_workers == suggested_max_num_workers(1)
    assert _module(tiny_cifar10, num_workers=0).hparams.num_workers == 0  # a number given is kept
