"""ResNet-50 from torchvision, laid out as a flat sequence of blocks.

The contract every strategy relies on: ``resnet50_blocks()`` returns an
``nn.Sequential`` whose children are, in order,

    index 0        the stem (conv, BatchNorm, ReLU; plus max-pool for ``stem="imagenet"``)
    index 1 .. 32  the 16 bottlenecks of layer1..layer4 (3 + 4 + 6 + 3), each as two blocks:
                   ``BottleneckEntry`` (conv1, conv2) and ``BottleneckExit`` (conv3, the shortcut)
    index 33       the head: adaptive average pool, flatten, fully connected layer

Each block takes the previous block's output as its only input, so a strategy
may place or split the network at any block index. An entry passes its input on
beside its output, as the pair ``(out, identity)`` that its exit adds up: a bottleneck
in two halves lets a split fall inside one, and ResNet-50's last bottlenecks hold a
quarter of its parameters each. Parameter names follow the index (``0.0.weight``,
``5.conv1.weight``, ...), so a state dict is the same whichever strategy trained it.

The blocks are built by ``resnet50_block_factories()``, one function per block, so
that a strategy can build each block alone where it goes (see ``lazy_blocks``):
``ImageClassifier`` holds them as ``LazyBlocks`` on the meta device until
``configure_model``. The layers are torchvision's own (its ``conv1x1``, ``conv3x3``),
computed in the order of its ``Bottleneck``, with torchvision's initialisation.

``bottleneck_block_factories(layers, width, ...)`` builds the same blocks for another depth and width: the tests
whose promise is about a strategy, a checkpoint or the loop train such a network, of 4 to 8 channels per bottleneck
(``tests/helpers.py``'s ``tiny_resnet``), through the very classes ResNet-50 is made of.
"""

from collections.abc import Callable
from functools import partial
from typing import Literal

from torch import Tensor, nn
from torchvision.models.resnet import Bottleneck, conv1x1, conv3x3

from multigpu.model.lazy_blocks import BlockFactory, LazyBlocks

__all__ = [
    "LAYERS",
    "NUM_BLOCKS",
    "BottleneckEntry",
    "BottleneckExit",
    "Layers",
    "Stem",
    "bottleneck_block_factories",
    "resnet50_block_factories",
    "resnet50_blocks",
]

Stem = Literal["cifar", "imagenet"]
Layers = tuple[tuple[int, int, int], ...]
NUM_BLOCKS = 34
LAYERS: Layers = ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2))  # planes, bottlenecks, stride of the first


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


def _stem(stem: Stem, width: int) -> nn.Module:
    if stem == "cifar":
        return nn.Sequential(
            nn.Conv2d(3, width, 3, stride=1, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)
        )
    return nn.Sequential(
        nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
    )


class BottleneckEntry(nn.Module):
    """The first half of torchvision's ``Bottleneck``: 1x1 and 3x3 convolutions, each with BatchNorm and ReLU.

    Returns ``(out, x)``: its input goes on to the ``BottleneckExit`` for the shortcut.
    """

    def __init__(self, inplanes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out))), x


class BottleneckExit(nn.Module):
    """The second half of torchvision's ``Bottleneck``: the 1x1 expansion, the shortcut (downsampled
    where the shape changes), their sum and the ReLU."""

    def __init__(self, inplanes: int, planes: int, stride: int) -> None:
        super().__init__()
        width = planes * Bottleneck.expansion
        self.conv3 = conv1x1(planes, width)
        self.bn3 = nn.BatchNorm2d(width)
        self.downsample = None
        if stride != 1 or inplanes != width:
            self.downsample = nn.Sequential(conv1x1(inplanes, width, stride), nn.BatchNorm2d(width))
        self.relu = nn.ReLU(inplace=True)

    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        out, identity = pair
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(identity)
        return self.relu(out + identity)


def _head(features: int, num_classes: int) -> nn.Module:
    return nn.Sequential(nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(1), nn.Linear(features, num_classes))


def bottleneck_block_factories(
    layers: Layers, width: int, num_classes: int = 10, stem: Stem = "cifar"
) -> list[BlockFactory]:
    """One function per block of a bottleneck ResNet laid out as ResNet-50 (stem, bottleneck halves, head), each
    building its block alone, initialised as torchvision does.

    Args:
        layers: per stage, its planes (a bottleneck's inner width), its bottlenecks and the stride of the first.
        width: the stem's output channels.
        num_classes: width of the final fully connected layer.
        stem: ``"cifar"`` replaces the 7x7 stride-2 convolution and the max-pool by one
            3x3 stride-1 convolution, which keeps the 32x32 resolution of CIFAR images;
            ``"imagenet"`` keeps torchvision's own stem.
    """
    if stem not in ("cifar", "imagenet"):
        raise ValueError(f"stem must be 'cifar' or 'imagenet', not {stem!r}")
    builds: list[Callable[[], nn.Module]] = [partial(_stem, stem, width)]
    inplanes = width
    for planes, count, stride in layers:
        for index in range(count):
            first_stride = stride if index == 0 else 1
            builds += [partial(half, inplanes, planes, first_stride) for half in (BottleneckEntry, BottleneckExit)]
            inplanes = planes * Bottleneck.expansion
    builds.append(partial(_head, inplanes, num_classes))
    return [partial(_init_like_torchvision, build) for build in builds]


def resnet50_block_factories(num_classes: int = 10, stem: Stem = "cifar") -> list[BlockFactory]:
    """One function per block of torchvision's ResNet-50 (see ``bottleneck_block_factories``)."""
    return bottleneck_block_factories(LAYERS, 64, num_classes, stem)


def resnet50_blocks(num_classes: int = 10, stem: Stem = "cifar") -> LazyBlocks:
    """ResNet-50 as ``nn.Sequential(stem, *bottleneck_halves, head)``, every block built now on the default device."""
    net = LazyBlocks(resnet50_block_factories(num_classes, stem))
    net.materialize()
    return net
