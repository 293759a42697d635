"""Where a run's time and memory go, written at each log step and nowhere else (between log steps it only reads the
host's clock): the step time and the share of it spent waiting for the loader, images per second, the model FLOP
utilisation, the hold of the last checkpoint save, and the peak memory since the last log step; under several
processes the slowest and the fastest process's, so that a straggler shows."""

import time
from typing import Any, Protocol, cast, runtime_checkable

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.profilers import PassThroughProfiler
from typing_extensions import override

from multigpu.compat import TRAIN_LOADER_NEXT, is_log_step
from multigpu.contracts import parallelism_of
from multigpu.run.device_sync import synchronize
from multigpu.run.host_memory import resident_bytes
from multigpu.run.replicas import data_parallel_size
from multigpu.run.throughput import ThroughputSummary
from multigpu.run.trainer_parts import callbacks_of, profiler_of

__all__ = ["LoaderClock", "StepTimes", "TrainingTime"]


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


class TrainingTime:
    """A clock of training since ``start``: its seconds with validations left out (``excluded``), its images and
    optimizer steps (counted by ``StepTimes``), and the loader's wait among them (``LoaderClock``, where it is the
    run's profiler)."""

    def __init__(self) -> None:
        self.since: float | None = None
        self.steps, self.images, self.excluded = 0, 0, 0.0
        self._waited_before: float | None = None

    @staticmethod
    def _waited(trainer: Trainer) -> float | None:
        profiler = profiler_of(trainer)
        return profiler.waited_s if isinstance(profiler, LoaderClock) else None

    def start(self, trainer: Trainer) -> None:
        self.since, self._waited_before = time.perf_counter(), self._waited(trainer)

    def seconds(self) -> float:
        """Training seconds since ``start`` (a few nanoseconds before it has started)."""
        if self.since is None:
            return 1e-9
        return max(time.perf_counter() - self.since - self.excluded, 1e-9)

    def wait_share(self, trainer: Trainer) -> float | None:
        """The share of ``seconds`` the training loop waited for the loader's next batch."""
        waited = self._waited(trainer)
        if waited is None or self._waited_before is None:
            return None
        return min((waited - self._waited_before) / self.seconds(), 1.0)


@runtime_checkable
class TimesItsSaves(Protocol):
    """A checkpoint IO that records how long its last save held training (``AtomicCheckpointIO``); ``held_s`` is read
    and cleared at the next log step."""

    held_s: float | None


class StepTimes(Callback):
    """Logs at each log step, over the training steps since the one before (a validation between them left out),
    under ``perf/step/``:

    - ``seconds``: wall time per optimizer step (the device waited for at the interval's end);
    - ``data_wait_share``: the share of it the training loop waited for the loader's next batch (``LoaderClock``;
      not with a profiler of the user's);
    - ``images_per_s``: training images per second over all replicas, and ``mfu``, the model FLOP utilisation, where
      the device's peak is known (``ThroughputSummary``: ``run.peak_flops``, its table of peaks by device and
      precision, or ``--throughput.peak_flops``);
    - ``checkpoint_hold_ms``: how long the last save held training (after a save);
    - ``peak_memory_gib/<device>``: the most memory allocated on each CUDA device of the process since the log step
      before (``.../reserved`` beside it): each stage's device under ``manual_model_parallel``, each process's under
      ``pipeline``; on the CPU the process's resident memory (``resident_memory_gib``);
    - under ``pipeline``, ``perf/pipeline/idle_share``: the share of the log step's schedule this process computed
      nothing, and ``perf/pipeline/idle_share_ideal``, its schedule's bubble with stages alike
      (``Parallelism.step_figures``);
    - under several processes, ``seconds_max``, ``seconds_min``, ``data_wait_share_max`` and ``data_wait_share_min``
      over them, and each process's memory and pipeline figures under its rank (``.../rank<r>``).

    ``run`` keeps the same count over the whole ``fit``, for its summary (``FitSummary``).
    """

    def __init__(self) -> None:
        self._throughput: ThroughputSummary | None = None
        self._interval, self.run = TrainingTime(), TrainingTime()
        self._validation_start: float | None = None

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._throughput = next((c for c in callbacks_of(trainer) if isinstance(c, ThroughputSummary)), None)
        self._interval, self.run = TrainingTime(), TrainingTime()

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        for clock in (self._interval, self.run):
            if clock.since is None:
                clock.start(trainer)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.run.since is not None:
            self._validation_start = time.perf_counter()

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._validation_start is not None:
            for clock in (self._interval, self.run):
                clock.excluded += time.perf_counter() - self._validation_start
            self._validation_start = None

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # The step's last batch; Lightning also steps on an epoch's last batch where accumulation has not ended.
        last = batch_idx + 1 == trainer.num_training_batches
        stepped = (batch_idx + 1) % trainer.accumulate_grad_batches == 0 or last
        for clock in (self._interval, self.run):
            clock.images += len(batch[0])
            clock.steps += stepped
        if not (stepped and is_log_step(trainer)):  # a log step's every batch is one: its last logs
            return
        devices = parallelism_of(trainer).process_devices
        for device in devices:
            synchronize(device)  # at log steps only: the interval's time is the device's too
        interval = self._interval
        seconds = interval.seconds()
        images_per_s = interval.images * data_parallel_size(trainer) / seconds
        figures = {"perf/step/seconds": seconds / interval.steps, "perf/step/images_per_s": images_per_s}
        if (wait_share := interval.wait_share(trainer)) is not None:
            figures["perf/step/data_wait_share"] = wait_share
        if self._throughput is not None and (mfu := self._throughput.mfu(images_per_s)) is not None:
            figures["perf/step/mfu"] = mfu
        io = trainer.strategy.checkpoint_io
        if isinstance(io, TimesItsSaves) and io.held_s is not None:
            figures["perf/step/checkpoint_hold_ms"] = 1000 * io.held_s
            io.held_s = None
        own = self._memory(devices) | parallelism_of(trainer).step_figures()
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            figures.update(self._spread(figures, own))
        else:
            figures.update(own)
        for name, value in figures.items():
            pl_module.log(name, value)
        self._interval = TrainingTime()
        self._interval.start(trainer)

    @staticmethod
    def _memory(devices: list[torch.device]) -> dict[str, float]:
        cuda = [device for device in devices if device.type == "cuda"]
        if not cuda:
            return {"perf/step/resident_memory_gib": resident_bytes() / 2**30}
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
        gathered = cast(list[tuple[float, float | None, dict[str, float]]], every)  # each process's, once gathered
        steps = [step for step, _, _ in gathered]
        spread = {"perf/step/seconds_max": max(steps), "perf/step/seconds_min": min(steps)}
        waits = [wait for _, wait, _ in gathered if wait is not None]
        if waits:
            spread["perf/step/data_wait_share_max"], spread["perf/step/data_wait_share_min"] = max(waits), min(waits)
        for rank, figures_of in enumerate(figures_of for _, _, figures_of in gathered):
            spread.update({f"{name}/rank{rank}": value for name, value in figures_of.items()})
        return spread
