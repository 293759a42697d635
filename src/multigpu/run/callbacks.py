"""Callbacks the CLI adds to every run."""

import signal
import sys
import threading
import time
import traceback
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, Timer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from multigpu.compat import (
    launches_subprocesses,
    replace_sigterm_notifier,
    save_last_checkpoint,
    should_skip_saving,
    skip_sigterm_broadcast,
    stop_after_this_step_as_on_sigterm,
)
from multigpu.errors import JobFailed, UsageError
from multigpu.run.checkpoint_io import AtomicCheckpointIO
from multigpu.run.loop_position import reopen_cut_epoch
from multigpu.run.peak_flops import peak_flops as device_peak_flops
from multigpu.run.replicas import data_parallel_size
from multigpu.run.resume import KEY, layout_record, resume, training_order
from multigpu.run.stop_votes import StopVotes
from multigpu.run.trainer_parts import callbacks_of, datamodule_of, is_fast_dev_run

__all__ = [
    "BestCheckpoints",
    "CheckpointOnStopSignal",
    "LastCheckpoint",
    "RunMetadata",
    "StopAllProcessesOnError",
    "ThroughputSummary",
]


class ThroughputSummary(Callback):
    """Logs training images per second, model FLOP utilisation (MFU) and the epoch time, and prints
    one line per epoch with them and the epoch's losses.

    Images per second count training batches over all data-parallel replicas and exclude
    validation. MFU is ``images/s x FLOPs per image / (peak FLOP/s x devices)``: the FLOPs
    of one image's forward and backward pass come once from the model's
    ``training_flops_per_image()`` (torch's flop counter), the peak from ``peak_flops``
    or, on known GPUs, from the table for the run's precision (``multigpu.run.peak_flops``:
    H100, H200, A100, L4, and Lightning's for others). Without either, MFU is left out.

    Args:
        peak_flops: peak FLOP/s of one device, for devices no table knows (the CPU, say), or to
            compare against another figure than the table's.
    """

    def __init__(self, peak_flops: float | None = None) -> None:
        if peak_flops is not None and peak_flops <= 0:
            raise UsageError(f"throughput.peak_flops must be a positive FLOP/s figure, not {peak_flops}.")
        self.peak_flops = peak_flops
        self._peak: float | None = None  # all devices' peak FLOP/s, when known
        self._flops_per_image: int | None = None
        self._start = self._train_end = 0.0
        self._images = 0

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Once per run, and the FLOPs only where there is a peak to divide them by.
        peak = self.peak_flops or device_peak_flops(trainer.strategy.root_device, str(trainer.precision))
        self._peak = peak * trainer.num_devices * trainer.num_nodes if peak else None
        count = getattr(pl_module, "training_flops_per_image", None)
        self._flops_per_image = count() if self._peak and count else None

    def mfu(self, images_per_s: float) -> float | None:
        """The model FLOP utilisation of training at ``images_per_s`` over all replicas; ``None`` where the devices'
        peak is not known (once ``fit`` has started)."""
        if not self._peak or not self._flops_per_image:
            return None
        return images_per_s * self._flops_per_image / self._peak

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.on_train_epoch_start(trainer, pl_module)  # a run resumed mid-epoch gets no epoch start

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start = self._train_end = time.perf_counter()
        self._images = 0

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._images += len(batch[0])
        self._train_end = time.perf_counter()

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._images:  # an epoch resumed after its last batch: nothing trained, no point to log
            return
        epoch_time = time.perf_counter() - self._start
        train_time = max(self._train_end - self._start, 1e-9)
        images_per_s = self._images * data_parallel_size(trainer) / train_time
        pl_module.log("perf/epoch_time_s", epoch_time, sync_dist=True)
        pl_module.log("perf/images_per_s", images_per_s, sync_dist=True)
        metrics = trainer.callback_metrics
        parts = [f"epoch {trainer.current_epoch}", f"step {trainer.global_step}"]
        parts += [f"{key} {float(metrics[key]):.4f}" for key in ("train/loss", "val/loss", "val/acc") if key in metrics]
        parts.append(f"{images_per_s:.1f} img/s")
        if (mfu := self.mfu(images_per_s)) is not None:
            pl_module.log("perf/mfu", mfu, sync_dist=True)
            parts.append(f"MFU {100 * mfu:.1f}%")
        parts.append(f"{epoch_time:.1f} s")
        pl_module.print(" | ".join(parts))


def _data_description(datamodule: Any) -> dict[str, Any]:
    """What ``export`` and ``predict`` need to know of the data the run trained on: its class names, and the mean
    and std its images were normalised with (an image folder's were measured)."""
    description = {}
    if classes := getattr(datamodule, "classes", None):
        description["classes"] = list(classes)
    if stats := getattr(datamodule, "known_stats", None):  # a data module of ours, its mean and std known
        description["mean"], description["std"] = (list(values) for values in stats)
    return description


class RunMetadata(Callback):
    """Stores in each checkpoint how it was made and where training stands, under the key ``"multigpu"``; on resume,
    hands the checkpoint to ``run.resume``, the one owner of resume.

    The CLI reads ``log_version`` back on ``--ckpt_path`` so that a resumed run
    continues the same TensorBoard run.
    """

    def __init__(self) -> None:
        # Whether torchrun or SLURM started the processes, as the environment said before the launch (``note_launch``).
        self.started_outside: bool | None = None

    def note_launch(self, trainer: Trainer) -> None:
        """Record who starts the processes, before ``trainer`` launches any: after, Lightning's launcher has set the
        variables that would make its own processes look started from outside."""
        environment = getattr(trainer.strategy, "cluster_environment", None)
        self.started_outside = environment.creates_processes_externally if environment is not None else None

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Who started the processes: Lightning, or torchrun or SLURM (creates_processes_externally), as the
        # environment said before Lightning's launcher put LOCAL_RANK into the first process's variables too.
        environment = getattr(trainer.strategy, "cluster_environment", None)
        if environment is not None and trainer.world_size > 1:
            outside = self.started_outside
            if outside is None:
                outside = environment.creates_processes_externally
            started = "started outside Lightning" if outside else "started by Lightning"
            rank_zero_info(
                f"{type(environment).__name__}: {trainer.world_size} process(es) on {trainer.num_nodes} node(s), "
                f"{started}."
            )

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        order = training_order(trainer)  # before the loop counters below are reopened
        checkpoint[KEY] = {
            "log_version": trainer.logger.version if trainer.logger else None,
            **layout_record(trainer, pl_module),
            "data": _data_description(datamodule_of(trainer)),
            **({"order": order} if order is not None else {}),
        }
        if "loops" in checkpoint:  # an epoch a limit cut short resumes inside it
            reopen_cut_epoch(checkpoint["loops"]["fit_loop"])

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        if trainer.state.fn == TrainerFn.FITTING:  # the layout and the order only matter to training
            resume(trainer, pl_module, checkpoint)


class BestCheckpoints(ModelCheckpoint):
    """Lightning's ModelCheckpoint (``--checkpoint.*``), except after an epoch that a limit (``max_steps``,
    ``max_time``) stopped before its last batch: nothing was validated to rank, so only ``last.ckpt`` is written
    (where Lightning would rank a best-k file without the monitored metric, and warn), and it resumes inside
    that epoch; and at the end of training ``last.ckpt`` holds the last step trained, whatever was ranked."""

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            super().on_train_epoch_end(trainer, pl_module)
        elif self.save_last and not should_skip_saving(self, trainer):
            save_last_checkpoint(self, trainer)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After a validation, Lightning writes last.ckpt only where it wrote a best-k file: a run that validates
        # mid-epoch (val_check_interval) and whose last validation ranks nothing would keep an older last.ckpt (its
        # own check here covers a run that never wrote last.ckpt only).
        super().on_train_end(trainer, pl_module)
        if self.save_last and not should_skip_saving(self, trainer):
            save_last_checkpoint(self, trainer)


class LastCheckpoint(ModelCheckpoint):
    """Writes ``last.ckpt`` every N optimizer steps and at the end of every training epoch.

    Lightning's ModelCheckpoint takes either a step or an epoch interval, not both; this
    one keeps the newest state on disk for a resume after a kill, while the run's other
    ModelCheckpoint keeps the best ones by the monitored metric.
    """

    def __init__(self, dirpath: str, every_n_train_steps: int) -> None:
        super().__init__(dirpath=dirpath, every_n_train_steps=every_n_train_steps, save_top_k=0, save_last=True)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Only an optimizer step's last batch saves. Lightning tests the step count after every batch, and forgets
        # the step it last saved across a resume: a run resumed at a multiple of N that accumulates batches saved
        # again after the first batch of its first step, half of whose images its checkpoint then counted as
        # trained (a kill before the next save lost them from a resumed run).
        last = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0 or last:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After an epoch's last batch, also when the step interval has just saved this very step (ModelCheckpoint
        # would skip it): that checkpoint was written before the epoch counted as done, and resumes into the
        # epoch's end; after the last epoch, the run would not be seen as finished. An epoch cut short by
        # max_steps keeps the step's checkpoint, which resumes inside the epoch.
        epoch_complete = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        if not should_skip_saving(self, trainer) or (
            epoch_complete
            and not (is_fast_dev_run(trainer) or trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING)
        ):
            save_last_checkpoint(self, trainer)


class CheckpointOnStopSignal(Callback):
    """On SIGTERM (what SLURM and most schedulers send before they stop a job), SIGUSR1 (what SLURM sends ahead of the
    time limit when asked, ``--signal=USR1@90``) or a first Ctrl-C (SIGINT), every process stops after the same
    optimizer step, ``last.ckpt`` is written, and the processes exit: with status 0 after SIGTERM or SIGUSR1, 130
    after Ctrl-C. A second Ctrl-C stops at once, without a checkpoint and without waiting for the one being written.
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
            save_last_checkpoint(keeper, trainer)
            rank_zero_info(
                f"Received {self._signal}: saved {keeper.last_model_path} at step {trainer.global_step}; resume with "
                "--ckpt_path last."
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
