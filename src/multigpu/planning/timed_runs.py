"""Timed training runs in fresh processes: how ``plan`` and the benchmarks launch a configuration and read its figures.

A run is a command (usually ``main.py fit`` with ``StepTimer`` among its callbacks) in
processes of its own. ``StepTimer`` times the optimizer steps after a warm-up; each
rank writes the peak memory of its devices to ``<out>.rank<N>``, and rank 0 writes the
images per second and the mean step time to ``<out>``. ``run`` starts the command and
reads these files back.
"""

import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from lightning.pytorch import Callback
from typing_extensions import override

from multigpu.run.replicas import data_parallel_size
from multigpu.strategies import DataParallelStrategy

__all__ = [
    "RunFailed",
    "StepTimer",
    "fit_command",
    "launch",
    "peak_memory_bytes",
    "result",
    "run",
    "step_timer",
    "synchronize",
]


class RunFailed(RuntimeError):
    """A run that ended with an error or wrote no figures; the message ends with the end of its output."""


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a clock read covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(device: torch.device) -> int:
    """The most memory this process held: allocated on a CUDA device, resident on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _devices_of(trainer) -> list[torch.device]:
    """The devices this process trains on, in the order of its strategy: several for ``dp`` and
    ``manual_model_parallel``, else its root device."""
    strategy = trainer.strategy
    devices = getattr(strategy, "stage_devices", None)  # manual_model_parallel
    if devices is None and isinstance(strategy, DataParallelStrategy):
        devices = strategy.parallel_devices
    return list(devices or [strategy.root_device])


def _peaks_of_this_process(trainer) -> list[int]:
    """The peak of each CUDA device this process trains on, or on the CPU its resident memory."""
    devices = [device for device in _devices_of(trainer) if device.type == "cuda"]
    if not devices:
        return [peak_memory_bytes(trainer.strategy.root_device)]
    return [peak_memory_bytes(device) for device in devices]


def result(images: int, steps: int, seconds: float, peak_memory: list[int], windows: Sequence[float] = ()) -> dict:
    """One configuration's figures, as the harness's JSON holds them; ``windows``: the images per second of each
    window of steps, when they were timed apart."""
    return {
        "images_per_s": images / seconds,
        "step_time_s": seconds / steps,
        "peak_memory_bytes": peak_memory,
        "window_images_per_s": list(windows),
    }


class StepTimer(Callback):
    """Times the optimizer steps after the first ``warmup`` up to ``trainer.max_steps``, in windows of ``window``
    steps, and writes the figures to ``out``.

    Every rank writes the peak memory of its devices (a list) to ``out`` with its rank appended;
    rank 0 also writes images per second (all replicas' images) over all the timed steps and in each
    window, and the mean step time.
    """

    def __init__(self, warmup: int, out: str, window: int | None = None) -> None:
        self.warmup, self.out, self.window = warmup, Path(out), window
        self._marks: list[tuple[float, int, int]] = []  # (time, images so far, step) at the start and windows' ends
        self._images = 0

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.warmup and not self._marks:
            synchronize(pl_module.device)
            self._marks.append((time.perf_counter(), 0, trainer.global_step))

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self._marks:
            return
        self._images += len(batch[0])
        timed = trainer.global_step - self.warmup
        ends_window = self.window is not None and timed > 0 and timed % self.window == 0
        if (ends_window or trainer.global_step == trainer.max_steps) and self._marks[-1][2] != trainer.global_step:
            synchronize(pl_module.device)  # the window's last step: wait for it to finish
            self._marks.append((time.perf_counter(), self._images, trainer.global_step))

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        steps = trainer.global_step - self.warmup
        if steps < 1 or trainer.global_step != trainer.max_steps:
            raise RuntimeError(
                f"the run ended at step {trainer.global_step}, before the {trainer.max_steps} steps it was to time "
                "(a time limit, or too few batches?)"
            )
        replicas = data_parallel_size(trainer)
        rank_file = self.out.with_name(f"{self.out.name}.rank{trainer.global_rank}")
        rank_file.write_text(json.dumps(_peaks_of_this_process(trainer)))
        if trainer.is_global_zero:
            (start, _, _), (end, images, _) = self._marks[0], self._marks[-1]
            windows = [
                (after - before) * replicas / (stop - begin)
                for (begin, before, _), (stop, after, _) in zip(self._marks, self._marks[1:])
            ]
            figures = result(images * replicas, steps, end - start, [], windows if self.window else ())
            self.out.write_text(json.dumps(figures))


def step_timer(warmup: int, out: Path, window: int | None = None) -> list[str]:
    """The ``fit`` options that add a ``StepTimer``."""
    return [
        "--trainer.callbacks+=multigpu.planning.timed_runs.StepTimer",
        f"--trainer.callbacks.warmup={warmup}",
        f"--trainer.callbacks.out={out}",
        *([f"--trainer.callbacks.window={window}"] if window else []),
    ]


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
    a run still going after ``timeout`` seconds included (its processes are killed)."""
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
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise RunFailed(f"{' '.join(command)} was still running after {timeout:.0f} s, and was stopped") from None
    ranks = sorted(out.parent.glob(out.name + ".rank*"), key=lambda path: int(path.name.rsplit("rank", 1)[1]))
    if returncode or not (ranks or out.exists()):
        raise RunFailed(
            f"{' '.join(command)} failed (exit {returncode}); the end of its output:\n{log.read_text()[-3000:]}"
        )
    return [json.loads(path.read_text()) for path in ranks]


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
