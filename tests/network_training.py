"""Train one network of each torchvision family for 2 steps under a layout, and save every network's parameters and
buffers.

Run as a script (Lightning relaunches it once per process):

    python tests/network_training.py LAYOUT[,LAYOUT...] OUT_DIR    # the layouts of one process count

Every layout trains the same global batch of 16 in forward groups of 8 images (one device accumulating 2 batches,
2 micro-batches of a pipeline, 2 data-parallel processes), so that BatchNorm sees the same groups everywhere, on one
thread per process. The networks are torchvision's smallest of each family, at CIFAR's 32x32, with their dropout
off; where a family's smallest is large or slow to build (VGG's classifier, ConvNeXt, DenseNet, ViT), a few
layers of its own class, which ``--model.arch`` splits by the same rule (``tiny_*`` below, reachable as
``network_training.tiny_vit`` and so on).
"""

import gc

if __name__ == "__main__":
    gc.disable()  # while the imports run, as in main.py

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torchvision
from helpers import bare_trainer, fit_in_order
from lightning.pytorch import seed_everything
from run_layouts import LAYOUTS
from torch import nn
from torch.utils.data import Subset
from torchvision.models import VGG, ConvNeXt, DenseNet, VisionTransformer
from torchvision.models.convnext import CNBlockConfig
from torchvision.models.vgg import make_layers
from torchvision.ops import StochasticDepth

from multigpu.data.synthetic import SyntheticCIFAR10
from multigpu.model.classifier import ImageClassifier
from multigpu.run.process_groups import end_process_groups

STEPS = 2


def _without_dropout(name: str) -> Callable[[int], nn.Module]:
    """torchvision's ``name`` with its dropout and stochastic depth off: their masks come from each process's
    generator, so a layout draws others than one device (docs/networks.md)."""

    def build(num_classes: int) -> nn.Module:
        network = torchvision.models.get_model(name, num_classes=num_classes)
        for module in network.modules():
            if isinstance(module, (nn.Dropout, StochasticDepth)):
                module.p = 0.0
        return network

    return build


mobilenet_v2, mobilenet_v3_small, efficientnet_b0 = map(
    _without_dropout, ["mobilenet_v2", "mobilenet_v3_small", "efficientnet_b0"]
)


def tiny_vgg(num_classes: int) -> nn.Module:
    """VGG's class with a narrow classifier: ``VGG.__init__`` would build (and initialise) its 120-million-parameter
    one first, a second per build."""
    network = VGG.__new__(VGG)
    nn.Module.__init__(network)
    network.features = make_layers([16, "M", 32, "M"], batch_norm=True)
    network.avgpool = nn.AdaptiveAvgPool2d((7, 7))
    network.classifier = nn.Sequential(nn.Linear(32 * 7 * 7, 32), nn.ReLU(True), nn.Linear(32, num_classes))
    return network


def tiny_densenet(num_classes: int) -> nn.Module:
    return DenseNet(growth_rate=8, block_config=(2, 2), num_init_features=16, num_classes=num_classes)


def tiny_convnext(num_classes: int) -> nn.Module:
    return ConvNeXt([CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 1)], num_classes=num_classes)


def tiny_vit(num_classes: int) -> nn.Module:
    return VisionTransformer(32, 8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32, num_classes=num_classes)


ARCHS = [
    "resnet18",
    "network_training.tiny_vgg",
    "network_training.mobilenet_v2",
    "network_training.mobilenet_v3_small",
    "network_training.efficientnet_b0",
    "regnet_x_400mf",
    "network_training.tiny_convnext",
    "network_training.tiny_densenet",
    "shufflenet_v2_x0_5",
    "network_training.tiny_vit",
]
BATCH, GROUP = 16, 8  # the global batch, and the images of one forward pass (run_layouts.LAYOUTS says the same)
TRAINED_UNDER = ("one_device", "mmp", "pipe_1f1b", "pipe_interleaved", "ddp", "fsdp")  # run_layouts.LAYOUTS


def _group_of(position: int, replicas: int = 2) -> int:
    """The sample at ``position`` of a dataset that 2 replicas read in turns (``DistributedSampler`` unshuffled:
    replica r reads positions r, r + 2, ...), so that each reads in one batch what one device reads in one group."""
    replica, index = position % replicas, position // replicas
    step, within = divmod(index, GROUP)
    return step * BATCH + replica * GROUP + within


def train(layout: str, archs: list[str]) -> dict | None:
    """Every network of ``archs`` trained under ``layout``: their state dicts and what each process held (on the
    first process; None on the others)."""
    chosen = LAYOUTS[layout]
    trained, held = {}, {}
    for arch in archs:
        seed_everything(0)
        model = ImageClassifier(arch=arch, batch_size=chosen.batch_size, warmup_epochs=0, weight_decay=0)
        trainer = bare_trainer(
            chosen.trainer_strategy(), chosen.devices, STEPS, accumulate_grad_batches=chosen.accumulate
        )
        data = SyntheticCIFAR10(BATCH * STEPS, seed=1)
        if chosen.replicas > 1:  # replica r's k-th batch: one device's k-th step's r-th group
            data = Subset(data, [_group_of(position) for position in range(len(data))])
        fit_in_order(trainer, model, data, chosen.batch_size)
        state = trainer.strategy.lightning_module_state_dict()  # on every rank: a pipeline gathers its stages
        if trainer.is_global_zero:
            trained[arch] = {key: value.cpu() for key, value in state.items()}
        # The parameters each process holds (a pipeline's stage holds its own blocks alone).
        own = sum(parameter.numel() for parameter in model.net.parameters() if not parameter.is_meta)
        held[arch] = [own]
        if dist.is_initialized():
            held[arch] = [None] * dist.get_world_size()
            dist.all_gather_object(held[arch], own)
    return {"trained": trained, "held": held} if trainer.is_global_zero else None


def main(layouts: str, out_dir: str, archs: str = ",".join(ARCHS)) -> None:
    """Train under each of ``layouts`` in turn, in the same processes (each launch costs seconds), and write
    ``OUT_DIR/<layout>.pt``."""
    torch.set_num_threads(1)
    for layout in layouts.split(","):
        if (result := train(layout, archs.split(","))) is not None:
            torch.save(result, Path(out_dir) / f"{layout}.pt")
    end_process_groups()


if __name__ == "__main__":
    gc.freeze()  # as main.py does
    gc.enable()
    main(*sys.argv[1:])
