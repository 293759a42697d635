"""The exceptions that end the CLI with one line: ``error: ...`` for a bad request or a fault, or a finished run."""

import os
import tempfile
from pathlib import Path

__all__ = ["JobFailed", "RunFinished", "UsageError", "check_at_least", "check_writable"]


class UsageError(ValueError):
    """A request the application cannot carry out; the message says how to fix it."""


class JobFailed(RuntimeError):
    """A fault that ends the whole job (a checkpoint that could not be written, a process that stalled): the CLI
    prints its message as one ``error: ...`` line, unless it was printed when it happened (``printed``), and exits
    with status 1."""

    printed = False


class RunFinished(Exception):
    """A resumed run that has already reached its end: the CLI says so and exits with status 0."""


def check_at_least(option: str, value: float, minimum: float, below: float | None = None) -> None:
    """Refuse ``value`` for ``--option`` unless ``minimum <= value`` (and ``value < below``, when given)."""
    if value < minimum or (below is not None and value >= below):
        allowed = f"in [{minimum}, {below})" if below is not None else f"at least {minimum}"
        raise UsageError(f"{option} must be {allowed}, not {value}.")


def check_writable(option: str, path: str | os.PathLike) -> None:
    """Refuse ``--option=path`` unless this process may create or replace the file or folder ``path``: it can make
    a folder in the nearest existing folder (tried, and taken back: permissions alone do not tell, ``/proc`` is
    writable to root by its mode bits). Nothing is left behind."""
    target = Path(path).absolute()
    existing = next(folder for folder in (target, *target.parents) if folder.exists())
    if existing == target and not target.is_dir():
        existing = target.parent
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".multigpu-check-", dir=existing))
    except OSError:
        raise UsageError(
            f"{option}={path}: {existing} cannot be written here; choose a folder you can write to."
        ) from None
