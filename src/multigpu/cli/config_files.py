"""The ``--config`` files of a command line: the folder a relative data path in one of them is relative to, and
which of them does not parse as YAML."""

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from multigpu.cli.run_options import RunOptions
from multigpu.data.data_options import DataOptions

__all__ = ["config_files", "config_section", "resolve_data_dir", "unreadable_config"]


def config_files(command_line: Sequence[str]) -> Iterator[tuple[int, Path]]:
    """Each ``--config`` file of ``command_line`` (``--config F``, ``--config=F`` or ``-c F``), with its argument's
    index, in order."""
    args = list(command_line)
    for index, arg in enumerate(args):
        if arg in ("--config", "-c") and index + 1 < len(args):
            yield index, Path(args[index + 1])
        elif arg.startswith("--config="):
            yield index, Path(arg.partition("=")[2])


def _read_config(path: Path) -> Any:
    """What the YAML file ``path`` holds; ``None`` where it is missing or unreadable (the parser says why)."""
    try:
        return yaml.safe_load(path.read_text()) if path.is_file() else None
    except (OSError, yaml.YAMLError):
        return None


def config_section(path: Path, section: str) -> dict[str, Any]:
    """The options the YAML file ``path`` gives in ``section`` (``model``, ``data``...): none where it gives none."""
    loaded = _read_config(path)
    values = loaded.get(section) if isinstance(loaded, dict) else None
    return values if isinstance(values, dict) else {}


def resolve_data_dir(config: Any, command_line: Sequence[str]) -> None:
    """A relative ``data.data_dir`` that a ``--config`` file gives (and nothing after it on the command line) is
    relative to that file's folder, so that the file works from any folder: made so in ``config``, in place. One given
    on the command line, or by ``configs/default.yaml`` (``data``), stays relative to where the command runs."""
    source = None
    for index, path in config_files(command_line):
        section = config_section(path, "data")
        if "data_dir" in section:
            source = index, path, DataOptions.of(section).data_dir
    if source is None:
        return
    index, path, value = source
    data_dir = RunOptions.of(config).data.data_dir
    given_later = any(arg.startswith("--data.data_dir") for arg in command_line[index:])
    if given_later or not isinstance(value, str) or os.path.isabs(value) or data_dir != value:
        return
    config["data.data_dir"] = os.path.normpath(path.parent / value)


def unreadable_config(command_line: Sequence[str]) -> str | None:
    """The first ``--config`` file of ``command_line`` that is not valid YAML, with the parser's reason and where,
    or ``None``."""
    for _, path in config_files(command_line):
        try:
            yaml.safe_load(path.read_text())
        except OSError:
            continue  # the parser says a missing file is missing
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            reason = getattr(error, "problem", None) or str(error).splitlines()[0]
            return f"{path}{where}: {reason}"
    return None
