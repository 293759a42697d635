"""What the benchmarks time: training steps after a warm-up, and the peak memory of each process."""

import json
import resource
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback
from typing_extensions import override

from multigpu.replicas import data_parallel_size


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a clock read covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(device: torch.device) -> int:
    """The most memory this process held: allocated on a CUDA device, resident on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def result(images: int, steps: int, seconds: float, peak_memory: list[int]) -> dict:
    """One configuration's figures, as the harness's JSON holds them."""
    return {
        "images_per_s": images / seconds,
        "step_time_s": seconds / steps,
        "peak_memory_bytes": peak_memory,
    }


class StepTimer(Callback):
    """Times the optimizer steps after the first ``warmup`` up to ``trainer.max_steps``, and writes the
    figures to ``out``.

    Every rank writes its peak memory to ``out`` with its rank appended; rank 0 also
    writes images per second (all replicas' images) and the mean step time.
    """

    def __init__(self, warmup: int, out: str) -> None:
        self.warmup, self.out = warmup, Path(out)
        self._start = self._end = 0.0
        self._images = 0

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.warmup and not self._start:
            synchronize(pl_module.device)
            self._start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._start:
            self._images += len(batch[0])
        if trainer.global_step == trainer.max_steps:  # the last step: wait for it to finish
            synchronize(pl_module.device)
            self._end = time.perf_counter()

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        steps = trainer.global_step - self.warmup
        if steps < 1:
            raise RuntimeError(f"no step was timed: the run ended at step {trainer.global_step}")
        images = self._images * data_parallel_size(trainer)
        memory = peak_memory_bytes(pl_module.device)
        rank_file = self.out.with_name(f"{self.out.name}.rank{trainer.global_rank}")
        rank_file.write_text(json.dumps(memory))
        if trainer.is_global_zero:
            self.out.write_text(json.dumps(result(images, steps, self._end - self._start, [])))
