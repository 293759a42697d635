"""ResNet-50 from torchvision, laid out as a flat sequence of blocks.

The contract every strategy relies on: ``resnet50_blocks()`` returns an
``nn.Sequential`` whose children are, in order,

    index 0        the stem (conv, BatchNorm, ReLU; plus max-pool for ``stem="imagenet"``)
    index 1 .. 16  the 16 bottleneck blocks of layer1..layer4 (3 + 4 + 6 + 3)
    index 17       the head: adaptive average pool, flatten, fully connected layer

Each block takes the previous block's output as its only input, so a strategy
may place or split the network at any block index. Parameter names follow
the index (``0.0.weight``, ``5.conv1.weight``, ...), so a state dict is the
same whichever strategy trained it.

The blocks are built by ``resnet50_block_factories()``, one function per block, so
that a strategy can build each block alone where it goes (see ``deferred_blocks``):
``ResNet50Classifier`` holds them as ``DeferredBlocks`` on the meta device until
``configure_model``. The blocks are torchvision's own (``Bottleneck``, its
``conv1x1``), with torchvision's initialisation.
"""

from collections.abc import Callable
from functools import partial
from typing import Literal

from torch import nn
from torchvision.models.resnet import Bottleneck, conv1x1

from multigpu.deferred_blocks import BlockFactory, DeferredBlocks

__all__ = ["NUM_BLOCKS", "Stem", "resnet50_block_factories", "resnet50_blocks"]

Stem = Literal["cifar", "imagenet"]
NUM_BLOCKS = 18
_LAYERS = ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2))  # planes, bottlenecks, stride of the first


def _init_like_torchvision(build: Callable[[], nn.Module]) -> nn.Module:
    """Build a block and initialise it as torchvision's ``ResNet.__init__`` does (linear layers keep their own)."""
    block = build()
    for module in block.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(module, nn.BatchNorm2d):
            nn.init.constant_(module.weight, 1)
            nn.init.constant_(module.bias, 0)
    return block


def _stem(stem: Stem) -> nn.Module:
    if stem == "cifar":
        return nn.Sequential(nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True))
    return nn.Sequential(
        nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
        nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
    )


def _bottleneck(inplanes: int, planes: int, stride: int) -> nn.Module:
    downsample = None
    if stride != 1 or inplanes != planes * Bottleneck.expansion:
        downsample = nn.Sequential(conv1x1(inplanes, planes * Bottleneck.expansion, stride),
                                   nn.BatchNorm2d(planes * Bottleneck.expansion))
    return Bottleneck(inplanes, planes, stride, downsample)


def _head(num_classes: int) -> nn.Module:
    return nn.Sequential(nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(1), nn.Linear(512 * Bottleneck.expansion, num_classes))


def resnet50_block_factories(num_classes: int = 10, stem: Stem = "cifar") -> list[BlockFactory]:
    """One function per block of torchvision's ResNet-50, each building its block alone, initialised as
    torchvision does.

    Args:
        num_classes: width of the final fully connected layer.
        stem: ``"cifar"`` replaces the 7x7 stride-2 convolution and the max-pool by one
            3x3 stride-1 convolution, which keeps the 32x32 resolution of CIFAR images;
            ``"imagenet"`` keeps torchvision's own stem.
    """
    if stem not in ("cifar", "imagenet"):
        raise ValueError(f"stem must be 'cifar' or 'imagenet', not {stem!r}")
    builds: list[Callable[[], nn.Module]] = [partial(_stem, stem)]
    inplanes = 64
    for planes, count, stride in _LAYERS:
        for index in range(count):
            builds.append(partial(_bottleneck, inplanes, planes, stride if index == 0 else 1))
            inplanes = planes * Bottleneck.expansion
    builds.append(partial(_head, num_classes))
    return [partial(_init_like_torchvision, build) for build in builds]


def resnet50_blocks(num_classes: int = 10, stem: Stem = "cifar") -> DeferredBlocks:
    """ResNet-50 as ``nn.Sequential(stem, *bottlenecks, head)``, every block built now on the default device."""
    net = DeferredBlocks(resnet50_block_factories(num_classes, stem))
    net.materialize()
    return net
