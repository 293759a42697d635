"""The run's own options for ``validate``, ``test`` and ``predict`` of one of its checkpoints.

A checkpoint holds the model's options (``hyper_parameters``) and the data module's
(``datamodule_hyper_parameters``) it was trained with. A command that evaluates it takes them, so that
``python main.py test --run_name smoke --ckpt_path last`` tests that run on its own data, network and
batch size; an option given on the command line (``--data.batch_size=64``, or in a ``--config`` file
named there) overrides the checkpoint's.
"""

from collections.abc import Sequence
from typing import Any

from multigpu.cli.config_files import config_files, read_config
from multigpu.renamed_options import new_hyperparameter_names
from multigpu.run.callbacks import RunMetadata

__all__ = ["SECTIONS", "given_options", "take_saved_normalisation", "take_saved_options"]

SECTIONS = {"model": "hyper_parameters", "data": "datamodule_hyper_parameters"}  # section -> checkpoint key


def given_options(command_line: Sequence[str], section: str) -> set[str]:
    """The options of ``section`` that ``command_line`` gives: as ``--section.name`` or in a ``--config`` file."""
    given = {
        arg[len(section) + 3 :].partition("=")[0].partition(".")[0]
        for arg in command_line
        if arg.startswith(f"--{section}.")
    }
    for _, path in config_files(command_line):
        loaded = read_config(path)
        values = loaded.get(section) if isinstance(loaded, dict) else None
        given |= set(values) if isinstance(values, dict) else set()
    return given


def take_saved_options(config: Any, checkpoint: dict[str, Any], command_line: Sequence[str]) -> None:
    """Put the options ``checkpoint`` was trained with into this command's ``config`` (its ``model`` and ``data``
    sections), in place, except those the command line gives."""
    for section, key in SECTIONS.items():
        saved = checkpoint.get(key) or {}
        if section == "model":
            saved = new_hyperparameter_names(saved)
        given = given_options(command_line, section)
        for name, value in saved.items():
            if name in config[section] and name not in given:
                config[section][name] = value


def take_saved_normalisation(config: Any, checkpoint: dict[str, Any], command_line: Sequence[str]) -> None:
    """An image folder's mean and std as its run measured them (``RunMetadata``'s ``data``), into ``config``
    where the command line gives none: a resumed run and every command on its checkpoint normalise the images as the
    run did, without reading the folder again, even if images were added to it since."""
    if config["data"].get("dataset") != "imagefolder":
        return
    measured = checkpoint.get(RunMetadata.KEY, {}).get("data", {})
    given = given_options(command_line, "data")
    for name in ("mean", "std"):
        if name in measured and name not in given:
            config["data"][name] = tuple(measured[name])
