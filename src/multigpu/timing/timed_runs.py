"""Timed training runs in fresh processes: how ``plan`` and the benchmarks launch a configuration and read its figures.

A run is a command (usually ``main.py fit`` with ``step_timer``'s options, which add a ``StepTimer``) in
processes of its own; ``run`` starts it and reads back the files its ``StepTimer`` wrote
(``multigpu.timing.step_timer``).
"""

import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["RunFailed", "fit_command", "last_error", "launch", "run"]


class RunFailed(RuntimeError):
    """A run that ended with an error or wrote no figures; the message ends with the end of its output."""


def fit_command(
    entry: Path, options: Sequence[str], folder: Path, name: str, steps: int, images: int, callbacks: Sequence[str] = ()
) -> list[str]:
    """``python <entry> fit <options>`` for ``steps`` optimizer steps on ``images`` synthetic images, without
    validation or extra checkpoints, its checkpoints and logs in ``folder``; ``callbacks``
    (``--trainer.callbacks+=...`` options, such as ``step_timer``'s) come last, so that those of a config file
    among ``options`` stay."""
    return [
        sys.executable,
        str(entry),
        "fit",
        *options,
        "--data.synthetic=true",
        f"--data.synthetic_size={images}",
        f"--trainer.max_steps={steps}",
        "--trainer.limit_val_batches=0",
        "--save_every_n_steps=0",
        "--checkpoint.save_last=false",
        "--checkpoint.save_top_k=0",
        f"--run_name={name}",
        f"--checkpoint_root={folder / 'checkpoints'}",
        f"--trainer.default_root_dir={folder / 'logs'}",
        *callbacks,
    ]


def launch(
    command: Sequence[str],
    out: Path,
    log: Path,
    threads: int | None = None,
    pythonpath: Sequence[Path] = (),
    cwd: Path | None = None,
    timeout: float | None = None,
) -> list:
    """Run ``command`` (``pythonpath`` importable; ``threads`` threads per process when given), its output
    in ``log``; return what its ranks wrote to ``out.rankN``, in rank order. A ``RunFailed`` says why not,
    a run still going after ``timeout`` seconds included (its processes are killed). What the run leaves behind
    when it ends is stopped, so that the next run or check finds the cores as they were: a short run's loader
    workers' fork server may still be importing its modules, on one core, for seconds past its end (docs/plan.md,
    "Running it")."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, pythonpath), os.environ.get("PYTHONPATH", "")])}
    if threads is not None:  # the CPU
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    with open(log, "w") as file:
        process = subprocess.Popen(
            list(command), cwd=cwd, env=env, stdout=file, stderr=subprocess.STDOUT, start_new_session=True
        )  # its own process group: the launcher's children too
        try:
            returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RunFailed(f"{' '.join(command)} was still running after {timeout:.0f} s, and was stopped") from None
        finally:
            _stop_group(process.pid)  # what the run left behind; all of it after a timeout or an interrupt
            process.wait()
    ranks = sorted(out.parent.glob(out.name + ".rank*"), key=lambda path: int(path.name.rsplit("rank", 1)[1]))
    if returncode or not (ranks or out.exists()):
        raise RunFailed(
            f"{' '.join(command)} failed (exit {returncode}); the end of its output:\n{log.read_text()[-3000:]}"
        )
    return [json.loads(path.read_text()) for path in ranks]


def _stop_group(group: int) -> None:
    """Kill the processes left in the process group ``group``, if any."""
    try:
        os.killpg(group, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # none left
        pass


def run(
    command: Sequence[str],
    out: Path,
    log: Path,
    threads: int | None = None,
    pythonpath: Sequence[Path] = (),
    cwd: Path | None = None,
    timeout: float | None = None,
) -> dict:
    """Run a command timed by ``StepTimer(out=out)``: its figures, with the peak of each device of each rank
    (rank order) in ``peak_memory_bytes``."""
    peaks = launch(command, out, log, threads, pythonpath, cwd, timeout)
    if not out.exists():
        raise RunFailed(
            f"{' '.join(command)} wrote no figures to {out}; the end of its output:\n{log.read_text()[-3000:]}"
        )
    figures = json.loads(out.read_text())
    figures["peak_memory_bytes"] += [peak for rank in peaks for peak in (rank if isinstance(rank, list) else [rank])]
    return figures


def last_error(log: str) -> str:
    """The line of a failed run's output that says what went wrong."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("error:") or "Error" in line.split(":", 1)[0]:
            return line[:300]
    return lines[-1][:300] if lines else "no output"
