"""What a user sees in TensorBoard, read from a real ``tensorboard`` served on loopback through its HTTP data API,
and what a finished fit says."""

import csv
import json
import logging
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import torch
from helpers import SMOKE, VALIDATION_IMAGES, cli_main, free_port, helper_callback, run_args

from multigpu.data.cifar import CIFAR10_CLASSES
from multigpu.run import validation_report
from multigpu.run.peak_flops import peak_flops
from multigpu.run.run_hparams import METRICS
from multigpu.run.validation_report import ValidationReport


def _get(url: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json", "X-XSRF-Protected": "1"}
    with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=10) as response:
        return json.loads(response.read())


@pytest.fixture
def tensorboard():
    """``serve(logdir)``: a tensorboard on a free loopback port; its address once it lists a run."""
    servers = []

    def serve(logdir) -> str:
        port = free_port()
        command = [sys.executable, "-m", "tensorboard.main", f"--logdir={logdir}", "--host=127.0.0.1"]
        servers.append(subprocess.Popen([*command, f"--port={port}", "--load_fast=false"], stderr=subprocess.DEVNULL))
        address, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if _get(f"{address}/data/plugin/scalars/tags"):
                    return address
            except OSError:
                pass
            time.sleep(0.25)
        raise AssertionError("tensorboard did not serve the run within 60 s")

    yield serve
    for server in servers:
        server.kill()
        server.wait()


@pytest.mark.slow
def test_tensorboard_shows_the_runs_scalars_and_one_hparams_row_with_its_best_and_last_metrics(
    tmp_path, tensorboard, caplog
):
    """A smoke run of one epoch, resumed for a second: TensorBoard lists the training, validation and hp/ scalars, and
    the HPARAMS dashboard one row for the run (the resume adds none), with its layout and recipe and the best and
    last validation accuracy and loss as of its last step; each validation's accuracy by class, and its confusion
    matrix and its images of highest loss as images (none with --validation_report.images=false). The end of each
    fit says its throughput, peak memory, best checkpoint and the command that opens TensorBoard on the run."""
    args = ["fit", "--config", SMOKE, *run_args(tmp_path), VALIDATION_IMAGES]
    cli_main(*args, "--trainer.max_epochs=1")
    with caplog.at_level(logging.INFO):
        cli_main(*args, "--trainer.max_epochs=2", "--ckpt_path=last")
    summary = caplog.text[caplog.text.index("Finished:") :]
    assert "images/s over" in summary and "waiting for the loader" in summary, summary
    assert "peak memory, process 0 (CPU):" in summary, summary
    assert "best val/acc" in summary and str(tmp_path / "checkpoints" / "test") in summary, summary
    assert f"tensorboard --logdir {tmp_path / 'logs' / 'test' / 'version_0'}" in summary, summary
    cli_main("fit", "--config", SMOKE, *run_args(tmp_path, "plain"), "--validation_report.images=false")
    address = tensorboard(tmp_path / "logs")
    tags = _get(f"{address}/data/plugin/scalars/tags")
    assert sorted(tags) == ["plain/version_0", "test/version_0"], tags
    by_class = {f"val/acc_by_class/{name}" for name in CIFAR10_CLASSES}
    step = {f"perf/step/{name}" for name in ("seconds", "data_wait_share", "images_per_s", "resident_memory_gib")}
    assert {"train/loss", "train/acc", "train/lr", "train/grad_norm", "val/loss", "val/acc", *METRICS, *by_class,
            *step} <= set(tags["test/version_0"])  # fmt: skip
    images = _get(f"{address}/data/plugin/images/tags")
    assert list(images) == ["test/version_0"], images
    assert sorted(images["test/version_0"]) == ["val/confusion_matrix", "val/most_wrong"], images
    for tag in images["test/version_0"]:
        shown = _get(f"{address}/data/plugin/images/images?run=test/version_0&tag={tag}")
        assert [image["step"] for image in shown] == [4, 8], shown  # each validation's
    groups = _get(
        f"{address}/data/plugin/hparams/session_groups",
        {"experimentName": "", "allowedStatuses": ["STATUS_SUCCESS", "STATUS_UNKNOWN"], "colParams": [],
         "startIndex": 0, "sliceSize": 10},
    )["sessionGroups"]  # fmt: skip
    groups = [group for group in groups if group["name"] == "test/version_0"]
    assert len(groups) == 1, groups
    hparams = groups[0]["hparams"]
    assert hparams["strategy"] == "SingleDeviceStrategy" and hparams["devices"] == 1 and hparams["nodes"] == 1
    assert hparams["arch"] == "helpers.tiny_resnet" and hparams["dataset"] == "synthetic"
    assert {"precision", "batch_size", "global_batch_size", "lr", "micro_batches"} <= set(hparams)
    metrics = {value["name"]["tag"]: value for value in groups[0]["metricValues"]}
    assert set(metrics) == set(METRICS) and all(value["trainingStep"] == 8 for value in metrics.values()), metrics
    scalars = _get(f"{address}/data/plugin/scalars/scalars?run=test/version_0&tag=val/acc")
    assert metrics["hp/val_acc_last"]["value"] == pytest.approx(scalars[-1][2])
    assert metrics["hp/val_acc_best"]["value"] == pytest.approx(max(point[2] for point in scalars))


@pytest.mark.slow
@pytest.mark.internals  # on the lowest torch we declare too: DTensor's norm, the pipeline's stages
def test_the_logged_gradient_norm_is_clip_grad_norms_under_every_strategy(train_setup):
    """``train/grad_norm`` at each of 4 steps, on the same samples: on one device it is ``clip_grad_norm_``'s value on
    the same gradients; under ddp, fsdp (and HSDP), a pipeline (and 2 of its copies) and manual model parallel, each
    process holding a part or a copy of them, the same."""
    single = train_setup("single")
    assert torch.equal(single["grad_norm"], single["clip_grad_norm"]) and single["grad_norm"].shape == (4,)
    for setup in ("tiny_ddp_4", "tiny_fsdp_4", "tiny_fsdp_2x2", "pipe_gpipe", "pipe_1f1b", "pipe_2x2", "mmp_1x2"):
        torch.testing.assert_close(train_setup(setup)["grad_norm"], single["clip_grad_norm"], rtol=1e-6, atol=0)
    torch.testing.assert_close(train_setup("mmp_2x2")["grad_norm"], single["clip_grad_norm"], rtol=1e-6, atol=0)


@pytest.mark.slow
def test_the_loaders_wait_shows_in_the_logged_steps_and_another_logger_gets_the_scalars(tmp_path, caplog):
    """8 batches, logged every 4 steps. A loader slowed by 50 ms an image (400 ms a batch of 8, against steps of a few
    ms) waits more than half of the second interval's time (the first has the first steps' warm-up, as long as the
    machine is slow); the loader unslowed, beside batches made 100 ms longer, less than a tenth (2 batches
    accumulated a step, logged every 2 steps: once each, at its last batch). Lightning's CSVLogger,
    in place of TensorBoard, gets the scalars (the step's figures, the gradient norm, each class's accuracy), and the
    end of the fit says where it wrote."""
    shares = {}
    for name, slowed, steps in (
        ("slow", ("SlowLoader", 0.05), ["--trainer.log_every_n_steps=4"]),
        ("fast", ("SlowSteps", 0.1), ["--trainer.log_every_n_steps=2", "--trainer.accumulate_grad_batches=2"]),
    ):
        with caplog.at_level(logging.INFO):
            cli_main(
                "fit", "--config", SMOKE, *run_args(tmp_path, name), "--data.synthetic_size=64", *steps,
                "--config", helper_callback(tmp_path, slowed[0], seconds=slowed[1]),
                "--trainer.logger=CSVLogger", f"--trainer.logger.save_dir={tmp_path / 'csv'}",
                f"--trainer.logger.name={name}",
            )  # fmt: skip
        written = tmp_path / "csv" / name / "version_0"
        assert f"CSVLogger: {written}" in caplog.text
        with (written / "metrics.csv").open() as file:
            rows = list(csv.DictReader(file))
        logged = {column for row in rows for column, value in row.items() if value}
        assert {"train/grad_norm", "perf/step/seconds", "perf/step/images_per_s", "val/acc_by_class/cat"} <= logged
        shares[name] = [float(row["perf/step/data_wait_share"]) for row in rows if row["perf/step/data_wait_share"]]
    assert len(shares["slow"]) == 2 and shares["slow"][1] > 0.5, shares
    assert len(shares["fast"]) == 2 and max(shares["fast"]) < 0.1, shares


def test_images_that_fail_to_draw_fail_the_run_at_its_end_and_the_images_wait_for_nothing(tmp_path, monkeypatch):
    """The images are drawn in a thread of their own: the validation goes on without them, and what stopped them
    is raised at the end of the fit."""
    drawn = threading.Event()

    def fails(*args):
        if not drawn.wait(20):
            raise AssertionError("the validation waited for its images to be drawn")
        raise RuntimeError("no room for the confusion matrix")

    monkeypatch.setattr(validation_report, "confusion_figure", fails)
    monkeypatch.setattr(ValidationReport, "on_validation_end", lambda self, trainer, pl_module: drawn.set())
    with pytest.raises(RuntimeError, match="no room for the confusion matrix"):
        cli_main("fit", "--config", SMOKE, *run_args(tmp_path), VALIDATION_IMAGES)


@pytest.mark.parametrize(
    ("name", "precision", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16-mixed", 989.4),
        ("NVIDIA H100 PCIe", "16-mixed", 756.5),
        ("NVIDIA H100 NVL", "32-true", 417.5),  # TF32: cuDNN's convolutions use it by default
        ("NVIDIA H200", "bf16-mixed", 989.4),  # which Lightning's table does not know
        ("NVIDIA H200 NVL", "bf16-mixed", 835.5),
        ("NVIDIA A100-SXM4-80GB", "32-true", 156.0),
        ("NVIDIA A100-PCIE-40GB", "16-mixed", 312.0),
        ("NVIDIA L4", "bf16-mixed", 121.0),
        ("NVIDIA L40S", "bf16-mixed", 362.05),  # which Lightning's table takes for an L4
    ],
)
def test_mfu_divides_by_the_devices_dense_peak_at_the_runs_precision(name, precision, tflops, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops(torch.device("cuda", 0), precision) == pytest.approx(tflops * 1e12)
    assert peak_flops(torch.device("cpu"), precision) is None
    if precision == "32-true":  # fp32 only where neither cuDNN nor the matrix multiplications may use TF32
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
        assert peak_flops(torch.device("cuda", 0), precision) < tflops * 1e12 / 5
