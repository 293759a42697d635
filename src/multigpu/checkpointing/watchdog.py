"""Faults that would otherwise hang a job of several processes, or hide until the next save: a process that stalls
(a deadlocked loader, a hung device, a process stopped by the system), and a checkpoint write that failed in the
background.

Each process's watchdog thread publishes, every few seconds, where its process stands (optimizer step, its progress,
the Python stack of its training thread) under a key of the job's store (the TCPStore of ``MASTER_ADDR:MASTER_PORT``,
which Lightning's launcher, torchrun and SLURM all set up), through a client of its own with a short timeout. The job
is stalled when no process has made progress for the timeout: a batch, a validation batch, bytes of a checkpoint
write; a batch of a shape not seen before (which a compiled network compiles first) and a save to remote storage
count as progress while they last. Then the watchdog prints which process held the job up (one that stopped
answering, else the one behind) and where every process stood, and ends the job. Torch's own collective timeout is
30 minutes, and says nothing of which process is missing. The watch starts once a process's first step has ended (a
compiled network's first step may take minutes) and ends with training.
"""

import json
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from multigpu.checkpointing.checkpoint_io import AtomicCheckpointIO
from multigpu.compat import launches_subprocesses, thread_stack
from multigpu.errors import UsageError

__all__ = ["FaultWatch", "where_each_stood"]


def where_each_stood(records: dict[int, dict[str, Any] | None], now_seen: dict[int, float]) -> str:
    """One line per process: its step, how long since its last progress (or since it last answered), its stack."""
    lines = []
    for rank in sorted(records):
        record = records[rank]
        if record is None:
            lines.append(f"  process {rank}: never answered")
            continue
        silent = now_seen.get(rank, 0.0)
        answered = f", last answered {silent:.0f} s ago" if silent >= 1 else ""
        lines.append(
            f"  process {rank} (host {record['host']}, pid {record['pid']}): step {record['step']}, no progress for "
            f"{record['idle_s']:.0f} s{answered}; in {record['where']}"
        )
    return "\n".join(lines)


class FaultWatch(Callback):
    """Ends a job whose processes made no progress for ``stall_timeout_s`` seconds (0: never), naming the process that
    held it up; and raises the error of a failed background checkpoint write after the step that follows it, rather
    than at the next save (an epoch later, perhaps, while the other processes wait for its shard)."""

    def __init__(self, stall_timeout_s: float = 300.0) -> None:
        if stall_timeout_s < 0:
            raise UsageError(f"--stall_timeout_s must be at least 0 (0: never), not {stall_timeout_s}.")
        self.timeout_s = stall_timeout_s
        self._progress = 0
        self._step = 0
        self._thread: threading.Thread | None = None
        self._done: threading.Event | None = None  # made as the watch starts: a Trainer ddp_spawn pickles has none
        self._shapes: set[Any] = set()  # the batch shapes this process has run, training and evaluating
        self._new_shape = False  # whether the batch in flight is of a new shape

    def _progressed(self, trainer: Trainer) -> None:
        self._progress += 1
        self._step = trainer.global_step

    def _batch_starts(self, trainer: Trainer, batch: Any) -> None:
        """A batch of a shape this process has not seen yet may be compiled first (``--model.compile``: a validation's
        last, shorter batch, say), however long that takes: it counts as progress until it ends."""
        self._progressed(trainer)
        images = batch[0] if isinstance(batch, list | tuple) and batch else batch
        shape = (trainer.training, tuple(images.shape)) if hasattr(images, "shape") else None
        self._new_shape = shape not in self._shapes
        self._shapes.add(shape)

    def _batch_ends(self, trainer: Trainer) -> None:
        self._progressed(trainer)
        self._new_shape = False
        _raise_write_failure(trainer)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch_starts(trainer, batch)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batch_ends(trainer)
        if self._thread is None and self.timeout_s and trainer.world_size > 1 and dist.is_initialized():
            self._start(trainer)

    @override
    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._batch_starts(trainer, batch)

    @override
    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any, **kwargs: Any) -> None:
        self._batch_ends(trainer)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stop()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._stop()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop()

    def _stop(self) -> None:
        """End the watch, and wait for its thread: one still in a call to the store as the interpreter ends aborts it
        ("terminate called without an active exception")."""
        if self._done is not None:
            self._done.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        self._thread = self._done = None

    def _start(self, trainer: Trainer) -> None:
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=self._watch,
            args=(trainer, threading.current_thread(), self._done),
            name="stall watchdog",
            daemon=True,  # it never holds the process up
        )
        self._thread.start()

    def _watch(self, trainer: Trainer, training: threading.Thread, done: threading.Event) -> None:
        rank, world = trainer.global_rank, trainer.world_size
        period = min(5.0, self.timeout_s / 5)
        prefix = f"multigpu/watch/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        address = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "0"))
        try:
            store = dist.TCPStore(*address, is_master=False, timeout=timedelta(seconds=max(period, 5.0)))
        except Exception as error:  # no store to reach: nothing to watch with
            print(f"warning: the stall watchdog cannot reach the job's store ({error}); it is off", file=sys.stderr)
            return
        io = trainer.strategy.checkpoint_io
        written = io if isinstance(io, AtomicCheckpointIO) else None
        beat, last_progress, idle_since = 0, -1, time.monotonic()
        seen: dict[int, tuple[int, float]] = {}  # rank: (its last beat, when it changed)
        records: dict[int, dict[str, Any] | None] = {}
        started = time.monotonic()
        while not done.is_set():  # a beat at once, then every ``period``
            if beat:
                done.wait(period)
            progress = self._progress + (written.bytes_written if written is not None else 0)
            now = time.monotonic()
            busy = self._new_shape or (written is not None and written.writing_elsewhere)
            if progress != last_progress or busy:
                last_progress, idle_since = progress, now
            beat += 1
            record = {
                "beat": beat,
                "step": self._step,
                "events": self._progress,  # batches begun and ended: a process behind its peers has fewer
                "idle_s": now - idle_since,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "where": thread_stack(training),
            }
            try:
                store.set(f"{prefix}{rank}", json.dumps(record))
                # The first process judges; the others read its record (the store's, under Lightning's launcher),
                # and judge once they themselves have waited that long.
                judged = range(world) if rank == 0 or now - idle_since >= self.timeout_s else (0,)
                for other in judged:
                    key = f"{prefix}{other}"
                    records[other] = json.loads(store.get(key)) if store.check([key]) else records.get(other)
            except Exception:  # the store's process (the first one, under Lightning's launcher) does not answer
                if now - idle_since >= self.timeout_s and not done.is_set():
                    unanswered = f"the job's store at {address[0]}:{address[1]}"
                    self._end_job(trainer, records, {0: now - seen.get(0, (None, started))[1]}, unanswered)
                continue
            for other, found in records.items():
                if found is not None and seen.get(other, (None,))[0] != found["beat"]:
                    seen[other] = (found["beat"], now)
            if len(judged) < world:
                continue
            silent = {other: now - seen.get(other, (None, started))[1] for other in range(world)}
            stalled = all(
                silent[other] >= self.timeout_s or (records.get(other) or {}).get("idle_s", 0) >= self.timeout_s
                for other in range(world)
            )
            if stalled and not done.is_set():
                self._end_job(trainer, records, silent, None)

    def _end_job(
        self,
        trainer: Trainer,
        records: dict[int, dict[str, Any] | None],
        silent: dict[int, float],
        unanswered: str | None,
    ) -> None:
        """Print which process held the job up and where each stood, stop the processes this one can reach (the ones
        Lightning started, a frozen one on this host), and end this one."""
        mute = [other for other, seconds in silent.items() if seconds >= self.timeout_s]
        if unanswered:
            culprit = f"{unanswered} did not answer (the process that holds it is stopped or frozen)"
            mute = [0]  # under Lightning's launcher the first process holds the store
        elif mute:
            culprit = f"process {mute[0]} stopped answering (stopped, frozen or gone)"
        else:  # the one behind: the lowest step, then the fewest batches, then the longest without progress
            known = {other: record for other, record in records.items() if record is not None}
            lowest = min(
                known, key=lambda other: (known[other]["step"], known[other]["events"], -known[other]["idle_s"])
            )
            culprit = f"process {lowest} held it up, at step {known[lowest]['step']}, behind the others"
        print(
            f"error: no process of the job made progress for {self.timeout_s:.0f} s (--stall_timeout_s): {culprit}; "
            f"the job is ended. Where each process stood:\n{where_each_stood(records, silent)}",
            file=sys.stderr,
            flush=True,
        )
        host = socket.gethostname()
        for other in mute:  # a stopped process on this host would outlive the job
            record = records.get(other)
            if record is not None and record["host"] == host and record["pid"] != os.getpid():
                _kill(record["pid"])
        launcher = trainer.strategy.launcher
        if launcher is not None and launches_subprocesses(trainer.strategy):
            launcher.kill(signal.SIGKILL)
        os._exit(1)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def _raise_write_failure(trainer: Trainer) -> None:
    if isinstance(io := trainer.strategy.checkpoint_io, AtomicCheckpointIO):
        io.raise_failure()
