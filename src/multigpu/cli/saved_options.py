"""What a command on a checkpoint (``--ckpt_path``) takes from it, decided before anything is built.

``follow_checkpoint`` resolves ``--ckpt_path`` (``last``, ``best``, a file), checks the file, goes on with the run it
belongs to, refuses a finished run or another network, and reads the checkpoint's ``ResumePoint`` once. A command that
evaluates a checkpoint takes the options its run was trained with: the model's (``hyper_parameters``) and the data
module's (``datamodule_hyper_parameters``), so that ``python main.py test --run_name smoke --ckpt_path last`` tests
that run on its own data, network and batch size; an option given on the command line (``--data.batch_size=64``, or
in a ``--config`` file named there) overrides the checkpoint's. Every command, ``fit`` included, normalises an image
folder's images as its run did.
"""

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_info

from multigpu.checkpointing.files import check_model_options, refuse_a_second_run, resolve_ckpt_path
from multigpu.checkpointing.loop_position import finished_training, trained_to
from multigpu.checkpointing.resume import ResumePoint
from multigpu.cli.config_files import config_files, config_section
from multigpu.cli.run_options import RunOptions
from multigpu.data.datamodule import class_count
from multigpu.errors import RunFinished, UsageError
from multigpu.model.architectures import shaped_by_image_size

__all__ = ["checkpoint_dir", "follow_checkpoint", "given_options", "take_saved_normalisation", "take_saved_options"]


def checkpoint_dir(checkpoint_root: str, run_name: str) -> str:
    """The run's checkpoint folder: ``<checkpoint_root>/<run_name>``."""
    return os.path.join(checkpoint_root, run_name)


def _network_options(config) -> dict:
    """The model's options as the model will get them: its batch size and class count are the data's, and its image
    size too (each linked when it is built); the image size only where it shapes the network."""
    typed = RunOptions.of(config)
    data = typed.data
    options = {**dict(config["model"]), "batch_size": data.batch_size}
    options.pop("image_size", None)
    if shaped_by_image_size(typed.network.arch):
        options["image_size"] = data.image_size
    if data.dataset == "imagefolder" and data.synthetic:  # refused as the data module is built
        return options
    return {**options, "num_classes": class_count(data.dataset, data.data_dir)}


def follow_checkpoint(config: Any, subcommand: str | None, command_line: Sequence[str]) -> ResumePoint | None:
    """Resolve and check ``--ckpt_path`` of ``config`` (the subcommand's), in place, before anything is built; the
    point of the checkpoint, or ``None`` without one.

    This replaces Lightning's reading of ``--ckpt_path``, which loads the whole checkpoint once more and silently puts
    its model hyperparameters over the command line. Here the command line decides: ``last`` is resolved, the file
    checked, and changed model options reported."""
    options = RunOptions.of(config)
    if options.ckpt_path is None:
        if subcommand == "fit":
            refuse_a_second_run(checkpoint_dir(options.checkpoint_root, options.run_name), options.run_name)
        return None
    if options.weights_only is False:
        raise UsageError("--weights_only=false would let a checkpoint run code: drop it, checkpoints are read safely.")
    if "weights_only" in config:
        config["weights_only"] = True  # Lightning's own read too, remote files included
    dirpath = checkpoint_dir(options.checkpoint_root, options.run_name)
    ckpt_path, checkpoint = resolve_ckpt_path(options.ckpt_path, dirpath, subcommand == "fit")
    config["ckpt_path"] = ckpt_path
    if not checkpoint or ckpt_path is None:  # Lightning's own, or no checkpoint yet
        return None
    run_name = _follow_the_checkpoints_run(config, options, ckpt_path, subcommand)
    point = ResumePoint.of(checkpoint)
    if subcommand != "fit":
        # The run's own data, network and batch size, where the command line leaves them.
        take_saved_options(config, point, command_line)
        check_model_options(ckpt_path, checkpoint, _network_options(config), report=False)
        rank_zero_info(f"{subcommand}: the weights of {ckpt_path} ({trained_to(checkpoint)}).")
    else:
        check_model_options(ckpt_path, checkpoint, _network_options(config))
        trainer = options.trainer
        if reason := finished_training(checkpoint, trainer.max_epochs, trainer.max_steps, trainer.max_time):
            raise RunFinished(
                f"Run {run_name} has already finished: {reason}. Nothing to do; {ckpt_path} is left as it is."
            )
        rank_zero_info(f"Resuming from {ckpt_path} at step {checkpoint['global_step']}.")
    take_saved_normalisation(config, point, command_line)  # after the saved options: over them
    return point


def _follow_the_checkpoints_run(config: Any, options: RunOptions, path: str, subcommand: str | None) -> str:
    """A checkpoint file (``path``) of another run's folder (``<checkpoint_root>/<run>/``) than ``--run_name``'s:
    the command goes on with that run, its checkpoints and TensorBoard run, and says so. The run it goes on with."""
    folder = Path(path).resolve().parent
    run_name = options.run_name
    if folder.parent != Path(options.checkpoint_root).resolve() or folder.name == run_name:
        return run_name
    config["run_name"], config["checkpoint.dirpath"] = folder.name, str(folder)
    branch = f"; to start run {run_name} from its weights, pass --model.init_from={path} instead of --ckpt_path"
    rank_zero_info(
        f"{path} is run {folder.name}'s checkpoint: {subcommand} goes on with run {folder.name} (its checkpoints "
        f"and TensorBoard run), not {run_name}{branch if subcommand == 'fit' else ''}."
    )
    return folder.name


def given_options(command_line: Sequence[str], section: str) -> set[str]:
    """The options of ``section`` that ``command_line`` gives: as ``--section.name`` or in a ``--config`` file."""
    given = {
        arg[len(section) + 3 :].partition("=")[0].partition(".")[0]
        for arg in command_line
        if arg.startswith(f"--{section}.")
    }
    for _, path in config_files(command_line):
        given |= set(config_section(path, section))
    return given


def _names_code(section: str, name: str, value: Any) -> bool:
    """Whether option ``--section.name=value`` names code to import: a network's dotted path (``--model.arch``), or a
    class path anywhere in it."""
    if section == "model" and name == "arch":
        return "." in str(value)
    if isinstance(value, dict):
        return "class_path" in value or any(_names_code(section, key, item) for key, item in value.items())
    if isinstance(value, list | tuple):
        return any(_names_code(section, name, item) for item in value)
    return False


def take_saved_options(config: Any, point: ResumePoint, command_line: Sequence[str]) -> None:
    """Put the options ``point``'s run was trained with into this command's ``config`` (its ``model`` and ``data``
    sections), in place, except those the command line gives.

    A checkpoint never chooses code: an option that names some (``_names_code``) is taken only from the command line,
    which must then give it; ``weights_only`` would be worth little if the options beside the weights could."""
    for section, saved in (("model", point.model_options), ("data", point.data_options)):
        given = given_options(command_line, section)
        for name, value in saved.items():
            if name not in config[section] or name in given:
                continue
            if _names_code(section, name, value) and value != config[section][name]:
                raise UsageError(
                    f"the checkpoint's run was trained with --{section}.{name}={value}, which names code: a checkpoint "
                    f"does not choose what is imported. Give --{section}.{name}={value} yourself if you trust that "
                    "code, or pass another checkpoint."
                )
            config[section][name] = value


def take_saved_normalisation(config: Any, point: ResumePoint, command_line: Sequence[str]) -> None:
    """An image folder's mean and std as its run measured them, into ``config`` where the command line gives none: a
    resumed run and every command on its checkpoint normalise the images as the run did, without reading the folder
    again, even if images were added to it since."""
    if RunOptions.of(config).data.dataset != "imagefolder":
        return
    given = given_options(command_line, "data")
    for name in ("mean", "std"):
        if name in point.data and name not in given:
            config[f"data.{name}"] = tuple(point.data[name])
