"""The TensorBoard logger of a run."""

from collections.abc import Mapping

from lightning.pytorch.loggers import TensorBoardLogger
from typing_extensions import override

__all__ = ["RunLogger"]


class RunLogger(TensorBoardLogger):
    """Lightning's TensorBoard logger, but for the ``epoch`` scalar: Lightning adds the epoch to every write of
    metrics (each log step's, each validation's, each epoch end's), 6 points over a 4-step epoch; this one writes it
    once per epoch, at its first write."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._epoch_written: float | None = None

    @override
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        epoch = metrics.get("epoch")
        if epoch is not None and epoch == self._epoch_written:
            metrics = {name: value for name, value in metrics.items() if name != "epoch"}
        elif epoch is not None:
            self._epoch_written = epoch
        if metrics:
            super().log_metrics(metrics, step)
