"""Where a run's time and memory go, written at each log step and nowhere else (between log steps it only reads the
host's clock): the step time and the share of it spent waiting for the loader, images per second, the model FLOP
utilisation, the hold of the last checkpoint save, and the peak memory since the last log step; under several
processes the slowest and the fastest process's, so that a straggler shows."""

import os
import time
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.profilers import PassThroughProfiler
from typing_extensions import override

from multigpu.compat import TRAIN_LOADER_NEXT, is_log_step
from multigpu.contracts import layout_of
from multigpu.run.callbacks import ThroughputSummary
from multigpu.run.checkpoint_io import AtomicCheckpointIO
from multigpu.run.device_sync import synchronize
from multigpu.run.replicas import data_parallel_size

__all__ = ["LoaderClock", "StepTimes"]


def _resident_gib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


class LoaderClock(PassThroughProfiler):
    """Lightning's default profiler, which records nothing, but for one action: the training loop's wait for the
    loader's next batch, added up in ``waited_s``. The run's profiler unless the user chooses one
    (``--trainer.profiler``, whose own report then says where the time went)."""

    def __init__(self) -> None:
        super().__init__()
        self.waited_s = 0.0
        self._started: float | None = None

    @override
    def start(self, action_name: str) -> None:
        if action_name == TRAIN_LOADER_NEXT:
            self._started = time.perf_counter()

    @override
    def stop(self, action_name: str) -> None:
        if action_name == TRAIN_LOADER_NEXT and self._started is not None:
            self.waited_s += time.perf_counter() - self._started
            self._started = None


class StepTimes(Callback):
    """Logs at each log step, over the training steps since the one before (a validation between them left out),
    under ``perf/step/``:

    - ``seconds``: wall time per optimizer step (the device waited for at the interval's end);
    - ``data_wait_share``: the share of it the training loop waited for the loader's next batch (``LoaderClock``;
      not with a profiler of the user's);
    - ``images_per_s``: training images per second over all replicas, and ``mfu``, the model FLOP utilisation, where
      the device's peak is known (``ThroughputSummary``: Lightning's table of peaks by device and precision, or
      ``--throughput.peak_flops``);
    - ``checkpoint_hold_ms``: how long the last save held training (after a save);
    - ``peak_memory_gib/<device>``: the most memory allocated on each CUDA device of the process since the log step
      before (``.../reserved`` beside it): each stage's device under ``manual_model_parallel``, each process's under
      ``pipeline``; on the CPU the process's resident memory (``resident_memory_gib``);
    - under ``pipeline``, ``perf/pipeline/idle_share``: the share of the log step's schedule this process computed
      nothing, and ``perf/pipeline/idle_share_ideal``, its schedule's bubble with stages alike
      (``StrategyLayout.step_figures``);
    - under several processes, ``seconds_max``, ``seconds_min``, ``data_wait_share_max`` and ``data_wait_share_min``
      over them, and each process's memory and pipeline figures under its rank (``.../rank<r>``).
    """

    def __init__(self) -> None:
        self._throughput: ThroughputSummary | None = None
        self._reset(None, None)

    def _reset(self, now: float | None, trainer: Trainer | None) -> None:
        self._since, self._steps, self._images, self._excluded = now, 0, 0, 0.0
        self._waited_before = self._waited(trainer)
        self._validation_start: float | None = None

    @staticmethod
    def _waited(trainer: Trainer | None) -> float | None:
        profiler = trainer.profiler if trainer is not None else None
        return profiler.waited_s if isinstance(profiler, LoaderClock) else None

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._throughput = next((c for c in trainer.callbacks if isinstance(c, ThroughputSummary)), None)
        self._reset(None, None)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._since is None:
            self._reset(time.perf_counter(), trainer)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._since is not None:
            self._validation_start = time.perf_counter()

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._validation_start is not None:
            self._excluded += time.perf_counter() - self._validation_start
            self._validation_start = None

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._images += len(batch[0])
        stepped = (batch_idx + 1) % trainer.accumulate_grad_batches == 0  # the step's last batch
        self._steps += stepped
        if not (stepped and is_log_step(trainer)):  # a log step's every batch is one: its last logs
            return
        devices = layout_of(trainer).process_devices
        for device in devices:
            synchronize(device)  # at log steps only: the interval's time is the device's too
        seconds = max(time.perf_counter() - self._since - self._excluded, 1e-9)
        images_per_s = self._images * data_parallel_size(trainer) / seconds
        figures = {"perf/step/seconds": seconds / self._steps, "perf/step/images_per_s": images_per_s}
        waited = self._waited(trainer)
        if waited is not None and self._waited_before is not None:
            figures["perf/step/data_wait_share"] = min((waited - self._waited_before) / seconds, 1.0)
        if self._throughput is not None and (mfu := self._throughput.mfu(images_per_s)) is not None:
            figures["perf/step/mfu"] = mfu
        io = trainer.strategy.checkpoint_io
        if isinstance(io, AtomicCheckpointIO) and io.held_s is not None:
            figures["perf/step/checkpoint_hold_ms"] = 1000 * io.held_s
            io.held_s = None
        own = self._memory(devices) | layout_of(trainer).step_figures()
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            figures.update(self._spread(figures, own))
        else:
            figures.update(own)
        for name, value in figures.items():
            pl_module.log(name, value)
        self._reset(time.perf_counter(), trainer)

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
    def _spread(figures: dict[str, float], own: dict[str, float]) -> dict[str, float]:
        """The slowest and fastest process's step time and data wait, and every process's own figures (memory, a
        pipeline's idle share) under its rank, from one all-gather on the host, at log steps only (the first process
        writes the logs)."""
        every: list[tuple[float, float | None, dict[str, float]] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(every, (figures["perf/step/seconds"], figures.get("perf/step/data_wait_share"), own))
        steps = [step for step, _, _ in every]
        spread = {"perf/step/seconds_max": max(steps), "perf/step/seconds_min": min(steps)}
        waits = [wait for _, wait, _ in every if wait is not None]
        if waits:
            spread["perf/step/data_wait_share_max"], spread["perf/step/data_wait_share_min"] = max(waits), min(waits)
        for rank, figures_of in enumerate(figures_of for _, _, figures_of in every):
            spread.update({f"{name}/rank{rank}": value for name, value in figures_of.items()})
        return spread
