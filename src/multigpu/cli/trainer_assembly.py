"""The Trainer of a run, assembled in one place: Lightning's, with this application's parts put in.

- the TensorBoard logger of the run (``<default_root_dir>/<run_name>/version_N``), the checkpoint's own version on
  resume, its ``epoch`` scalar once per epoch (``RunLogger``);
- ``fsdp`` as our object (Lightning refuses the name on the CPU before it reads the registry);
- atomic checkpoint files, written in the background (``AtomicCheckpointIO``, ``--save_in_background``), which
  hands Lightning the checkpoint of ``--ckpt_path`` as the CLI read it, so that a run reads it once;
- the progress bar and the model summary in place of Lightning's defaults, unless the user chose their own;
- ``last.ckpt`` every ``--save_every_n_steps`` steps (``LastCheckpoint``);
- who launched the processes, noted before Lightning's launcher starts any (``RunMetadata``);
- the training loop's wait for the loader timed (``LoaderClock``), unless the user chose a profiler;
- ``--trainer.max_time`` checked by the stop vote after every step, Lightning's Timer at epochs' ends only;
- the watch over faults: a stalled process, a failed background write (``FaultWatch``, ``--stall_timeout_s``);
- the combinations that would only fail once training has started, refused.
"""

from collections.abc import Callable

from lightning.pytorch import Callback, Trainer
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar, RichModelSummary, RichProgressBar, Timer
from lightning.pytorch.utilities import rank_zero_info

from multigpu.checkpointing.checkpoint_io import AtomicCheckpointIO
from multigpu.checkpointing.resume import ResumePoint, RunMetadata
from multigpu.checkpointing.saving import LastCheckpoint
from multigpu.checkpointing.watchdog import FaultWatch
from multigpu.cli.run_options import RunOptions
from multigpu.cli.saved_options import checkpoint_dir
from multigpu.errors import UsageError
from multigpu.run.model_summary import RunSummary
from multigpu.run.progress_bar import PacedProgressBar
from multigpu.run.run_logger import RunLogger
from multigpu.run.step_times import LoaderClock
from multigpu.run.trainer_parts import callbacks_of
from multigpu.strategies import spec_named

__all__ = ["assemble_trainer"]


def assemble_trainer(
    build: Callable[..., Trainer],
    options: RunOptions,
    chosen: list[Callback],
    resumed: ResumePoint | None,
    **kwargs,
) -> Trainer:
    """The run's Trainer: ``build(**kwargs)`` (LightningCLI's) with the parts above, for the subcommand's ``options``,
    the callbacks the user chose (``chosen``) and the checkpoint it goes on from (its TensorBoard version, and the
    contents the CLI read)."""
    trainer_options = options.trainer
    if trainer_options.logger in (None, True):
        kwargs["logger"] = RunLogger(
            save_dir=trainer_options.log_root,
            name=options.run_name,
            version=resumed.log_version if resumed is not None else None,
            default_hp_metric=False,  # no empty hp_metric card: the metrics are logged by name
        )
    spec = spec_named(trainer_options.strategy)
    if spec is not None and spec.as_instance and spec.strategy is not None:
        kwargs["strategy"] = spec.strategy()
    if trainer_options.plugins is None:
        kwargs["plugins"] = [AtomicCheckpointIO(background=options.save_in_background)]
    if trainer_options.profiler is None:
        kwargs["profiler"] = LoaderClock()
    chosen = list(chosen)  # as the user chose them: Lightning appends its defaults to the list it is given
    checkpointing = trainer_options.enable_checkpointing is not False
    every = options.save_every_n_steps or 0
    if not checkpointing:  # Lightning refuses its own flag beside our checkpoint callback, which is always there
        if every:
            raise UsageError(
                "--save_every_n_steps and --trainer.enable_checkpointing=false disagree: drop one of them."
            )
        kwargs["enable_checkpointing"] = True
    try:
        trainer = build(**kwargs)
    except ValueError as error:  # Lightning's checks of accelerator, strategy and devices
        raise UsageError(str(error)) from error
    checkpoint_io = trainer.strategy.checkpoint_io
    if resumed is not None and isinstance(checkpoint_io, AtomicCheckpointIO):  # ours, or the user's plugin of its class
        checkpoint_io.hand_over(options.ckpt_path, resumed.checkpoint)
    callbacks = callbacks_of(trainer)
    if not checkpointing:
        callbacks[:] = [callback for callback in callbacks if not isinstance(callback, ModelCheckpoint)]
        rank_zero_info("Checkpoints are off (--trainer.enable_checkpointing=false): this run cannot be resumed.")
    for callback in callbacks:
        if isinstance(callback, RunMetadata):
            callback.note_launch(trainer)
    if trainer_options.max_time is not None:  # its step check broadcasts every step; the stop vote carries it
        for index, callback in enumerate(callbacks):
            if type(callback) is Timer and callback not in chosen:
                callbacks[index] = Timer(trainer_options.max_time, interval="epoch")
    bar = trainer.progress_bar_callback
    bar_chosen = any(isinstance(callback, ProgressBar) for callback in chosen)
    if not bar_chosen and type(bar) is RichProgressBar:  # Lightning's default, added to the list it was given
        callbacks[callbacks.index(bar)] = PacedProgressBar()
    summary = next((callback for callback in callbacks if type(callback) is RichModelSummary), None)
    if summary is not None and summary not in chosen:  # Lightning's default, as the bar
        callbacks[callbacks.index(summary)] = RunSummary()
    if every:  # last.ckpt comes from LastCheckpoint alone; the other one keeps the best
        best = trainer.checkpoint_callback
        assert isinstance(best, ModelCheckpoint)  # checkpointing is on: BestCheckpoints
        best.save_last = False
        dirpath = checkpoint_dir(options.checkpoint_root, options.run_name)
        callbacks.append(LastCheckpoint(dirpath, every_n_train_steps=every))
    callbacks.append(FaultWatch(stall_timeout_s=options.stall_timeout_s))
    if trainer_options.sync_batchnorm and not isinstance(trainer.accelerator, CUDAAccelerator):
        raise UsageError("--trainer.sync_batchnorm=true needs CUDA devices (SyncBatchNorm); drop it on the CPU.")
    return trainer
