"""``--model.compile=true`` with torch.compile's default backend, inductor, which writes and compiles C++ kernels
for the CPU (the other compile tests use the eager backend: the wiring without the code generation)."""

import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from conftest import SMOKE, cli_main, run_args, run_cli

CXX = next((path for name in (os.environ.get("CXX"), "g++", "c++", "clang++") if name and (path := shutil.which(name))),
           None)
pytestmark = pytest.mark.skipif(CXX is None, reason="inductor compiles C++ kernels on the CPU: no C++ compiler here")


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory) -> Path:
    """One inductor cache for the module: kernels compiled by one test are reused by the next."""
    return tmp_path_factory.mktemp("inductor")


def _first_loss(output: str) -> float:
    return float(re.search(r"^epoch 0 \| step 1 \| train/loss ([\d.]+)", output, re.MULTILINE)[1])


def test_inductor_trains_one_device_with_the_loss_of_the_uncompiled_network(tmp_path, kernel_cache, capsys):
    args = ["--config", SMOKE, *run_args(tmp_path), "--trainer.max_steps=1"]
    compiled = run_cli("fit", *args, "--model.compile=true", timeout=900,
                       env={"TORCHINDUCTOR_CACHE_DIR": str(kernel_cache)})
    assert compiled.returncode == 0, compiled.stdout
    assert list(kernel_cache.rglob("*.so"))  # C++ kernels written and compiled
    cli_main("fit", *args, "--run_name=eager")
    # ResNet-50 at its initial weights is ill-conditioned in float32 (its gradients move by 1% from float64's
    # at batch 8): the parameters after a step are no measure of the compiler; the forward pass is.
    assert _first_loss(compiled.stdout) == pytest.approx(_first_loss(capsys.readouterr().out), abs=2e-4)
    last = torch.load(tmp_path / "checkpoints" / "test" / "last.ckpt")
    assert last["global_step"] == 1 and not any("_orig_mod" in key for key in last["state_dict"])


def test_inductor_trains_under_ddp(tmp_path, kernel_cache):
    result = run_cli("fit", "--config", SMOKE, *run_args(tmp_path), "--model.compile=true", "--trainer.strategy=ddp",
                     "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.max_steps=1", timeout=900,
                     env={"TORCHINDUCTOR_CACHE_DIR": str(kernel_cache)})
    assert result.returncode == 0, result.stdout
    assert "epoch 0 | step 1 | train/loss" in result.stdout
    assert torch.load(tmp_path / "checkpoints" / "test" / "last.ckpt")["global_step"] == 1
