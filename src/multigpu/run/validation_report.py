"""What each validation shows beyond its loss and accuracy: the accuracy of every class, as scalars to every logger,
and the confusion matrix as an image, with the class names, to TensorBoard."""

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor
from typing_extensions import override

__all__ = ["ValidationReport", "confusion_figure"]


def confusion_figure(matrix: Tensor, classes: list[str]) -> Any:
    """The confusion matrix ``matrix`` (rows: the true class) as a matplotlib figure, each row as shares of its class's
    images, with the class names where there are few enough to read."""
    import matplotlib

    matplotlib.use("Agg")  # no screen: figures are drawn into TensorBoard
    from matplotlib import pyplot

    shares = (matrix / matrix.sum(dim=1, keepdim=True).clamp(min=1)).cpu().numpy()
    count = len(classes)
    figure, axes = pyplot.subplots(figsize=(min(4 + 0.4 * count, 16),) * 2)
    axes.imshow(shares, cmap="Blues", vmin=0.0, vmax=1.0)
    if count <= 20:
        axes.set_xticks(range(count), classes, rotation=90)
        axes.set_yticks(range(count), classes)
        for true in range(count):
            for predicted in range(count):
                if shares[true, predicted] >= 0.005:
                    colour = "white" if shares[true, predicted] > 0.5 else "black"
                    text = f"{shares[true, predicted]:.2f}"
                    axes.text(predicted, true, text, ha="center", va="center", fontsize=7, color=colour)
    axes.set_xlabel("predicted class")
    axes.set_ylabel("true class")
    figure.tight_layout()
    return figure


class ValidationReport(Callback):
    """After each validation of ``fit`` and ``validate``: ``val/acc_by_class/<class>`` for every class, and, with
    ``images``, the confusion matrix as the image ``val/confusion_matrix`` (TensorBoard only; other loggers take
    scalars only).

    Args:
        images: draw the validation's images (false: scalars only).
    """

    def __init__(self, images: bool = True) -> None:
        self.images = images

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        confusion = getattr(pl_module, "val_confusion", None)  # a LightningModule of the user's may have none
        if confusion is None or trainer.sanity_checking:
            if confusion is not None:
                confusion.reset()
            return
        matrix = confusion.compute()  # every process's counts, summed
        confusion.reset()
        classes = list(getattr(trainer.datamodule, "classes", None) or range(matrix.shape[0]))
        classes = [str(name) for name in classes]
        accuracy = matrix.diagonal() / matrix.sum(dim=1).clamp(min=1)
        for name, value in zip(classes, accuracy.tolist()):
            pl_module.log(f"val/acc_by_class/{name}", value)
        if not (self.images and trainer.is_global_zero):
            return
        loggers = [logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]
        if loggers:
            figure = confusion_figure(matrix.to(torch.float64), classes)
            for logger in loggers:
                logger.experiment.add_figure("val/confusion_matrix", figure, trainer.global_step, close=False)
            figure.clear()
            import matplotlib.pyplot

            matplotlib.pyplot.close(figure)
