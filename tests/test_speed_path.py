"""The speed path: torch.compile, configs/fast.yaml, and the throughput line with MFU."""

import re

import pytest
import torch
from lightning.fabric.utilities.throughput import measure_flops
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from conftest import REPO, SMOKE, cli_error, cli_main, run_args, run_cli
from multigpu.deferred_blocks import DeferredBlocks
from multigpu.model import ResNet50Classifier
from multigpu.network import resnet50_block_factories

# TorchDynamo captures the network, and runs the captured graphs as they are: the wiring of
# torch.compile under test, without minutes of C++ code generation on this CPU.
EAGER_COMPILE = "--model.compile={backend: eager}"


def _last(tmp_path) -> dict:
    return torch.load(tmp_path / "checkpoints" / "test" / "last.ckpt")


def test_flops_per_training_image_count_the_forward_and_backward_passes():
    net = nn.Sequential(*DeferredBlocks(resnet50_block_factories(10, "cifar"), seed=0))  # on the meta device
    with torch.device("meta"):
        forward = measure_flops(net, lambda: net(torch.zeros(2, 3, 32, 32))) // 2
    training = ResNet50Classifier().training_flops_per_image()
    assert 2.9 * forward < training < 3.1 * forward  # backward costs about twice the forward
    assert 7e9 < training < 9e9  # ResNet-50 with the CIFAR stem at 32x32: 2.6 GFLOPs forward


def test_epoch_line_and_tensorboard_show_images_per_second_and_mfu(tmp_path, capsys):
    cli_main("fit", "--config", SMOKE, *run_args(tmp_path), "--throughput.peak_flops=1e12")
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch 0"))
    images_per_s = float(re.search(r"([\d.]+) img/s", line)[1])
    mfu = float(re.search(r"MFU ([\d.]+)%", line)[1])
    expected = 100 * images_per_s * ResNet50Classifier(stem="imagenet").training_flops_per_image() / 1e12
    assert mfu == pytest.approx(expected, abs=0.1)
    events = EventAccumulator(str(next((tmp_path / "logs").rglob("events.out.tfevents*")).parent))
    events.Reload()
    assert {"perf/images_per_s", "perf/mfu"} <= set(events.Tags()["scalars"])


def test_without_a_known_peak_the_line_leaves_mfu_out(tmp_path, capsys):
    cli_main("fit", "--config", SMOKE, *run_args(tmp_path))
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch 0"))
    assert "img/s" in line and "MFU" not in line


def test_compiled_network_trains_and_keeps_plain_parameter_names(tmp_path):
    torch._dynamo.reset()
    cli_main("fit", "--config", SMOKE, *run_args(tmp_path), EAGER_COMPILE, "--trainer.max_steps=2")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the network was captured
    keys = _last(tmp_path)["state_dict"].keys()
    assert "net.0.0.weight" in keys and not any("_orig_mod" in key for key in keys)


def test_compiled_network_trains_under_ddp(tmp_path):
    result = run_cli("fit", "--config", SMOKE, *run_args(tmp_path), EAGER_COMPILE, "--trainer.strategy=ddp",
                     "--trainer.accelerator=cpu", "--trainer.devices=2")
    assert result.returncode == 0, result.stdout
    assert _last(tmp_path)["global_step"] == 2  # 32 images, 2 processes x 8 per step


def test_fast_config_trains_on_the_cpu(tmp_path):
    """configs/fast.yaml (bf16, channels_last, data on the device), compiled here without code generation."""
    cli_main("fit", "--config", SMOKE, "--config", str(REPO / "configs" / "fast.yaml"), *run_args(tmp_path),
             EAGER_COMPILE, "--trainer.max_steps=2")
    last = _last(tmp_path)
    assert last["global_step"] == 2 and last["hyper_parameters"]["channels_last"]


@pytest.mark.parametrize("strategy", ["dp", "manual_model_parallel", "pipeline"])
def test_strategies_that_place_blocks_refuse_compile(strategy, tmp_path, capsys):
    error = cli_error(capsys, *run_args(tmp_path), "--model.compile=true", f"--trainer.strategy={strategy}",
                      "--trainer.devices=2")
    assert error == (
        f"error: strategy {strategy} places the network's blocks itself and cannot run it compiled: "
        "drop --model.compile, or use ddp or one device."
    )
