"""What a Lightning ``Trainer`` holds but its class does not declare: its connectors set these attributes as the
Trainer starts, where a type checker does not look. Read them here, typed, not as ``trainer.callbacks``."""

from lightning.pytorch import Callback, LightningDataModule, Trainer
from lightning.pytorch.profilers import Profiler

__all__ = ["callbacks_of", "datamodule_of", "is_fast_dev_run", "profiler_of"]


def callbacks_of(trainer: Trainer) -> list[Callback]:
    """The Trainer's callbacks, the list itself (changed in place where a run replaces one)."""
    return trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's CallbackConnector


def datamodule_of(trainer: Trainer) -> LightningDataModule | None:
    """The data module of the run under way, if it has one."""
    return trainer.datamodule  # type: ignore[attr-defined]  # set by Lightning's DataConnector


def profiler_of(trainer: Trainer) -> Profiler:
    """The Trainer's profiler (``--trainer.profiler``; a ``PassThroughProfiler`` by default)."""
    return trainer.profiler  # type: ignore[attr-defined]  # set by Lightning's trainer setup


def is_fast_dev_run(trainer: Trainer) -> bool:
    """Whether the run is ``--trainer.fast_dev_run``, of any number of batches."""
    return bool(trainer.fast_dev_run)  # type: ignore[attr-defined]  # set by Lightning's trainer setup
