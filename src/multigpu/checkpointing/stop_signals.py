"""How a run stops: on a stop signal or the time limit, every process after the same step with ``last.ckpt`` written
(``CheckpointOnStopSignal``); when the process that launched the others fails, those at once
(``StopAllProcessesOnError``)."""

import signal
import sys
import threading
import time
import traceback
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, Timer
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from multigpu.checkpointing.checkpoint_io import AtomicCheckpointIO
from multigpu.checkpointing.stop_votes import StopVotes
from multigpu.compat import (
    launches_subprocesses,
    replace_sigterm_notifier,
    save_last_checkpoint,
    skip_sigterm_broadcast,
    stop_after_this_step_as_on_sigterm,
)
from multigpu.errors import JobFailed
from multigpu.run.trainer_parts import callbacks_of

__all__ = ["CheckpointOnStopSignal", "StopAllProcessesOnError"]


class CheckpointOnStopSignal(Callback):
    """On SIGTERM (what SLURM and most schedulers send before they stop a job), SIGUSR1 (what SLURM sends ahead of the
    time limit when asked, ``--signal=USR1@90``) or a first Ctrl-C (SIGINT), every process stops after the same
    optimizer step, ``last.ckpt`` is written, and the processes exit: with status 0 after SIGTERM or SIGUSR1, 130
    after Ctrl-C. A second Ctrl-C stops at once, without a checkpoint and without waiting for the one being written,
    as Lightning's own Ctrl-C ends a run (status 1).
    The vote also carries ``--trainer.max_time``: when a process runs out of time, every process stops after the
    same step (Lightning's Timer broadcasts its decision every step; here it checks at epochs' ends only).

    The same command with ``--ckpt_path last`` then continues where the run stopped.

    The handler only notes the signal (and passes SIGTERM on to the processes Lightning started, as Lightning does; a
    terminal's Ctrl-C reaches every process of the job already). After every optimizer step the processes vote on
    what they have seen (``StopVotes``: a non-blocking all-reduce on a gloo group, read one step later, or at the
    step's end where steps last over a second), so all of them stop after the same step: the one in flight when the
    signal came, and the next where steps are short. No vote waits for the device
    or, in practice, for another process; Lightning's own handler broadcasts a flag every step (a wait for the GPU)
    and from inside the signal handler (a hang when the signal reaches the processes at different moments), and both
    are left out (``replace_sigterm_notifier``, ``skip_sigterm_broadcast``). One process stops after its step.
    """

    SIGNALS = ("SIGTERM", "SIGUSR1", "Ctrl-C")  # as the processes agree on them: the higher wins
    LONG_STEP_S = 1.0  # steps longer than this on some process: each step's vote is read at its own end

    def __init__(self) -> None:
        self._signal: str | None = None  # the stop signal's name, once one arrived
        self._agreed = False  # whether every process has agreed on it
        self._trainer: Trainer | None = None
        self._votes = StopVotes()
        self._lag = 1  # steps between a vote and its reading, as the processes last chose it (``StopVotes``)
        self._step_end: float | None = None  # when this process's last optimizer step ended

    @property
    def stopped_by(self) -> str | None:
        """The signal that stopped the run, once every process agreed on it."""
        return self._signal if self._signal in self.SIGNALS and self._agreed else None

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Before Lightning registers its SIGTERM handler (as fit starts), so that the handler it registers calls
        # this one's note in place of its own notifier, which broadcasts from inside the handler: a process
        # signalled before training starts (during the sanity check, say) would wait there for the others.
        self._signal, self._trainer, self._agreed = None, trainer, False
        if stage == "fit":  # validate, test and predict stop at Lightning's next batch, as Lightning has them
            replace_sigterm_notifier(trainer, self._note)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._trainer, self._lag, self._step_end = trainer, 1, None
        skip_sigterm_broadcast(trainer)
        self._votes.open()
        if threading.current_thread() is threading.main_thread():
            # Replace Lightning's handlers for this run; Lightning restores the previous ones at its teardown.
            for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
                signal.signal(signum, self._note)

    def _note(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT:
            if self._signal == "Ctrl-C":  # the second one: stop now, as Lightning does, leaving the write in flight
                io = self._trainer.strategy.checkpoint_io if self._trainer is not None else None
                if isinstance(io, AtomicCheckpointIO):
                    io.abandon()
                if self._trainer is not None and self._trainer.is_global_zero:
                    print(
                        "\nCtrl-C again: stopping now; a checkpoint being written is given up, the one before stays.",
                        file=sys.stderr,
                        flush=True,
                    )
                raise KeyboardInterrupt
            if self._trainer is not None and self._trainer.is_global_zero:
                print(
                    "\nCtrl-C: stopping after this step and writing last.ckpt (Ctrl-C again to stop at once, "
                    "without it: from now on, a press before this line counted once) ...",
                    file=sys.stderr,
                    flush=True,
                )
        else:
            launcher = self._trainer.strategy.launcher if self._trainer is not None else None
            if self._signal is None and launcher is not None:
                launcher.kill(signum)
        names: dict[int, str] = {signal.SIGINT: "Ctrl-C", signal.SIGUSR1: "SIGUSR1"}
        self._signal = self._signal or names.get(signum, "SIGTERM")

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        epoch_loop = trainer.fit_loop.epoch_loop
        last = epoch_loop.batch_progress.is_last_batch
        if (batch_idx + 1) % trainer.accumulate_grad_batches and not last:
            return  # inside a step that accumulates batches: a stop waits for its optimizer step
        signalled = self.SIGNALS.index(self._signal) + 1 if self._signal else 0
        timer = next((callback for callback in callbacks_of(trainer) if isinstance(callback, Timer)), None)
        remaining = timer.time_remaining() if timer is not None else None
        now = time.monotonic()
        long_step = self._step_end is not None and now - self._step_end > self.LONG_STEP_S
        self._step_end = now
        vote: tuple[int, ...] = (signalled, int(remaining is not None and remaining <= 0), int(long_step))
        if self._votes.is_open:  # an epoch's end waits for every vote: a stop after it, or none
            vote = self._votes.settle(vote) if last else self._votes.cast(vote, self._lag)
            self._lag = 0 if vote[2] else 1  # chosen together: every process reads the same votes at each step
        signalled, out_of_time, _ = vote
        if signalled:
            self._signal, self._agreed = self.SIGNALS[signalled - 1], True  # the same on every process
            stop_after_this_step_as_on_sigterm(trainer)
        elif out_of_time and not trainer.should_stop:  # the Timer checks at epochs' ends only (trainer_assembly)
            trainer.should_stop = True
            assert timer is not None  # every process has the same Timer, whose time is out
            rank_zero_info(f"Time limit reached ({timer.time_elapsed():.0f} s of training): stopping after this step.")

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._votes.close()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        stopped = isinstance(exception, SIGTERMException)
        self._votes.close(wait=stopped)  # after a failure, another process may never vote again
        if not isinstance(exception, SIGTERMException):
            return
        # The checkpoint callback that keeps last.ckpt writes it, and records it in its own state,
        # so that the resumed run goes on rewriting the same file.
        keepers = (callback for callback in trainer.checkpoint_callbacks if isinstance(callback, ModelCheckpoint))
        keeper = next((callback for callback in keepers if callback.save_last), None)
        if keeper is not None and keeper.dirpath:
            io = trainer.strategy.checkpoint_io
            try:
                save_last_checkpoint(keeper, trainer)
                if isinstance(io, AtomicCheckpointIO):
                    io.join()  # on disk before the line says so (its error, if any, is raised as the run ends)
            except KeyboardInterrupt:  # Ctrl-C again (``_note`` gave the write up): the run ends as on Lightning's own
                exception.code = 1  # Ctrl-C, with the other callbacks, the loggers and the teardown, and status 1
                if threading.current_thread() is threading.main_thread():
                    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as Lightning: later presses do not cut that short
                return
            if not (isinstance(io, AtomicCheckpointIO) and io.failed):
                rank_zero_info(
                    f"Received {self._signal}: saved {keeper.last_model_path} at step {trainer.global_step}; resume "
                    "with --ckpt_path last."
                )
        if self._signal == "Ctrl-C" and (trainer.world_size == 1 or launches_subprocesses(trainer.strategy)):
            exception.code = 130  # the job's own process, as a shell expects after an interrupt: `fit && test` stops


class StopAllProcessesOnError(Callback):
    """When the process that launched the others fails, kill them at once.

    Lightning's launcher already ends the job when one of the processes it started
    fails; the other way round, those processes would wait in their next collective
    (NCCL's default timeout is 30 minutes) for a rank that is gone.
    """

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if not launches_subprocesses(trainer.strategy) or isinstance(exception, SIGTERMException | KeyboardInterrupt):
            return
        # Lightning's watch over the processes it started kills this one too once it sees them gone, perhaps before
        # the error reaches the terminal: it is printed first (``printed``: the CLI does not print it again).
        if isinstance(exception, Exception) and not getattr(exception, "printed", False):
            if isinstance(exception, JobFailed):
                print(f"error: {' '.join(str(exception).split())}", file=sys.stderr, flush=True)
            else:
                traceback.print_exception(exception, file=sys.stderr)
                sys.stderr.flush()
            exception.printed = True  # type: ignore[attr-defined]  # a mark the CLI reads
        launcher = trainer.strategy.launcher
        assert launcher is not None  # launches_subprocesses: it has one
        launcher.kill(signal.SIGKILL)
