"""The application trains as a plain PyTorch loop does, step by step.

``main.py fit`` runs as a user runs it (official-format files, a persistent loader worker, warm-up then
cosine across an epoch boundary), and records its weights after each step (``helpers.RecordSteps``).
``benchmarks/plain_cifar10.py`` then trains torchvision's ``resnet50`` from the same initial weights, on the
same images in the same order with the same augmentation seeds (the app's sampler gives the indices; the
images are read, decoded and augmented by torchvision there), with its own optimizer, schedule and loop.
After every step the parameters, BatchNorm's running statistics and the learning rate must agree.

Every process computes on one thread: the two sides then run the same kernels in the same order, and agree
bit for bit. They must: one rounding of difference in the input pixels is enough for two runs of this network
to part by 14% in a BatchNorm bias after a single step (docs/learning.md), so "close" would prove nothing.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    HELPERS_ENV,
    REPO,
    RESNET50,
    SMOKE,
    free_port,
    helper_callback,
    run_args,
    run_cli,
    write_tiny_cifar10,
)

STEPS = 7  # 5 steps an epoch: the warm-up (1 epoch), the cosine and the second epoch's new order and augmentation
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
PLAIN = REPO / "benchmarks" / "plain_cifar10.py"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_tiny_cifar10(tmp_path_factory.mktemp("parity") / "cifar", per_batch=8, test=8)  # 40 training images


def train_app(tmp_path: Path, data: Path, *options: str) -> Path:
    """``main.py fit`` for ``STEPS`` steps with ``options``; the folder of its recorded steps."""
    record = tmp_path / "app"
    result = run_cli(
        "fit",
        "--config", SMOKE,
        "--config", helper_callback(tmp_path, "RecordSteps", out_dir=record, steps=STEPS),
        *run_args(tmp_path), *RESNET50,  # the promise: the application's ResNet-50 learns as the plain loop's
        "--data.synthetic=false", f"--data.data_dir={data}", "--data.download=false",
        "--data.verify_checksums=false", "--data.num_workers=1", "--data.persistent_workers=true",
        "--data.shuffle_seed=3", "--trainer.max_epochs=2", f"--trainer.max_steps={STEPS}", "--model.warmup_epochs=1",
        *options,
        env={**HELPERS_ENV, **ONE_THREAD},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout
    return record


def train_plain(tmp_path: Path, data: Path, init: Path, name: str, *options: str, processes: int = 1) -> Path:
    """The plain loop from the weights in ``init``, on the app's order and seeds; the folder of its steps."""
    record = tmp_path / name
    launch = [sys.executable]
    if processes > 1:
        launch += ["-m", "torch.distributed.run", f"--nproc-per-node={processes}", f"--master-port={free_port()}"]
    command = [
        *launch, str(PLAIN), f"--data-dir={data}", "--epochs=2", f"--max-steps={STEPS}", "--warmup-epochs=1",
        "--stem=imagenet", "--workers=1", "--order=app", "--shuffle-seed=3", f"--init={init}",
        f"--record={record}", f"--record-steps={STEPS}", "--no-eval", *options,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), **ONE_THREAD}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return record


def initial_weights(app: Path) -> Path:
    """The app's initial weights as a torchvision state dict, for the plain loop's ``--init``."""
    path = app.parent / "init_torchvision.pt"
    torch.save(torch.load(app / "init.pt")["state"], path)
    return path


def largest_differences(app: Path, plain: Path) -> list[dict[str, float]]:
    """Per step: the learning rates' difference, and the largest difference of any parameter and of any BatchNorm
    buffer over that tensor's largest value."""
    steps = []
    for step in range(1, STEPS + 1):
        ours, theirs = torch.load(app / f"step{step}.pt"), torch.load(plain / f"step{step}.pt")
        assert ours["state"].keys() == theirs["state"].keys()
        worst = {"lr": abs(ours["lr"] - theirs["lr"]), "parameters": 0.0, "buffers": 0.0}
        for key, tensor in ours["state"].items():
            other = theirs["state"][key].to(tensor.dtype)
            kind = "buffers" if "running_" in key or "num_batches_tracked" in key else "parameters"
            scale = other.abs().max().clamp_min(1e-30) if tensor.is_floating_point() else 1
            worst[kind] = max(worst[kind], float((tensor - other).abs().max() / scale))
        steps.append(worst)
    print("\n".join(f"step {step}: {worst}" for step, worst in enumerate(steps, 1)))
    return steps


@pytest.mark.slow
def test_one_device_trains_as_the_plain_loop_step_by_step(tmp_path, data):
    app = train_app(tmp_path, data, "--data.batch_size=8")
    plain = train_plain(tmp_path, data, initial_weights(app), "plain", "--batch-size=8")
    for worst in largest_differences(app, plain):
        assert worst == {"lr": 0.0, "parameters": 0.0, "buffers": 0.0}


@pytest.mark.slow
def test_ddp_trains_as_the_plain_ddp_loop_and_keeps_one_devices_statistics(tmp_path, data):
    """``ddp`` over 2 processes against the plain loop under torch's ``DistributedDataParallel`` (2 processes,
    gloo, the app's ``DistributedSampler``): the same parameters and learning rate after every step.

    BatchNorm's running statistics differ from that loop's by design: a plain DDP loop keeps the first
    process's (``broadcast_buffers``), the app keeps those one device makes running the step's micro-batches in
    order (``multigpu.model.step_batch_norm``). So the app is also held against the plain loop on one process that
    accumulates the two micro-batches: its parameters and its running statistics."""
    app = train_app(tmp_path, data, "--data.batch_size=4", "--trainer.strategy=ddp", "--trainer.devices=2")
    init = initial_weights(app)
    plain_ddp = train_plain(tmp_path, data, init, "plain_ddp", "--batch-size=4", processes=2)
    for worst in largest_differences(app, plain_ddp):
        assert worst["lr"] == 0.0 and worst["parameters"] == 0.0
    accumulating = train_plain(tmp_path, data, init, "plain_accumulating", "--batch-size=4", "--accumulate=2")
    for worst in largest_differences(app, accumulating):
        assert worst["lr"] == 0.0 and worst["parameters"] <= 1e-6 and worst["buffers"] <= 1e-5
