"""Any torchvision classifier (``--model.arch``), or a network of the user's, as the sequence of blocks that every
strategy places, splits, recomputes and times.

``network_blocks(arch, ...)`` returns one factory per block. ``resnet50``, the default, keeps its own layout
(``multigpu.model.resnet``: the CIFAR stem, each bottleneck in two halves). Every other network is built by
torchvision and split into its children in forward order:

- an ``nn.Sequential`` container (VGG's ``features``, EfficientNet's stages) is opened into its children;
- where a family's forward computes something between its children, a rule adds it as a module of its own:
  the flatten before the head (ResNet, VGG, MobileNet, EfficientNet, RegNet, AlexNet, SqueezeNet), the global
  pooling that a forward does with a function (MobileNet V2, DenseNet, ShuffleNet, MNASNet), ViT's patches,
  class token and position embedding before its encoder layers, and its class token's output after them;
- a module without parameters (an activation, a pooling, a flatten) joins the block before it.

The chain of blocks is checked against the network's own forward once per process, bit for bit, on two images of
the run's size on the CPU: a network whose forward is not a chain of its children is refused in one line. That is
the contract for a network of one's own (``--model.arch=package.module.function``, called with ``num_classes``):
return an ``nn.Sequential`` whose children are the blocks, in the order the forward runs them, each taking the
previous one's output alone.

The CIFAR stem (a 3x3 stride-1 first convolution, no max-pool) applies to the ResNet family (ResNet, ResNeXt,
Wide ResNet). The other networks keep their ImageNet stem, which takes a 32x32 image down to 1x1 to 2x2 before
their last stage (docs/networks.md).

All blocks come from one network built under the blocks' seed, so every layout starts from the same weights; it
is built on the CPU while a ``LazyBlocks`` builds its blocks (``holding``), then let go.
"""

import copy
import difflib
import importlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import torch
import torchvision
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from torchvision.models import (
    VGG,
    AlexNet,
    ConvNeXt,
    DenseNet,
    EfficientNet,
    MNASNet,
    MobileNetV2,
    MobileNetV3,
    RegNet,
    ResNet,
    ShuffleNetV2,
    SqueezeNet,
    VisionTransformer,
)

from multigpu.errors import UsageError
from multigpu.model.lazy_blocks import BlockFactory
from multigpu.model.resnet import Stem, resnet50_block_factories

__all__ = [
    "DEFAULT_ARCH",
    "NetworkBlocks",
    "check_arch",
    "network_blocks",
    "shaped_by_image_size",
    "torchvision_classifiers",
]

DEFAULT_ARCH = "resnet50"
HOW_TO_HAND_OVER = (
    "return an nn.Sequential whose children are its blocks in forward order, each taking the previous one's "
    "output alone (docs/networks.md)"
)


def shaped_by_image_size(arch: str) -> bool:
    """Whether network ``arch``'s shapes depend on the images' size (a ViT's position embedding does); the others
    take any size."""
    return arch.startswith("vit_")


def torchvision_classifiers() -> list[str]:
    """The names of torchvision's image classification networks (``torchvision.models.list_models``)."""
    return torchvision.models.list_models(module=torchvision.models)


def _user_network(arch: str) -> Callable[..., nn.Module] | None:
    """The function ``package.module.name`` names, or None where ``arch`` is not a dotted path."""
    module_name, _, name = arch.rpartition(".")
    if not module_name:
        return None
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as error:
        raise UsageError(f"model.arch={arch}: {error}; give a torchvision network's name or package.module.function.")


def check_arch(arch: str) -> None:
    """Refuse a name that is neither a torchvision classifier nor a function's dotted path, naming the nearest."""
    if arch in torchvision_classifiers() or _user_network(arch) is not None:
        return
    near = difflib.get_close_matches(arch, torchvision_classifiers(), n=1)
    hint = f" (did you mean {near[0]}?)" if near else ""
    raise UsageError(
        f"model.arch={arch} is not a torchvision classifier{hint}: one of torchvision.models.list_models"
        "(module=torchvision.models), or package.module.function for a network of your own."
    )


class _SpatialMean(nn.Module):
    """``x.mean([2, 3])``: the global pooling ShuffleNet and MNASNet compute in their forward."""

    def forward(self, x: Tensor) -> Tensor:
        return x.mean([2, 3])


class _ViTPatches(nn.Module):
    """ViT's forward before its encoder layers: the patches' projection, the class token, the position embedding
    and its dropout (torchvision's ``VisionTransformer._process_input`` and ``Encoder.forward``)."""

    def __init__(self, vit: VisionTransformer) -> None:
        super().__init__()
        self.patch_size, self.hidden_dim = vit.patch_size, vit.hidden_dim
        self.conv_proj, self.class_token = vit.conv_proj, vit.class_token
        self.pos_embedding, self.dropout = vit.encoder.pos_embedding, vit.encoder.dropout

    def forward(self, x: Tensor) -> Tensor:
        n, _, h, w = x.shape
        patches = (h // self.patch_size) * (w // self.patch_size)
        x = self.conv_proj(x).reshape(n, self.hidden_dim, patches).permute(0, 2, 1)
        x = torch.cat([self.class_token.expand(n, -1, -1), x], dim=1)
        return self.dropout(x + self.pos_embedding)


class _ClassTokenOutput(nn.Module):
    """ViT's output: the class token's row, which its head classifies."""

    def forward(self, x: Tensor) -> Tensor:
        return x[:, 0]


def _opened(module: nn.Module) -> list[nn.Module]:
    """A plain ``nn.Sequential`` opened into its children (recursively); any other module as it is."""
    if type(module) is nn.Sequential:
        return [block for child in module for block in _opened(child)]
    return [module]


def _flatten() -> nn.Module:
    return nn.Flatten(1)


def _pooled() -> list[nn.Module]:
    return [nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(1)]


# Each family's forward, as the modules it runs in order.
_FORWARD: dict[type, Callable] = {
    ResNet: lambda m: [
        m.conv1, m.bn1, m.relu, m.maxpool, *m.layer1, *m.layer2, *m.layer3, *m.layer4, m.avgpool, _flatten(), m.fc
    ],
    VGG: lambda m: [*_opened(m.features), m.avgpool, _flatten(), *_opened(m.classifier)],
    AlexNet: lambda m: [*_opened(m.features), m.avgpool, _flatten(), *_opened(m.classifier)],
    MobileNetV3: lambda m: [*_opened(m.features), m.avgpool, _flatten(), *_opened(m.classifier)],
    EfficientNet: lambda m: [*_opened(m.features), m.avgpool, _flatten(), *_opened(m.classifier)],
    MobileNetV2: lambda m: [*_opened(m.features), *_pooled(), *_opened(m.classifier)],
    RegNet: lambda m: [m.stem, *(block for stage in m.trunk_output for block in stage), m.avgpool, _flatten(), m.fc],
    ConvNeXt: lambda m: [*_opened(m.features), m.avgpool, *_opened(m.classifier)],
    DenseNet: lambda m: [*_opened(m.features), nn.ReLU(inplace=True), *_pooled(), m.classifier],
    ShuffleNetV2: lambda m: [m.conv1, m.maxpool, *m.stage2, *m.stage3, *m.stage4, m.conv5, _SpatialMean(), m.fc],
    MNASNet: lambda m: [*_opened(m.layers), _SpatialMean(), *_opened(m.classifier)],
    SqueezeNet: lambda m: [*_opened(m.features), *_opened(m.classifier), _flatten()],
    VisionTransformer: lambda m: [
        _ViTPatches(m), *m.encoder.layers, m.encoder.ln, _ClassTokenOutput(), *_opened(m.heads)
    ],
}  # fmt: skip


def _in_forward_order(network: nn.Module) -> list[nn.Module]:
    for family, forward in _FORWARD.items():
        if type(network) is family:
            return forward(network)
    return [block for child in network.children() for block in _opened(child)]


def _grouped(modules: list[nn.Module]) -> list[nn.Module]:
    """A block per module with parameters or buffers; one without (an activation, a pooling) joins the one before."""
    groups: list[list[nn.Module]] = []
    for module in modules:
        holds_tensors = any(True for _ in module.parameters()) or any(True for _ in module.buffers())
        if holds_tensors or not groups:
            groups.append([module])
        else:
            groups[-1].append(module)
    return [group[0] if len(group) == 1 else nn.Sequential(*group) for group in groups]


def _cifar_stem(network: ResNet) -> None:
    """The ResNet family's CIFAR stem: a 3x3 stride-1 first convolution, initialised as torchvision's, no max-pool."""
    network.conv1 = nn.Conv2d(3, network.conv1.out_channels, 3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(network.conv1.weight, mode="fan_out", nonlinearity="relu")
    network.maxpool = nn.Identity()


class NetworkBlocks(Sequence[BlockFactory]):
    """One factory per block of a torchvision classifier (or the user's network), all cut from one network.

    Args:
        arch: a name from ``torchvision_classifiers()``, or ``package.module.function``.
        num_classes: the head's width.
        stem: ``cifar`` gives the ResNet family the CIFAR stem; other networks keep their own.
        image_size: the side of the square images it takes (ViT is built for it).
        seed: the seed the network is built under (the same in every process, so in every layout).
    """

    def __init__(self, arch: str, num_classes: int, stem: Stem, image_size: int, seed: int | None = None) -> None:
        self.arch, self.num_classes, self.stem, self.image_size = arch, num_classes, stem, image_size
        # Drawn from torch's global generator, as LazyBlocks' own seed: seed_everything fixes it in every process.
        self.seed = int(torch.randint(0, 2**62, (), device="cpu").item()) if seed is None else seed
        self._holding = 0
        network = self._network()
        self._resnet = isinstance(network, ResNet)
        blocks = self._blocks_of(network)
        self._check(network, blocks)
        if isinstance(network, VisionTransformer):  # what it chose for these images, which its name does not say
            side = self.image_size // network.patch_size
            rank_zero_info(
                f"model.arch={arch} at {self.image_size}x{self.image_size}: {side * side} patches of "
                f"{network.patch_size}x{network.patch_size} pixels ({side}x{side}) and the class token, "
                f"{len(network.encoder.layers)} encoder layers of width {network.hidden_dim}."
            )
        self._shapes = [copy.deepcopy(block).to("meta") for block in blocks]
        # Kept until ``release()`` (the end of ``LazyBlocks.materialize``): the blocks' timing and materialisation
        # copy them instead of building the network again.
        self._built: nn.Module | None = network
        self._held: list[nn.Module] | None = blocks

    def _network(self) -> nn.Module:
        """The whole network, built on the CPU under ``seed`` (torch's other generators untouched)."""
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.manual_seed(self.seed)
            build = _user_network(self.arch)
            if build is None:
                options = {"image_size": self.image_size} if shaped_by_image_size(self.arch) else {}
                try:
                    network = torchvision.models.get_model(
                        self.arch, weights=None, num_classes=self.num_classes, **options
                    )
                except ValueError as error:
                    raise UsageError(f"model.arch={self.arch} cannot be built for {self.image_size}x{self.image_size} "
                                     f"images: {error}") from None  # fmt: skip
            else:
                network = build(num_classes=self.num_classes)
            if isinstance(network, ResNet) and self.stem == "cifar":
                _cifar_stem(network)
        return network

    def _blocks_of(self, network: nn.Module) -> list[nn.Module]:
        if isinstance(network, nn.Sequential):
            return _grouped(_opened(network) if type(network) is nn.Sequential else list(network))
        return _grouped(_in_forward_order(network))

    def _check(self, network: nn.Module, blocks: list[nn.Module]) -> None:
        """The chain of ``blocks`` (``network``'s own modules) computes ``network``'s forward, bit for bit."""
        images = torch.randn(2, 3, self.image_size, self.image_size, generator=torch.Generator().manual_seed(0))
        network.eval()
        with torch.no_grad():
            try:
                expected = network(images)
            except RuntimeError as error:
                raise UsageError(
                    f"model.arch={self.arch} does not take {self.image_size}x{self.image_size} images: "
                    f"{str(error).splitlines()[0]}"
                ) from None
            try:
                chained = nn.Sequential(*blocks)(images)
            except (RuntimeError, TypeError):
                chained = None
        network.train()
        if not isinstance(expected, Tensor) or chained is None or not torch.equal(chained, expected):
            raise UsageError(
                f"model.arch={self.arch}: its forward is not the chain of its {len(blocks)} blocks, so it cannot be "
                f"split; {HOW_TO_HAND_OVER}."
            )

    def __len__(self) -> int:
        return len(self._shapes)

    def __getitem__(self, index):  # noqa: ANN001 - Sequence's int | slice
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        return partial(self._block, range(len(self))[index])  # IndexError past the end, as a list

    @contextmanager
    def holding(self) -> Iterator[None]:
        """Keep the built network while blocks are built one after another (``LazyBlocks.materialize``)."""
        self._holding += 1
        try:
            yield
        finally:
            self._holding -= 1
            if not self._holding and self._built is None:
                self._held = None

    def release(self) -> None:
        """Let go of the network built at construction (its blocks are built where they go from now on)."""
        self._built = None
        if not self._holding:
            self._held = None

    def network_with(self, blocks_state: dict[str, Tensor]) -> nn.Module:
        """The network itself (torchvision's, or the user's), holding the weights of a state dict of its blocks
        (keys ``<block>.<name>``): torchvision's names for the same tensors, for ``export``."""
        network = self._built if self._built is not None else self._network()
        self.release()  # the network is the caller's now: its blocks are no longer initial weights
        nn.Sequential(*self._blocks_of(network)).load_state_dict(blocks_state, strict=True)
        return network.eval()

    @property
    def is_resnet(self) -> bool:
        """Whether the network is of the ResNet family (the one the CIFAR stem applies to)."""
        return self._resnet

    def _block(self, index: int) -> nn.Module:
        """A new copy of block ``index``: its shapes alone on the meta device, else its initial weights."""
        if torch.get_default_device().type == "meta":
            return copy.deepcopy(self._shapes[index])
        blocks = self._held or self._blocks_of(self._network())
        if self._holding:
            self._held = blocks
        return copy.deepcopy(blocks[index])


def network_blocks(
    arch: str = DEFAULT_ARCH, num_classes: int = 10, stem: Stem = "cifar", image_size: int = 32, seed: int | None = None
) -> Sequence[BlockFactory]:
    """One factory per block of ``arch`` (see the module's docstring)."""
    if arch == DEFAULT_ARCH:
        return resnet50_block_factories(num_classes, stem)
    check_arch(arch)
    return NetworkBlocks(arch, num_classes, stem, image_size, seed)
