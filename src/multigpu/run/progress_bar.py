"""The progress bar of a run: Lightning's rich bar, without a wait for the GPU after every step.

Lightning's ``RichProgressBar`` reads the logged metrics it shows (the loss) after every training step, and reading
them turns each into a Python number: the CPU waits there until the GPU has finished the step, and the GPU then
waits while the CPU prepares the next one (docs/speed.md, "Every CUDA path", has what that cost on an H200). This
bar moves its count every step and reads the metrics at most once every ``metrics_every_s`` seconds, and always at
the end of an epoch and of a validation, so the figures it shows at those moments are the final ones.
"""

from time import monotonic
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import RichProgressBar
from typing_extensions import override

__all__ = ["PacedProgressBar"]


class PacedProgressBar(RichProgressBar):
    """``RichProgressBar`` whose metrics are read at most once every ``metrics_every_s`` seconds, without the log's
    version; the run's default where no progress bar is chosen."""

    def __init__(self, metrics_every_s: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.metrics_every_s = metrics_every_s
        self._metrics: dict[str, Any] = {}
        self._read_at: float | None = None  # monotonic() at the last read; None: read at the next call

    @override
    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        now = monotonic()
        if self._read_at is None or now - self._read_at >= self.metrics_every_s:
            self._metrics, self._read_at = super().get_metrics(trainer, pl_module), now
            # The TensorBoard run's version, which the rich bar shows as a number with decimals ("v_num: 0.000").
            self._metrics.pop("v_num", None)
        return self._metrics

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._read_at = None
        super().on_train_epoch_end(trainer, pl_module)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._read_at = None
        super().on_validation_end(trainer, pl_module)
