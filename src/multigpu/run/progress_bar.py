"""The progress bar of a run: Lightning's rich bar, without a wait for the GPU after every step.

Lightning's ``RichProgressBar`` reads the logged metrics it shows (the loss) after every training step, and reading
them turns each into a Python number: the CPU waits there until the GPU has finished the step, and the GPU then
waits while the CPU prepares the next one (docs/speed.md, "Every CUDA path", has what that cost on an H200). This
bar moves its count every step and reads the metrics where the log reads them too: after each log step
(``--trainer.log_every_n_steps``), and at the end of an epoch and of a validation, so the figures it shows at
those moments are the final ones.

Lightning also turns every value logged with ``prog_bar=True`` into a number after every training step, whatever
the bar does; so the training loss is logged without it, and this bar shows it (``SHOWN``) from the logged values
when it reads them.
"""

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import RichProgressBar
from typing_extensions import override

from multigpu.compat import is_log_step

__all__ = ["SHOWN", "PacedProgressBar"]

SHOWN = ("train/loss",)  # training metrics the bar shows, logged without ``prog_bar``


class PacedProgressBar(RichProgressBar):
    """``RichProgressBar`` whose metrics are read after log steps and at the ends of epochs and validations, without
    the log's version; the run's default where no progress bar is chosen."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._metrics: dict[str, Any] = {}
        self._stale = True  # read at the next call

    @override
    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        if self._stale or (trainer.training and is_log_step(trainer)):
            self._metrics, self._stale = super().get_metrics(trainer, pl_module), False
            logged = trainer.callback_metrics
            self._metrics.update({name: float(logged[name]) for name in SHOWN if name in logged})
            # The TensorBoard run's version, which the rich bar shows as a number with decimals ("v_num: 0.000").
            self._metrics.pop("v_num", None)
        return self._metrics

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stale = True
        super().on_train_epoch_end(trainer, pl_module)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stale = True
        super().on_validation_end(trainer, pl_module)
