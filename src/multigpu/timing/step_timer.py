"""``StepTimer``, the callback that times a run's optimizer steps, and the figures it writes.

``StepTimer`` times the optimizer steps after a warm-up; each rank writes the peak memory
of its devices to ``<out>.rank<N>``, and rank 0 writes the images per second and the mean
step time to ``<out>`` (``result``). ``step_timer`` gives the ``fit`` options that add it;
``multigpu.timing.timed_runs`` launches such a run and reads the files back.
"""

import json
import resource
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from lightning.pytorch import Callback
from typing_extensions import override

from multigpu.contracts import parallelism_of
from multigpu.run.device_sync import synchronize
from multigpu.run.replicas import data_parallel_size

__all__ = ["StepTimer", "peak_memory_bytes", "result", "step_timer"]


def peak_memory_bytes(device: torch.device) -> int:
    """The most memory this process held: allocated on a CUDA device, resident on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _peaks_of_this_process(trainer) -> list[int]:
    """The peak of each CUDA device this process trains on, or on the CPU its resident memory."""
    devices = [device for device in parallelism_of(trainer).process_devices if device.type == "cuda"]
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
        "--trainer.callbacks+=multigpu.timing.step_timer.StepTimer",
        f"--trainer.callbacks.warmup={warmup}",
        f"--trainer.callbacks.out={out}",
        *([f"--trainer.callbacks.window={window}"] if window else []),
    ]
