"""Finding and checking a checkpoint before anything is built from it."""

import pickle
import re
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info

from multigpu.checkpointing.sharded_checkpoints import whole_checkpoint
from multigpu.errors import UsageError
from multigpu.renamed_options import new_hyperparameter_names

__all__ = [
    "check_checkpoint",
    "check_model_options",
    "find_last_checkpoint",
    "refuse_a_second_run",
    "resolve_ckpt_path",
]

# Options that change the network's shapes: a checkpoint only loads with the same value; how to give it back.
_NETWORK_OPTIONS = {
    "arch": "--model.arch={}",
    "stem": "--model.stem={}",
    "num_classes": "the data it trained on ({} classes)",
    "image_size": "--data.image_size={}",
}


def find_last_checkpoint(dirpath: str | Path) -> Path | None:
    """The run's own ``last.ckpt`` in ``dirpath``, or None. Never a ``last-vN.ckpt`` beside it: Lightning writes one
    when a new run starts in a folder that holds another's, which ``refuse_a_second_run`` prevents."""
    path = Path(dirpath) / "last.ckpt"
    return path if path.is_file() else None


def refuse_a_second_run(dirpath: str | Path, run_name: str) -> None:
    """Refuse to start a run from scratch in ``dirpath`` when it holds checkpoints already: the new run's
    ``last-v1.ckpt`` would sit beside the old ``last.ckpt``, and neither run could be told from the other."""
    held = sorted(path.name for path in Path(dirpath).glob("*.ckpt")) if Path(dirpath).is_dir() else []
    if held:
        raise UsageError(
            f"run {run_name} already has checkpoints in {dirpath} ({held[0]}{' ...' if len(held) > 1 else ''}): "
            f"resume it with --ckpt_path last, or start another run with a new --run_name."
        )


def check_checkpoint(path: str | Path) -> dict[str, Any]:
    """Open ``path`` and return its contents, or raise a ``UsageError`` that says what is wrong.

    The file is memory-mapped, so tensors are not read until they are used. It is read with
    torch's safe loader, which builds tensors and plain values only (all that our checkpoints
    hold): a file that would build anything else, and so could run code, is refused unread.
    """
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"checkpoint {path} does not exist: pass an existing file, or --ckpt_path last to resume.")
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as error:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
        if found is None:
            raise _unreadable(path, error) from None
        raise UsageError(
            f"checkpoint {path} holds objects other than tensors and plain values ({found.group(1)}); loading it could "
            f"run code, so it is refused. Pass a checkpoint written by this application with --ckpt_path."
        ) from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError) as error:
        raise _unreadable(path, error) from None
    if isinstance(checkpoint, dict):
        checkpoint = whole_checkpoint(checkpoint, path)  # fsdp's shards, beside it, put together
    if not isinstance(checkpoint, dict) or not {"state_dict", "global_step", "epoch"} <= checkpoint.keys():
        raise UsageError(
            f"checkpoint {path} is not a Lightning training checkpoint (it lacks state_dict, epoch or "
            f"global_step). Pass a checkpoint written by this application with --ckpt_path."
        )
    return checkpoint


def _unreadable(path: Path, error: Exception) -> UsageError:
    return UsageError(
        f"checkpoint {path} cannot be read ({type(error).__name__}): it is truncated or not a "
        f"PyTorch checkpoint. Pass another checkpoint with --ckpt_path."
    )


def resolve_ckpt_path(
    ckpt_path: str | None, dirpath: str | Path, training: bool = True
) -> tuple[str | None, dict[str, Any]]:
    """Turn ``--ckpt_path`` into a checked file path and the checkpoint's contents.

    ``"last"`` means ``last.ckpt`` in ``dirpath``; when there is none yet
    a training run starts from scratch, so the same command both starts and resumes a job
    (anything else, ``training`` false, stops with a ``UsageError``).
    ``"best"`` means the best checkpoint that the run's ModelCheckpoint recorded in that
    ``last.ckpt`` (Lightning knows it only within the process that trained). ``"hpc"``
    and remote paths (``s3://`` ...) are left to Lightning.
    """
    if ckpt_path is None:
        return None, {}
    if ckpt_path in ("last", "best"):
        last = find_last_checkpoint(dirpath)
        if last is None and ckpt_path == "last":
            if not training:
                raise UsageError(
                    f"--ckpt_path last: no checkpoint in {dirpath} yet. Train first (python main.py fit with the same "
                    "--run_name), or pass a checkpoint file."
                )
            rank_zero_info(f"No checkpoint in {dirpath} yet: starting from scratch.")
            return None, {}
        ckpt_path = str(last) if ckpt_path == "last" else _best_checkpoint(last, dirpath)
    elif ckpt_path == "hpc" or "://" in ckpt_path:  # Lightning's own (its SLURM checkpoint), or remote
        return ckpt_path, {}
    return ckpt_path, check_checkpoint(ckpt_path)


def _best_checkpoint(last: Path | None, dirpath: str | Path) -> str:
    states = check_checkpoint(last).get("callbacks", {}).values() if last is not None else []
    best = next((state["best_model_path"] for state in states if state.get("best_model_path")), None)
    if best is None:
        raise UsageError(
            f"--ckpt_path best: no checkpoint in {dirpath} records a best model yet (the run validates at "
            f"each epoch's end). Pass a checkpoint file, or --ckpt_path last."
        )
    return best


def check_model_options(path: str, checkpoint: dict[str, Any], options: Mapping[str, Any], report: bool = True) -> None:
    """Compare this run's model options with those ``checkpoint`` was trained with.

    The command line decides; another network (its architecture, stem or class count, ``options["num_classes"]``
    being the data's) is refused in one line before the network is built, and, with ``report`` (training on), any
    other changed option is reported in one line.
    """
    saved = new_hyperparameter_names(checkpoint.get("hyper_parameters", {}))
    changed = {key: (saved[key], options[key]) for key in saved if key in options and saved[key] != options[key]}
    changed.pop("init_from", None)  # read only when a run starts: a checkpoint's weights come from the checkpoint
    for key, how in _NETWORK_OPTIONS.items():
        if key in changed:
            old, new = changed[key]
            raise UsageError(
                f"checkpoint {path} holds another network ({key} {old}, not {new}): use it with {how.format(old)}, "
                "or start a new run (--run_name) for this one; the checkpoint is left as it is."
            )
    if changed and report:
        listed = ", ".join(f"{key} {old} -> {new}" for key, (old, new) in changed.items())
        rank_zero_info(f"Model options changed since {path}: {listed}.")
