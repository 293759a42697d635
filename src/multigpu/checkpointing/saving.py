"""Which checkpoint files a run writes, and when: the best ones by the monitored metric and ``last.ckpt``
(``BestCheckpoints``, ``--checkpoint.*``), and ``last.ckpt`` every N optimizer steps (``LastCheckpoint``,
``--save_every_n_steps``)."""

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from multigpu.compat import save_last_checkpoint, should_skip_saving
from multigpu.run.trainer_parts import is_fast_dev_run

__all__ = ["BestCheckpoints", "LastCheckpoint"]


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
