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
"""

from typing import Literal

from torch import nn
from torchvision.models import resnet50

__all__ = ["NUM_BLOCKS", "Stem", "resnet50_blocks"]

Stem = Literal["cifar", "imagenet"]
NUM_BLOCKS = 18


def resnet50_blocks(num_classes: int = 10, stem: Stem = "cifar") -> nn.Sequential:
    """Build torchvision's ResNet-50 as ``nn.Sequential(stem, *bottlenecks, head)``.

    Args:
        num_classes: width of the final fully connected layer.
        stem: ``"cifar"`` replaces the 7x7 stride-2 convolution and the max-pool by one
            3x3 stride-1 convolution, which keeps the 32x32 resolution of CIFAR images;
            ``"imagenet"`` keeps torchvision's own stem.
    """
    net = resnet50(weights=None, num_classes=num_classes)
    if stem == "cifar":
        # Same init as torchvision applies to its own convolutions.
        conv = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")
        first = nn.Sequential(conv, net.bn1, net.relu)
    elif stem == "imagenet":
        first = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool)
    else:
        raise ValueError(f"stem must be 'cifar' or 'imagenet', not {stem!r}")
    bottlenecks = [*net.layer1, *net.layer2, *net.layer3, *net.layer4]
    head = nn.Sequential(net.avgpool, nn.Flatten(1), net.fc)
    return nn.Sequential(first, *bottlenecks, head)
