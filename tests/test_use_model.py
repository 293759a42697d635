"""Using a trained model: ``predict``'s CSV (the test split, the user's images, under ddp), the messages of the
commands that only evaluate, ``export`` to torchvision, TorchScript and ONNX from every strategy's checkpoint, and
``--model.init_from`` torchvision weights."""

import csv
import importlib.util
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from helpers import RESNET50, SMOKE, cli_error, cli_main, run_args, run_cli
from PIL import Image

from multigpu.checkpointing.files import check_checkpoint
from multigpu.data.cifar import CIFAR10_CLASSES
from multigpu.model.torchvision_weights import cifar_stem
from multigpu.trained.export import TOLERANCE, network_of


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A smoke run trained on one device: its folder."""
    tmp_path = tmp_path_factory.mktemp("trained")
    result = run_cli("fit", "--config", SMOKE, *run_args(tmp_path), cwd=tmp_path)
    assert result.returncode == 0, result.stdout
    return tmp_path


def _rows(path) -> list[dict]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


@pytest.mark.slow
def test_predict_writes_every_image_once_in_order_with_its_top_5_and_says_nothing_of_training(trained):
    for devices in (["--trainer.devices=1"], ["--trainer.strategy=ddp", "--trainer.devices=2"]):
        result = run_cli("predict", "--config", SMOKE, *run_args(trained), *devices, "--ckpt_path=last", cwd=trained)
        assert result.returncode == 0, result.stdout
        path = trained / "logs" / "test" / "predictions.csv"
        rows = _rows(path)
        assert [row["image"] for row in rows] == [str(index) for index in range(8)]  # a quarter of 32 images
        for row in rows:
            probabilities = [float(row[f"prob_{n}"]) for n in range(1, 6)]
            assert probabilities == sorted(probabilities, reverse=True) and sum(probabilities) <= 1.0001
            assert {row["label"], *(row[f"class_{n}"] for n in range(1, 6))} <= set(CIFAR10_CLASSES)
        right = sum(row["class_1"] == row["label"] for row in rows)
        assert f"predict: 8 images, top-1 accuracy {right / 8:.1%}" in result.stdout
        assert f"wrote {path}" in result.stdout
        assert f"predict: the weights of {trained / 'checkpoints' / 'test' / 'last.ckpt'}" in result.stdout
        assert "global batch" not in result.stdout and "learning rate" not in result.stdout
    # test/acc is top-1: the share of the CSV's rows whose first class is the true one, on the same 8 images.
    tested = run_cli("test", *run_args(trained), "--ckpt_path=last", cwd=trained)
    assert tested.returncode == 0, tested.stdout
    test_acc = float(re.search(r"test/acc\W+([0-9.]+)", tested.stdout).group(1))
    assert test_acc == pytest.approx(right / 8, abs=1e-6), tested.stdout


@pytest.mark.slow
def test_an_export_where_nothing_can_be_written_stops_before_the_work(trained, capsys, tmp_path):
    """A folder under a file, and one that cannot be made even by root (/proc's mode bits let root write)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for out, existing in ((blocker / "model.pt", blocker), (Path("/proc/forbidden/model.pt"), Path("/proc"))):
        with pytest.raises(SystemExit) as exit_info:
            cli_main("export", "--config", SMOKE, *run_args(trained), f"--out={out}")
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"error: --out={out}: {existing} cannot be written here; choose a folder you can write to."
        )


@pytest.mark.slow
def test_predict_reads_a_folder_of_the_users_images_and_leaves_out_what_is_not_one(trained, tmp_path):
    folder = tmp_path / "mine"
    (folder / "more").mkdir(parents=True)
    sizes = {"a.png": (32, 32), "more/b.jpg": (120, 80), "c.PNG": (500, 375)}
    for name, (width, height) in sizes.items():
        Image.fromarray(np.random.randint(0, 255, (height, width, 3), dtype=np.uint8)).save(folder / name)
    (folder / "broken.png").write_text("not an image")
    out = tmp_path / "mine.csv"
    args = ["predict", "--config", SMOKE, *run_args(trained), "--ckpt_path=last", f"--predictions.path={out}"]
    result = run_cli(*args, f"--data.predict_dir={folder}", "--predictions.top_k=3", "--predictions.plot=true")
    assert result.returncode == 0, result.stdout
    rows = _rows(out)
    assert [row["image"] for row in rows] == [str(folder / name) for name in sorted(sizes)]
    assert all(row["label"] == "" and "class_3" in row and "class_4" not in row for row in rows)
    assert f"warning: {folder / 'broken.png'} cannot be read as an image" in result.stdout
    assert "predict: 3 images; wrote" in result.stdout
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
    for where, message in (
        (tmp_path / "nowhere", "is not a folder: give the folder that holds your PNG or JPEG images."),
        (tmp_path / "empty", "holds no readable PNG or JPEG image: put some there, or point it at another folder."),
    ):
        (tmp_path / "empty").mkdir(exist_ok=True)
        failed = run_cli(*args, f"--data.predict_dir={where}")
        assert failed.returncode == 2
        assert failed.stdout.strip().splitlines()[-1] == f"error: --data.predict_dir={where} {message}"


def test_evaluation_without_a_checkpoint_to_read_stops_with_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main("validate", "--config", SMOKE, *run_args(tmp_path), "--ckpt_path=last")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --ckpt_path last: no checkpoint in {tmp_path / 'checkpoints' / 'test'} yet. Train first (python "
        "main.py fit with the same --run_name), or pass a checkpoint file."
    )


def _torchvision(path, checkpoint: dict) -> torch.nn.Module:
    """torchvision's own resnet50, the export loaded into it as the export's docs say."""
    model = torchvision.models.resnet50(num_classes=10)
    if checkpoint["hyper_parameters"]["stem"] == "cifar":
        cifar_stem(model)
    model.load_state_dict(torch.load(path, weights_only=True), strict=True)
    return model.eval()


@pytest.mark.slow
def test_an_export_to_torchvision_and_torchscript_gives_the_checkpoints_logits(tmp_path, capsys):
    # The CIFAR stem, swapped into torchvision's model. Every strategy's checkpoint exports tensor for tensor:
    # tests/test_fsdp.py's chain of checkpoints through every strategy.
    trained = run_cli(
        "fit",
        "--config",
        SMOKE,
        *run_args(tmp_path),
        *RESNET50,  # the promise: ResNet-50 into torchvision's own
        "--model.stem=cifar",
        "--trainer.max_steps=1",
        "--trainer.limit_val_batches=0",
        cwd=tmp_path,
    )
    assert trained.returncode == 0, trained.stdout
    checkpoint = check_checkpoint(tmp_path / "checkpoints" / "test" / "last.ckpt")
    images = torch.randn(6, 3, 32, 32)
    with torch.no_grad():
        expected = network_of(checkpoint)(images)
        for to in ("torchvision", "torchscript"):
            out = tmp_path / f"exported-{to}.pt"
            cli_main("export", "--config", SMOKE, *run_args(tmp_path), *RESNET50, f"--to={to}", f"--out={out}")
            said = capsys.readouterr().out
            notes = out.with_name(f"{out.name}.input.json")
            assert f"export ({to}) from " in said and f": wrote {out}, {notes}; " in said, said
            assert "3 x 32 x 32 images, RGB, channels first, pixel values / 255 normalised with mean (0.4914" in said
            assert json.loads(notes.read_text())["std"] == [0.2470, 0.2435, 0.2616]
            model = _torchvision(out, checkpoint) if to == "torchvision" else torch.jit.load(str(out))
            torch.testing.assert_close(model(images), expected, atol=TOLERANCE, rtol=0)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("onnxruntime") is None, reason="needs onnx and onnxruntime")
def test_the_onnx_export_runs_in_onnxruntime_with_the_same_logits(trained, tmp_path, capsys):
    import onnxruntime

    out = tmp_path / "model.onnx"
    cli_main("export", "--config", SMOKE, *run_args(trained), "--to=onnx", f"--out={out}")
    said = capsys.readouterr().out
    assert "its logits match the checkpoint's within 1e-05 (relative)" in said
    assert "[torch.onnx]" not in said  # torch's progress lines
    written = said.partition(": wrote ")[2].partition("; ")[0].split(", ")  # every file, the weights' own too
    assert written[0] == str(out) and written[-1] == f"{out}.input.json"
    assert sorted(written) == sorted(str(path) for path in tmp_path.iterdir()), written
    checkpoint = check_checkpoint(trained / "checkpoints" / "test" / "last.ckpt")
    images = torch.randn(5, 3, 32, 32)  # another batch size than the export's
    session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(session.run(None, {"images": images.numpy()})[0])
    with torch.no_grad():  # ONNX Runtime's fused kernels round otherwise: float32's relative precision
        torch.testing.assert_close(got, network_of(checkpoint)(images), atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.slow
def test_a_run_starts_from_torchvision_weights_and_says_what_it_left(tmp_path):
    torch.manual_seed(0)
    weights = torchvision.models.resnet50().state_dict()  # ImageNet's shape: 7x7 stem, 1000 classes
    torch.save(weights, tmp_path / "resnet50.pth")
    result = run_cli(
        "fit",
        "--config",
        SMOKE,
        *run_args(tmp_path),
        *RESNET50,
        "--model.stem=cifar",
        f"--model.init_from={tmp_path / 'resnet50.pth'}",
        "--model.base_lr=0",
        "--model.weight_decay=0",
        "--trainer.max_steps=1",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout
    assert (
        f"init_from {tmp_path / 'resnet50.pth'}: loaded {len(weights) - 3} tensors; left at their initial values: "
        "conv1.weight ((64, 3, 7, 7) in the file, (64, 3, 3, 3) here), fc.weight ((1000, 2048) in the file, (10, 2048) "
        "here), fc.bias ((1000,) in the file, (10,) here)."
    ) in result.stdout
    state = check_checkpoint(tmp_path / "checkpoints" / "test" / "last.ckpt")["state_dict"]
    torch.testing.assert_close(state["net.1.conv1.weight"], weights["layer1.0.conv1.weight"], atol=0, rtol=0)
    missing = run_cli(
        "fit", "--config", SMOKE, *run_args(tmp_path, "another"), "--model.init_from=nope.pth", cwd=tmp_path
    )
    assert missing.returncode == 2
    assert missing.stdout.strip().splitlines()[-1] == (
        "error: --model.init_from=nope.pth is not a file: give the path of a torchvision ResNet-50 state dict."
    )


def test_a_bad_weights_file_is_refused_in_one_line_before_anything_is_built(capsys, tmp_path):
    corrupt, model = tmp_path / "corrupt.pth", tmp_path / "model.pth"
    corrupt.write_bytes(b"not a checkpoint")
    torch.save(torch.nn.Linear(2, 2), model)  # the model, not its state dict
    for path, expected in ((corrupt, "cannot be read ("), (model, "holds more than tensors")):
        error = cli_error(capsys, *run_args(tmp_path), f"--model.init_from={path}")
        assert error.startswith(f"error: --model.init_from={path}") and expected in error, error
    assert not (tmp_path / "checkpoints").exists()


def test_a_checkpoint_that_names_code_is_refused_unless_the_command_line_names_the_same(trained, tmp_path, capsys):
    """A checkpoint handed over by someone else, its saved network set to a module of their choosing (``this``, which
    prints the Zen of Python when imported): test refuses it in one line, imports nothing, and names the option to
    give; given on the command line, the value is the user's choice, checked against the checkpoint's."""
    checkpoint = torch.load(trained / "checkpoints" / "test" / "last.ckpt", weights_only=True)
    checkpoint["hyper_parameters"]["arch"] = "this.nothing"
    crafted = tmp_path / "crafted.ckpt"
    torch.save(checkpoint, crafted)
    test = ["test", "--config", SMOKE, "--run_name=other", f"--checkpoint_root={tmp_path}", f"--ckpt_path={crafted}"]
    for extra in ([], ["--model.arch=helpers.tiny_resnet"]):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(*test, *extra)
        assert exit_info.value.code == 2
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert "this" not in sys.modules, error
        if not extra:
            assert "--model.arch=this.nothing, which names code" in error, error
        else:
            assert "holds another network (arch this.nothing, not helpers.tiny_resnet)" in error, error
