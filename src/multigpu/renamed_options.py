"""Options and classes that were renamed: the one place that knows their old names.

An old name still works, with a deprecation line, on the command line, in a config file and in
the hyperparameters a checkpoint saved; the code behind it knows only the new name.

``add_old_names`` lets a section's parser read the old names (from config files), ``new_names``
moves the old names of the command line to the new ones in their place (so that a later option still
wins) and ``move_to_new_names`` those of a parsed config; ``new_hyperparameter_names`` reads a
checkpoint's. ``renamed_class`` gives a class asked for by its old name (``multigpu.ResNet50Classifier``, in a
user's import), with a deprecation line: no class is defined under an old name.
"""

import argparse
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

from lightning.pytorch.utilities import rank_zero_deprecation

__all__ = [
    "RENAMED",
    "RENAMED_CLASSES",
    "add_old_names",
    "move_to_new_names",
    "new_hyperparameter_names",
    "new_names",
    "renamed_class",
]

RENAMED_CLASSES = {
    "ResNet50Classifier": "ImageClassifier",  # it trains any torchvision classifier, or the user's network
    "CIFAR10DataModule": "ImageDataModule",  # CIFAR-10, CIFAR-100, an image folder or synthetic images
}


def renamed_class(module: str, name: str, names: dict[str, Any]) -> Any:
    """The class ``module`` (its ``names``) holds under the new name of ``name``, with a deprecation line; an
    ``AttributeError`` for any other name, as a module's ``__getattr__`` raises."""
    new = RENAMED_CLASSES.get(name)
    if new is None or new not in names:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    rank_zero_deprecation(
        f"{module}.{name} is deprecated: use {module}.{new}, the same class under a name that says what it holds.",
        stacklevel=7,  # the user's line: past Lightning's warning functions, this function and the module's __getattr__
    )
    return names[new]


class Renamed(NamedTuple):
    """``old``, the former name of option ``new`` (``section.name``), which takes values of ``type``."""

    old: str
    new: str
    type: Any

    @property
    def section(self) -> str:
        return self.old.partition(".")[0]

    def warn(self) -> None:
        rank_zero_deprecation(
            f"--{self.old} is deprecated: use --{self.new}, the same setting under a name that leaves 'checkpoint' "
            "to checkpoint files."
        )


RENAMED = (
    Renamed("model.activation_checkpointing", "model.recompute_activations", bool | None),
    Renamed("plan.activation_checkpointing", "plan.recompute_activations", Literal["auto", "both", "no", "yes"] | None),
)


def add_old_names(parser: Any, section: str) -> None:
    """Let ``parser`` (a jsonargparse parser with ``section``'s options) read the old names of that section's options,
    hidden from ``--help``."""
    for renamed in RENAMED:
        if renamed.section == section:
            parser.add_argument(f"--{renamed.old}", type=renamed.type, default=None, help=argparse.SUPPRESS)


def new_names(args: Sequence[str]) -> list[str]:
    """Command-line ``args`` with each old option name replaced by its new one, in its place: an option given after it
    still wins."""
    args = list(args)
    for renamed in RENAMED:
        old, new = f"--{renamed.old}", f"--{renamed.new}"
        for index, arg in enumerate(args):
            if arg == old or arg.startswith(old + "="):
                args[index] = new + arg[len(old) :]
                renamed.warn()
    return args


def move_to_new_names(config: Any, args: Sequence[str]) -> None:
    """Move a parsed ``config``'s values under old names (read from a config file; ``add_old_names`` let its parser
    read them) to the new names, in place, unless the command line (``args``, already through ``new_names``) gave the
    new name, which then wins."""
    for renamed in RENAMED:
        values, old, new = config.get(renamed.section), renamed.old.partition(".")[2], renamed.new.partition(".")[2]
        if values is None or old not in values:
            continue
        value = values[old]
        del values[old]
        if value is None:
            continue
        renamed.warn()
        if not any(arg == f"--{renamed.new}" or arg.startswith(f"--{renamed.new}=") for arg in args):
            values[new] = value


def new_hyperparameter_names(hyperparameters: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's saved model hyperparameters under the new names (a checkpoint may be older than a rename)."""
    renamed = dict(hyperparameters)
    for option in RENAMED:
        old, new = option.old.partition(".")[2], option.new.partition(".")[2]
        if option.section == "model" and old in renamed:
            renamed[new] = renamed.pop(old)
    return renamed
