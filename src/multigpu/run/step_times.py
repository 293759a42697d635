"""Where a run's time and memory go, written at each log step and nowhere else (between log steps it only reads the
host's clock): the step time, the share of it between batches (the loader's wait among it), images per second, the
hold of the last checkpoint save, and the peak memory since the last log step; under several processes the slowest
and the fastest process's, so that a straggler shows."""

import os
import time
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from multigpu.compat import is_log_step
from multigpu.contracts import layout_of
from multigpu.run.checkpoint_io import AtomicCheckpointIO
from multigpu.run.device_sync import synchronize
from multigpu.run.replicas import data_parallel_size

__all__ = ["StepTimes"]


def _resident_gib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


class StepTimes(Callback):
    """Logs at each log step, over the steps since the one before, under ``perf/step/``:

    - ``seconds``: wall time per optimizer step (the interval's, the device waited for at its end);
    - ``between_batches_share``: the share of it between a batch's end and the next one's start, where the training
      thread waits for the loader's next batch (and Lightning does its work between batches: a slow loader shows
      there, but it is not the loader's wait alone);
    - ``images_per_s``: training images per second over all replicas;
    - ``checkpoint_hold_ms``: how long the last save held training (after a save);
    - ``peak_memory_gib/<device>``: the most memory allocated on each CUDA device of the process since the log step
      before (``.../reserved`` beside it); on the CPU the process's resident memory (``resident_memory_gib``);
    - under several processes, ``seconds_max``, ``seconds_min`` and ``between_batches_share_max`` over them.
    """

    def __init__(self) -> None:
        self._reset(None)

    def _reset(self, now: float | None) -> None:
        self._since, self._batch_end = now, now
        self._waited, self._steps, self._images = 0.0, 0, 0

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._reset(None)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        if self._since is None:
            self._reset(now)
        elif self._batch_end is not None:
            self._waited += now - self._batch_end  # the loader's next batch, and Lightning's work around it

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._images += len(batch[0])
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self._steps += 1
        if not is_log_step(trainer) or not self._steps:
            self._batch_end = time.perf_counter()
            return
        devices = layout_of(trainer).process_devices
        for device in devices:
            synchronize(device)  # at log steps only: the interval's time is the device's too
        now = time.perf_counter()
        seconds = max(now - self._since, 1e-9)
        figures = {
            "perf/step/seconds": seconds / self._steps,
            "perf/step/between_batches_share": self._waited / seconds,
            "perf/step/images_per_s": self._images * data_parallel_size(trainer) / seconds,
        }
        io = trainer.strategy.checkpoint_io
        if isinstance(io, AtomicCheckpointIO) and io.held_s is not None:
            figures["perf/step/checkpoint_hold_ms"] = 1000 * io.held_s
            io.held_s = None
        figures.update(self._memory(devices))
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            figures.update(self._spread(figures))
        for name, value in figures.items():
            pl_module.log(name, value)
        self._reset(time.perf_counter())

    @staticmethod
    def _memory(devices: list[torch.device]) -> dict[str, float]:
        cuda = [device for device in devices if device.type == "cuda"]
        if not cuda:
            return {"perf/step/resident_memory_gib": _resident_gib()}
        figures = {}
        for device in cuda:
            figures[f"perf/step/peak_memory_gib/{device}"] = torch.cuda.max_memory_allocated(device) / 2**30
            figures[f"perf/step/peak_memory_gib/{device}/reserved"] = torch.cuda.max_memory_reserved(device) / 2**30
            torch.cuda.reset_peak_memory_stats(device)
        return figures

    @staticmethod
    def _spread(figures: dict[str, float]) -> dict[str, float]:
        """The slowest and fastest process's step time, and the largest data-wait share, over every process (one
        all-gather on the host, at log steps only)."""
        every: list[tuple[float, float] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(every, (figures["perf/step/seconds"], figures["perf/step/between_batches_share"]))
        steps = [step for step, _ in every]
        return {
            "perf/step/seconds_max": max(steps),
            "perf/step/seconds_min": min(steps),
            "perf/step/between_batches_share_max": max(wait for _, wait in every),
        }
