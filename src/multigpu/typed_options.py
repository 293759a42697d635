"""Options as typed objects where they enter: a frozen dataclass made from the dict (or jsonargparse namespace) they
come in, read once by its fields' names, so that the code after reads attributes, not string keys."""

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar

__all__ = ["ModuleOptions", "options_of"]

Options = TypeVar("Options")


def options_of(cls: type[Options], section: Mapping[str, Any], **given: Any) -> Options:
    """``cls`` (a dataclass) with the values of ``section`` that name its fields, ``given`` over them; a field that
    neither holds keeps its default (an option a checkpoint or config from before it lacks)."""
    taken = {field.name: section[field.name] for field in fields(cls) if field.name in section}  # type: ignore[arg-type]
    return cls(**{**taken, **given})


@dataclass(frozen=True)
class ModuleOptions:
    """What strategies and the run read of a Lightning module's saved options (its ``hparams``, the model's or the
    data module's), each ``None`` where the module has none (one that is not ours)."""

    batch_size: int | None = None
    compile: bool | dict[str, Any] | None = None
    arch: str | None = None
    dataset: str | None = None
    synthetic: bool | None = None

    @classmethod
    def of(cls, module: object) -> "ModuleOptions":
        """The options of ``module`` (a LightningModule or LightningDataModule; ``None``, say, has none)."""
        return options_of(cls, getattr(module, "hparams", {}))
