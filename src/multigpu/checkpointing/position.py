"""The training position: where training stands in the epochs' orders of global batches (the epoch, the images of
its order trained, the shuffle's seed, the global batch), the same on any layout. ``TrainingPosition`` is the only
writer and reader of it in a checkpoint, under ``"multigpu"`` (``KEY``) ``"order"``; the data module is given the
order to follow (``TrainingOrder``) and keeps none of it.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from lightning.pytorch import Trainer

from multigpu.checkpointing.loop_position import next_position
from multigpu.data.sampling import EpochOrder, TrainingOrder
from multigpu.renamed_options import RENAMED_CLASSES
from multigpu.run.trainer_parts import datamodule_of

__all__ = ["KEY", "FollowsOrder", "TrainingPosition"]

KEY = "multigpu"
# Where a data module kept the order before ``KEY`` did: Lightning's key of its state, its class's name, old or new
_DATA_MODULE_KEYS = ("ImageDataModule", *(old for old, new in RENAMED_CLASSES.items() if new == "ImageDataModule"))


@runtime_checkable
class FollowsOrder(Protocol):
    """A data module that trains in an order it is given, and says where it stands in it (``ImageDataModule``)."""

    @property
    def global_batch(self) -> int:
        """The images of an optimizer step over every replica, on this layout."""

    @property
    def training_seed(self) -> int | None:
        """The seed the training order is shuffled with, once its loader is made."""

    def epoch_order(self, epoch: int) -> EpochOrder:
        """How this layout trains ``epoch``: as its pass under way does, or whole."""

    def follow(self, order: TrainingOrder) -> None:
        """Train in ``order`` from the next training loader on."""


@dataclass(frozen=True)
class TrainingPosition:
    """Where training stands in the epochs' orders, as a checkpoint holds it.

    Attributes:
        epoch: the epoch training goes on with.
        images: the images of that epoch's order already trained, on any layout; ``None`` for a checkpoint of an
            early version, which kept ``batches`` instead: the loader batches each replica trained, on its layout.
        shuffle_seed: the seed of the run's order and augmentation; ``None`` for a version that kept none (0).
        global_batch: the images per optimizer step it trained with.
    """

    epoch: int = 0
    images: int | None = 0
    batches: int = 0
    shuffle_seed: int | None = None
    global_batch: int | None = None

    @classmethod
    def of(cls, checkpoint: Mapping[str, Any]) -> "TrainingPosition | None":
        """The position ``checkpoint`` holds, of this version or an earlier one (whose data module kept it under its
        own class name, an old one among them); ``None`` for one written without a data module of ours."""
        order = checkpoint.get(KEY, {}).get("order")
        if order is None:
            order = next((checkpoint[name] for name in _DATA_MODULE_KEYS if name in checkpoint), None)
        if order is None:
            return None
        return cls(
            epoch=order.get("epoch", 0),
            images=order.get("position"),
            batches=order.get("batches", 0),
            shuffle_seed=order.get("shuffle_seed"),
            global_batch=order.get("global_batch"),
        )

    @classmethod
    def now(cls, trainer: Trainer) -> "TrainingPosition | None":
        """Where ``trainer`` stands, for a checkpoint written now; ``None`` without a data module that follows an
        order."""
        data = datamodule_of(trainer)
        if not isinstance(data, FollowsOrder):
            return None
        epoch, batches = next_position(trainer.fit_loop.state_dict())
        images = data.epoch_order(epoch).position(batches // trainer.accumulate_grad_batches) if batches else 0
        return cls(epoch, images, shuffle_seed=data.training_seed, global_batch=data.global_batch)

    def record(self) -> dict[str, int | None]:
        """The position as a checkpoint holds it under ``KEY``'s ``"order"``."""
        state = {"epoch": self.epoch, "position": self.images, "global_batch": self.global_batch}
        return state if self.shuffle_seed is None else {**state, "shuffle_seed": self.shuffle_seed}

    def give_to(self, data: FollowsOrder, accumulation: int) -> EpochOrder | None:
        """Make ``data`` go on from here, with this layout's ``accumulation``; how it trains the rest of the epoch it
        stopped inside, or ``None`` where it stopped between epochs."""
        images = self.images
        if images is None:  # batches of each replica, read with this layout's: global batch over accumulation
            images = self.batches * data.global_batch // accumulation
        seed_by_default = 0 if self.shuffle_seed is None else None  # an earlier version's default seed
        data.follow(TrainingOrder(self.epoch, images, self.shuffle_seed, seed_by_default))
        if not images:
            return None
        return EpochOrder(data.epoch_order(self.epoch).samples, data.global_batch, images)
