"""The speed path: torch.compile, configs/fast.yaml, the throughput line with MFU, and the C heap that keeps freed
memory."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO, SMOKE, cli_error, cli_main, run_args, run_cli
from lightning.fabric.utilities.throughput import measure_flops
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from multigpu.model.classifier import ImageClassifier
from multigpu.model.lazy_blocks import LazyBlocks
from multigpu.model.resnet import resnet50_block_factories

# TorchDynamo captures the network, and runs the captured graphs as they are: the wiring of
# torch.compile under test, without minutes of C++ code generation on this CPU.
EAGER_COMPILE = "--model.compile={backend: eager}"
# torch.compile's default backend, inductor, writes C++ kernels for the CPU and compiles them (a minute and a
# half for ResNet-50 here). Where no C++ compiler is found, the eager backend runs the same tests.
CXX = next(
    (path for name in (os.environ.get("CXX"), "g++", "c++", "clang++") if name and (path := shutil.which(name))), None
)
TRAINING_ONLY = ["--trainer.limit_val_batches=0"]  # no evaluation graph to compile as well
COMPILE = {"inductor": "--model.compile=true", "eager": EAGER_COMPILE}
BACKENDS = [
    pytest.param("inductor", marks=pytest.mark.skipif(CXX is None, reason="inductor compiles C++: no C++ compiler")),
    pytest.param("eager", marks=pytest.mark.skipif(CXX is not None, reason="inductor runs this test here")),
]


def _last(tmp_path) -> dict:
    return torch.load(tmp_path / "checkpoints" / "test" / "last.ckpt")


def test_flops_per_training_image_count_the_forward_and_backward_passes():
    net = nn.Sequential(*LazyBlocks(resnet50_block_factories(10, "cifar"), seed=0))  # on the meta device
    with torch.device("meta"):
        forward = measure_flops(net, lambda: net(torch.zeros(2, 3, 32, 32))) // 2
    training = ImageClassifier().training_flops_per_image()
    assert 2.9 * forward < training < 3.1 * forward  # backward costs about twice the forward
    assert 7e9 < training < 9e9  # ResNet-50 with the CIFAR stem at 32x32: 2.6 GFLOPs forward


def test_epoch_line_and_tensorboard_show_images_per_second_and_mfu(tmp_path, capsys):
    cli_main("fit", "--config", SMOKE, *run_args(tmp_path), "--throughput.peak_flops=1e12")
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch 0"))
    images_per_s = float(re.search(r"([\d.]+) img/s", line)[1])
    mfu = float(re.search(r"MFU ([\d.]+)%", line)[1])
    expected = 100 * images_per_s * ImageClassifier(arch="helpers.tiny_resnet").training_flops_per_image() / 1e12
    assert mfu == pytest.approx(expected, abs=0.1)
    events = EventAccumulator(str(next((tmp_path / "logs").rglob("events.out.tfevents*")).parent))
    events.Reload()
    assert {"perf/images_per_s", "perf/mfu"} <= set(events.Tags()["scalars"])


def test_without_a_known_peak_the_line_leaves_mfu_out(tmp_path, capsys):
    cli_main("fit", "--config", SMOKE, *run_args(tmp_path))
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch 0"))
    assert "img/s" in line and "MFU" not in line


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory) -> dict[str, str]:
    """An inductor cache of the tests' own: the kernels are compiled here, not read from an earlier run's."""
    return {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path_factory.mktemp("inductor"))}


def _first_loss(output: str) -> float:
    return float(re.search(r"^epoch 0 \| step 1 \| train/loss ([\d.]+)", output, re.MULTILINE)[1])


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_network_trains_with_the_plain_networks_loss_and_parameter_names(
    backend, tmp_path, kernel_cache, capsys
):
    # tiny_resnet: a network of the user's (``--model.arch``) through the compiler, ResNet-50's blocks in seconds.
    args = ["--config", SMOKE, *run_args(tmp_path), "--trainer.max_steps=1", *TRAINING_ONLY]
    compiled = run_cli("fit", *args, COMPILE[backend], timeout=900, env=kernel_cache)
    assert compiled.returncode == 0, compiled.stdout
    if backend == "inductor":
        assert list(Path(kernel_cache["TORCHINDUCTOR_CACHE_DIR"]).rglob("*.so"))  # C++ kernels written and built
    cli_main("fit", *args, "--run_name=plain")
    # A ResNet at its initial weights is ill-conditioned in float32 (ResNet-50's gradients move by 1% from
    # float64's at batch 8): the parameters after a step are no measure of the compiler; the forward pass is.
    assert _first_loss(compiled.stdout) == pytest.approx(_first_loss(capsys.readouterr().out), abs=2e-4)
    keys = _last(tmp_path)["state_dict"].keys()
    assert "net.0.0.weight" in keys and not any("_orig_mod" in key for key in keys)


@pytest.mark.slow
def test_compiled_network_trains_under_ddp(tmp_path):
    """DDP over the compiled network: TorchDynamo splits the graph at DDP's buckets. The eager backend runs the
    split graphs (inductor's kernels are the test above's; here they would take another minute to compile)."""
    result = run_cli(
        "fit",
        "--config",
        SMOKE,
        *run_args(tmp_path),
        EAGER_COMPILE,
        "--trainer.strategy=ddp",
        "--trainer.accelerator=cpu",
        "--trainer.devices=2",
        "--trainer.max_steps=1",
        *TRAINING_ONLY,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout
    assert _last(tmp_path)["global_step"] == 1


def test_fast_config_trains_on_the_cpu(tmp_path):
    """configs/fast.yaml (bf16, channels_last, data on the device), compiled here without code generation."""
    cli_main(
        "fit",
        "--config",
        SMOKE,
        "--config",
        str(REPO / "configs" / "fast.yaml"),
        *run_args(tmp_path),
        EAGER_COMPILE,
        "--trainer.max_steps=2",
    )
    last = _last(tmp_path)
    assert last["global_step"] == 2 and last["hyper_parameters"]["channels_last"]


@pytest.mark.parametrize("strategy", ["dp", "manual_model_parallel", "pipeline"])
def test_strategies_that_place_blocks_refuse_compile(strategy, tmp_path, capsys):
    error = cli_error(
        capsys, *run_args(tmp_path), "--model.compile=true", f"--trainer.strategy={strategy}", "--trainer.devices=2"
    )
    assert error == (
        f"error: strategy {strategy} places the network's blocks itself and cannot run --model.compile: "
        "drop it, or use ddp or one device."
    )


# main.py's lines before its command (runpy: not as ``__main__``), then 64 MiB blocks, each made and freed as a step's
# activations are (after one of 128 MiB); prints the pages the kernel faulted in for the last 10. The first few
# may each grow the heap (torch asks for a little more than a freed block of the same size leaves) before the
# holes serve them.
PAGE_FAULTS = """
import resource, runpy, sys, torch
runpy.run_path(sys.argv[1])
torch.ones(2**25).sum()
for _ in range(10):
    torch.ones(2**24).sum()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    torch.ones(2**24).sum()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _page_faults(env: dict) -> int:
    command = [sys.executable, "-c", PAGE_FAULTS, str(REPO / "main.py")]
    return int(subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout)


@pytest.mark.skipif(not hasattr(os, "confstr") or not os.confstr("CS_GNU_LIBC_VERSION"), reason="glibc's allocator")
def test_main_keeps_freed_memory_for_the_next_step_unless_the_user_opts_out():
    env = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_")}
    for name in ("GLIBC_TUNABLES", "LD_PRELOAD", "MULTIGPU_KEEP_FREED_MEMORY"):
        env.pop(name, None)
    kept = _page_faults(env)
    given_back = _page_faults({**env, "MULTIGPU_KEEP_FREED_MEMORY": "0"})
    assert given_back >= 10 * 2**24 * 4 // 4096 // 512  # every block faulted in again (4 KiB pages, or 2 MiB)
    assert kept <= given_back // 4  # the blocks reused as they were (none faulted in, here)
