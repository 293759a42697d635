"""The options of ``ImageClassifier`` that build its network (``NetworkOptions``): read once from a model's
``--model.*`` options or a checkpoint's saved hyperparameters, with the defaults a checkpoint from before an option
was saved stands for."""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning.pytorch import LightningModule

from multigpu.model.architectures import DEFAULT_ARCH, network_blocks
from multigpu.model.lazy_blocks import BlockFactory
from multigpu.model.resnet import Stem
from multigpu.typed_options import options_of

__all__ = ["NetworkOptions"]


@dataclass(frozen=True)
class NetworkOptions:
    """The network of a model: ``ImageClassifier``'s ``arch``, ``num_classes``, ``stem`` and ``image_size`` (its
    docstring says what each means), with its defaults."""

    arch: str = DEFAULT_ARCH
    num_classes: int = 10
    stem: Stem = "cifar"
    image_size: int = 32

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> "NetworkOptions":
        """The network among a model's options or hyperparameters."""
        return options_of(cls, options)

    @classmethod
    def saved_in(cls, checkpoint: Mapping[str, Any]) -> "NetworkOptions":
        """The network ``checkpoint``'s model was trained with (Lightning's ``hyper_parameters``)."""
        return cls.of(checkpoint.get(LightningModule.CHECKPOINT_HYPER_PARAMS_KEY, {}))

    def blocks(self, seed: int | None = None) -> Sequence[BlockFactory]:
        """One factory per block of the network (``network_blocks``)."""
        return network_blocks(self.arch, self.num_classes, self.stem, self.image_size, seed=seed)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """The shape of one input image: RGB, ``image_size`` square."""
        return (3, self.image_size, self.image_size)
