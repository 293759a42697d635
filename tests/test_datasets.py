"""Other data than CIFAR-10: CIFAR-100 in its official files, and a folder of the user's labelled images in
ImageNet's layout, under every layout; what is wrong with such data is refused in one line."""

import csv
import json
import logging
import pickle

import numpy as np
import pytest
import torch
import torchvision
import yaml
from helpers import HELPERS_ENV, SMOKE, cli_error, cli_main, helper_callback, run_args, run_cli, write_image_folder

from multigpu.data.datamodule import ImageDataModule
from multigpu.errors import UsageError


def write_tiny_cifar100(root, train: int = 32, test: int = 8):
    """CIFAR-100's official python layout (``train``, ``test``, ``meta``) with random images."""
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, count in (("train", train), ("test", test)):
        entry = {"data": rng.integers(0, 256, (count, 3072), dtype=np.uint8), "fine_labels": list(range(count))}
        (folder / name).write_bytes(pickle.dumps(entry))
    (folder / "meta").write_bytes(pickle.dumps({"fine_label_names": [f"class{index}" for index in range(100)]}))
    return root


FILES = ["--data.synthetic=false", "--data.download=false", "--data.verify_checksums=false"]


def test_cifar100_trains_a_100_class_head_and_predicts_its_class_names(tmp_path):
    data = write_tiny_cifar100(tmp_path / "c100")
    args = ["--config", SMOKE, *run_args(tmp_path), *FILES, "--data.dataset=cifar100", f"--data.data_dir={data}"]
    cli_main("fit", *args)
    checkpoint = torch.load(tmp_path / "checkpoints" / "test" / "last.ckpt", weights_only=False)
    assert checkpoint["state_dict"]["net.7.2.weight"].shape == (100, 32)  # tiny_resnet's head
    out = tmp_path / "predictions.csv"
    cli_main("predict", *args, "--ckpt_path=last", f"--predictions.path={out}")
    rows = list(csv.DictReader(open(out)))
    assert [row["label"] for row in rows] == [f"class{index}" for index in range(8)]


@pytest.mark.slow
def test_an_image_folder_trains_resnet18_under_ddp_with_its_own_classes(tmp_path):
    """3 classes of PNG and JPEG images of assorted sizes, 24 for training: 3 steps of 8 under ddp, stopped by SIGUSR1
    (SLURM's warning before the time limit) in the first step (so after the second: the processes read their vote a
    step later) and resumed on one device accumulating 2 batches. The head has 3 outputs, predict names the
    classes."""
    folder = write_image_folder(tmp_path / "pets")
    args = [*run_args(tmp_path), "--data.synthetic=false", "--data.dataset=imagefolder", f"--data.data_dir={folder}"]
    args += ["--model.arch=resnet18", "--model.stem=imagenet", "--data.batch_size=4", "--data.num_workers=1"]
    stop = helper_callback(tmp_path, "KillAt", step=0, moment="sigusr1")  # ends after step 2
    ddp = ["--trainer.strategy=ddp", "--trainer.devices=2", "--config", stop]
    fit = run_cli("fit", "--config", SMOKE, *args, *ddp, env=HELPERS_ENV)
    assert fit.returncode == 0 and "Received SIGUSR1: saved" in fit.stdout, fit.stdout
    assert torch.load(tmp_path / "checkpoints" / "test" / "last.ckpt")["global_step"] == 2
    resumed = run_cli("fit", "--config", SMOKE, *args, "--ckpt_path=last", "--trainer.accumulate_grad_batches=2")
    assert resumed.returncode == 0, resumed.stdout
    assert "world size 2 -> 1, replicas 2 -> 1, accumulated batches 1 -> 2): kept the global batch 8" in resumed.stdout
    checkpoint = torch.load(tmp_path / "checkpoints" / "test" / "last.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 3 and checkpoint["multigpu"]["order"]["epoch"] == 1
    assert checkpoint["state_dict"]["net.10.weight"].shape == (3, 512)  # resnet18's fc, the last of its 11 blocks
    assert checkpoint["hyper_parameters"]["num_classes"] == 3
    # An image added since: predict normalises as the run did (its checkpoint's mean and std), not as the folder now.
    torchvision.io.write_png(torch.full((3, 40, 40), 255, dtype=torch.uint8), str(folder / "train" / "cat" / "w.png"))
    out = tmp_path / "predictions.csv"
    cli_main("predict", "--config", SMOKE, *args, "--ckpt_path=last", f"--predictions.path={out}")
    rows = list(csv.DictReader(open(out)))
    assert sorted(row["label"] for row in rows) == ["cat", "cat", "dog", "dog", "owl", "owl"]
    (saved,) = (tmp_path / "logs").rglob("predict-config.yaml")
    measured = checkpoint["multigpu"]["data"]
    assert yaml.safe_load(saved.read_text())["data"]["mean"] == measured["mean"], measured
    assert {row["class_1"] for row in rows} <= {"cat", "dog", "owl"}
    exported = tmp_path / "resnet18.pt"
    cli_main("export", "--config", SMOKE, *args, "--ckpt_path=last", "--to=torchvision", f"--out={exported}")
    torchvision.models.resnet18(num_classes=3).load_state_dict(torch.load(exported), strict=True)
    notes = json.loads(exported.with_name("resnet18.pt.input.json").read_text())
    assert notes["classes"] == ["cat", "dog", "owl"] and notes["shape"] == ["batch", 3, 32, 32]


@pytest.mark.slow
def test_an_image_folder_run_killed_and_resumed_ends_bit_for_bit_like_an_uninterrupted_run(tmp_path):
    """SIGKILL in the second epoch, with the recipe's 2 persistent loader workers reading the files, then the same
    command with --ckpt_path last: the state of a run never killed. MobileNet V3 trains with its dropout on: the
    resumed run draws the masks the run never killed drew."""
    folder = write_image_folder(tmp_path / "pets", train=6)
    args = ["fit", "--config", SMOKE, "--data.synthetic=false", "--data.dataset=imagefolder"]
    args += [f"--data.data_dir={folder}", "--data.batch_size=4", "--data.num_workers=2"]
    args += ["--data.persistent_workers=true", "--save_every_n_steps=2", "--trainer.max_epochs=2", "--ckpt_path=last"]
    one_thread = {**HELPERS_ENV, "OMP_NUM_THREADS": "1"}
    mobilenet = "--model.arch=mobilenet_v3_small"
    whole = run_cli(*args, *run_args(tmp_path, "whole"), mobilenet, env=one_thread)
    assert whole.returncode == 0, whole.stdout
    kill = helper_callback(tmp_path, "KillAt", step=7)  # 4 steps an epoch, last.ckpt at step 6
    killed = run_cli(
        *args, *run_args(tmp_path, "killed"), mobilenet, "--config", kill, env={**HELPERS_ENV, "OMP_NUM_THREADS": "1"}
    )
    assert killed.returncode != 0
    resumed = run_cli(*args, *run_args(tmp_path, "killed"), mobilenet, env={"OMP_NUM_THREADS": "1"})
    assert resumed.returncode == 0 and "Resuming from" in resumed.stdout and "at step 6." in resumed.stdout, (
        resumed.stdout
    )
    expected, found = (torch.load(tmp_path / "checkpoints" / run / "last.ckpt") for run in ("whole", "killed"))
    assert found["global_step"] == expected["global_step"] == 8
    torch.testing.assert_close(found["state_dict"], expected["state_dict"], rtol=0, atol=0)


def test_an_image_folder_is_normalised_with_its_own_mean_and_std(tmp_path, caplog):
    folder = write_image_folder(tmp_path / "pets")
    data = ImageDataModule(str(folder), dataset="imagefolder", image_size=16, num_workers=0)
    assert data.num_classes == 3 and data.classes == ["cat", "dog", "owl"]
    with caplog.at_level(logging.INFO):
        data.setup("fit")
    said = f"image folder {folder}: 3 classes (cat, dog, owl), 24 training and 6 validation images at 16x16, "
    assert said in caplog.text and "), measured." in caplog.text, caplog.text
    images = torch.stack([data.datasets["val"][index][0] for index in range(len(data.datasets["val"]))])
    assert images.shape == (6, 3, 16, 16)
    mean, std = data.stats
    assert all(0.2 < value < 0.9 for value in mean) and all(0.05 < value < 0.5 for value in std)


def _broken(root):
    """Each way an image folder can be wrong, and the start of the one line that says so."""
    cases = {}
    cases["empty"] = (root / "empty", "has no train/<class>/ folders")
    (root / "empty").mkdir()
    extra = write_image_folder(root / "extra")
    (extra / "val" / "ferret").mkdir()
    cases["extra"] = (extra, f"{extra / 'val' / 'ferret'} is a class that {extra / 'train'} lacks")
    hollow = write_image_folder(root / "hollow")
    for image in (hollow / "train" / "dog").iterdir():
        image.unlink()
    cases["hollow"] = (hollow, f"{hollow / 'train' / 'dog'} holds no PNG or JPEG image")
    unreadable = write_image_folder(root / "unreadable")
    (unreadable / "train" / "owl" / "9.png").write_text("not an image")
    cases["unreadable"] = (unreadable, f"{unreadable / 'train' / 'owl' / '9.png'} cannot be read as an image")
    return cases


def test_a_wrong_image_folder_is_refused_in_one_line_naming_what_is_wrong(capsys, tmp_path):
    for name, (folder, refusal) in _broken(tmp_path).items():
        args = ["--data.synthetic=false", "--data.dataset=imagefolder", f"--data.data_dir={folder}"]
        error = cli_error(capsys, *args, *run_args(tmp_path / name))
        assert error.startswith("error: ") and refusal in error, (name, error)
        assert not (tmp_path / name / "checkpoints").exists()


def test_cifar100_given_as_cifar10_is_refused_in_one_line(capsys, tmp_path):
    data = write_tiny_cifar100(tmp_path / "c100")
    error = cli_error(capsys, *FILES, f"--data.data_dir={data}", *run_args(tmp_path))
    assert error == (
        f"error: {data} holds CIFAR-100 (cifar-100-python/), not CIFAR-10: add --data.dataset=cifar100, or point "
        "--data.data_dir at CIFAR-10."
    )


def test_an_image_folder_on_the_device_gives_the_batches_of_its_files_and_is_refused_where_it_does_not_fit(
    tmp_path, monkeypatch
):
    """``data.on_device``: the folder decoded once, each evaluation batch the images its files give; a device with
    less free memory than the decoded images refuses in one line."""
    folder = write_image_folder(tmp_path / "pets")
    files = ImageDataModule(str(folder), dataset="imagefolder", batch_size=6, num_workers=0)
    files.setup("fit")
    resident = ImageDataModule(str(folder), dataset="imagefolder", batch_size=6, on_device=True)
    resident.setup("fit")
    images, labels = next(iter(resident.val_dataloader()))
    expected = [files.datasets["val"][index] for index in range(6)]
    torch.testing.assert_close(images, torch.stack([image for image, _ in expected]))
    assert labels.tolist() == [label for _, label in expected]
    monkeypatch.setattr("multigpu.data.image_folder.free_memory", lambda device: 1000)
    with pytest.raises(UsageError, match=r"^data.on_device=true: the image folder's 30 images take 0.0 GiB at 32x32"):
        ImageDataModule(str(folder), dataset="imagefolder", on_device=True).setup("fit")
