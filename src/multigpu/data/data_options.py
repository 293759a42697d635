"""The options of ``ImageDataModule`` (``--data.*``) as one typed object, ``DataOptions``: made once from the data
module's arguments, a config's ``data`` section or a checkpoint's saved ones, and read by attribute."""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from multigpu.typed_options import options_of

__all__ = ["DataOptions"]


@dataclass(frozen=True)
class DataOptions:
    """``ImageDataModule``'s options, with its defaults (its docstring says what each means)."""

    data_dir: str = "data"
    dataset: Literal["cifar10", "cifar100", "imagefolder"] = "cifar10"
    download: bool = True
    verify_checksums: bool = True
    batch_size: int = 128
    global_batch_size: int | None = None
    num_workers: int | None = None
    pin_memory: bool = True
    persistent_workers: bool = True
    val_split: int = 0
    synthetic: bool = False
    synthetic_size: int = 50_000
    shuffle_seed: int | None = None
    on_device: bool = False
    image_size: int = 32
    mean: tuple[float, float, float] | None = None
    std: tuple[float, float, float] | None = None
    predict_dir: str | None = None

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> "DataOptions":
        """The data module's options among ``options`` (a config's ``data`` section, its hyperparameters)."""
        return options_of(cls, options)
