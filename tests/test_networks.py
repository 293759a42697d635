"""Any torchvision classifier, split into blocks (``multigpu.model.architectures``), trains under every strategy as
on one device; a network that is not a chain of its children, or a name that is not a network, is refused."""

import logging
import os
import subprocess
import sys

import pytest
import torch
from helpers import REPO, assert_within_scale, cli_error
from network_training import ARCHS, TRAINED_UNDER
from torch import nn

from multigpu.errors import UsageError
from multigpu.model.architectures import network_blocks
from multigpu.model.lazy_blocks import LazyBlocks


@pytest.mark.internals  # the families' forward, attribute by attribute: on the lowest torchvision too
@pytest.mark.parametrize("arch", ["resnet18", "mobilenet_v3_small", "shufflenet_v2_x0_5", "regnet_x_400mf"])
def test_a_torchvision_network_splits_into_blocks_that_chain_to_its_forward(arch):
    """The check at build time passes (the chain equals the network's forward bit for bit), and a block built alone,
    as each stage of a split run builds its own, starts from the weights it has in the whole network."""
    torch.manual_seed(0)
    factories = network_blocks(arch, num_classes=7, image_size=32)
    whole = LazyBlocks(factories, seed=1)
    whole.materialize()
    assert len(whole) > 4
    for index in (len(whole) - 1, 0):  # the last block first: nothing shared with an earlier build
        alone = whole.build(index).state_dict()
        assert alone.keys() == whole[index].state_dict().keys()
        torch.testing.assert_close(
            alone, whole[index].state_dict(), rtol=0, atol=0, msg=lambda message, index=index: f"{index}: {message}"
        )
    assert whole(torch.zeros(2, 3, 32, 32)).shape == (2, 7)


def test_a_vit_says_what_it_chose_for_the_image_size(caplog):
    with caplog.at_level(logging.INFO):
        network_blocks("vit_b_16", num_classes=10, image_size=32)
    assert (
        "model.arch=vit_b_16 at 32x32: 4 patches of 16x16 pixels (2x2) and the class token, 12 encoder layers of "
        "width 768." in caplog.text
    )


def chain_of_three(num_classes: int) -> nn.Module:
    """A user's network handed over as the contract says: an nn.Sequential of its blocks."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes)
    )


class TwoPaths(nn.Module):
    """A user's network whose forward is not the chain of its children."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.left, self.right = nn.Conv2d(3, 4, 1), nn.Conv2d(3, 4, 1)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes))

    def forward(self, x):
        return self.head(torch.cat([self.left(x), self.right(x)], dim=1))


def two_paths(num_classes: int) -> nn.Module:
    return TwoPaths(num_classes)


def test_a_users_sequential_network_is_split_into_its_blocks():
    blocks = LazyBlocks(network_blocks("test_networks.chain_of_three", num_classes=3))
    blocks.materialize()
    assert [type(block).__name__ for block in blocks] == ["Sequential", "Linear"]  # ReLU, pool, flatten join
    assert blocks(torch.zeros(2, 3, 8, 8)).shape == (2, 3)


@pytest.mark.parametrize(
    ("arch", "refusal"),
    [
        ("resnet19", "model.arch=resnet19 is not a torchvision classifier (did you mean resnet18?)"),
        ("test_networks.two_paths", "model.arch=test_networks.two_paths: its forward is not the chain of its 3 "),
        ("googlenet", "model.arch=googlenet: its forward is not the chain of its"),
        ("alexnet", "model.arch=alexnet does not take 32x32 images: "),
        ("test_networks.missing", "model.arch=test_networks.missing: module 'test_networks' has no attribute"),
    ],
)
def test_a_network_that_cannot_be_split_is_refused_in_one_line(arch, refusal):
    with pytest.raises(UsageError) as error:
        network_blocks(arch, num_classes=10, image_size=32)
    assert str(error.value).startswith(refusal) and "\n" not in str(error.value)


def test_the_command_line_refuses_an_unknown_network_before_anything_runs(capsys, tmp_path):
    error = cli_error(capsys, "--model.arch=resnet19", f"--checkpoint_root={tmp_path}")
    assert error.startswith("error: model.arch=resnet19 is not a torchvision classifier (did you mean resnet18?)")
    assert not any(tmp_path.iterdir())


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, dict]:
    """``network_training.py LAYOUT`` for every layout: each family's network after 2 steps, and what each process
    held."""
    folder = tmp_path_factory.mktemp("networks")
    for layouts in ("one_device,mmp", "pipe_1f1b,pipe_interleaved,ddp,fsdp"):  # one process, then two
        command = [sys.executable, str(REPO / "tests" / "network_training.py"), layouts, str(folder)]
        one_thread = {**os.environ, "OMP_NUM_THREADS": "1"}  # model parallel's stage threads too: the same sums
        done = subprocess.run(command, cwd=REPO / "tests", env=one_thread, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
    return {layout: torch.load(folder / f"{layout}.pt") for layout in TRAINED_UNDER}


@pytest.mark.slow
@pytest.mark.parametrize("layout", [layout for layout in TRAINED_UNDER if layout != "one_device"])
def test_every_family_trains_under_every_strategy_as_on_one_device(layout, trained):
    """Every parameter and buffer of every family's network after 2 steps, within 1e-5 of its tensor's largest
    value (bit for bit where the sums come in the same order). Prints each network's largest difference (the table
    of docs/networks.md: ``pytest tests/test_networks.py -m slow -s``)."""
    reference, found = trained["one_device"]["trained"], trained[layout]["trained"]
    assert found.keys() == reference.keys() == set(ARCHS)
    for arch, state in reference.items():
        worst = assert_within_scale(found[arch], state, 1e-5, f"{layout}, {arch}")
        print(f"{layout} {arch}: largest difference {worst:.1e}")


@pytest.mark.slow
def test_each_pipeline_stage_holds_its_own_share_of_every_network(trained):
    """Each of the 2 stages holds part of the parameters, and together exactly the network's."""
    for arch in ARCHS:
        total = sum(tensor.numel() for key, tensor in trained["one_device"]["trained"][arch].items())
        whole = trained["one_device"]["held"][arch][0]
        stages = trained["pipe_1f1b"]["held"][arch]
        assert len(stages) == 2 and all(0 < stage < whole for stage in stages), arch
        assert sum(stages) == whole <= total, arch
