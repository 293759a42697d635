"""What each validation shows beyond its loss and accuracy: the accuracy of every class, as scalars to every logger;
the confusion matrix, with the class names, and a grid of the images it got most wrong, each with its true and
predicted class, as images to TensorBoard, drawn in a thread of their own while training goes on."""

from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from typing_extensions import override

from multigpu.run.trainer_parts import datamodule_of

__all__ = ["ValidationReport", "confusion_figure", "worst_figure"]


def _figure(width: float, height: float) -> Any:
    """A matplotlib figure of its own, outside pyplot's shared state (which is not for threads): TensorBoard's
    ``add_figure`` renders it with Agg, no screen needed."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height))


def worst_figure(images: Tensor, targets: Tensor, predictions: Tensor, classes: list[str], stats: Any) -> Any:
    """The images in a grid, each titled with its true and its predicted class; ``stats`` (mean, std), when known,
    undoes their normalisation."""
    pictures = images.detach().float().cpu()
    if stats:
        mean, std = (torch.tensor(values).view(1, -1, 1, 1) for values in stats)
        pictures = pictures * std + mean
    pixels = pictures.clamp(0, 1).permute(0, 2, 3, 1).numpy()
    columns = 4
    rows = max(1, -(-len(pixels) // columns))
    figure = _figure(2.2 * columns, 2.4 * rows)
    grid = figure.subplots(rows, columns, squeeze=False)
    for index, axes in enumerate(grid.flat):
        axes.axis("off")
        if index < len(pixels):
            axes.imshow(pixels[index])
            true, predicted = classes[int(targets[index])], classes[int(predictions[index])]
            axes.set_title(f"{true}\n→ {predicted}", fontsize=8, color="darkred")
    figure.tight_layout()
    return figure


def confusion_figure(matrix: Tensor, classes: list[str]) -> Any:
    """The confusion matrix ``matrix`` (rows: the true class) as a matplotlib figure, each row as shares of its class's
    images, with the class names where there are few enough to read."""
    shares = (matrix / matrix.sum(dim=1, keepdim=True).clamp(min=1)).cpu().numpy()
    count = len(classes)
    figure = _figure(*(min(4 + 0.4 * count, 16),) * 2)
    axes = figure.subplots()
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
    ``images``, the confusion matrix as the image ``val/confusion_matrix`` and the 16 images of highest loss as
    ``val/most_wrong`` (TensorBoard only; other loggers take scalars only).

    The first process draws the images in a thread of its own (matplotlib took 0.44 s a validation on a CPU core:
    benchmarks/validation_images.py), while training goes on; the next validation, the end of the run or its failure
    waits for it, and a failure to draw is raised there.

    Args:
        images: draw the validation's images (false: scalars only).
    """

    def __init__(self, images: bool = True) -> None:
        self.images = images
        self._drawer: ThreadPoolExecutor | None = None
        self._drawing: Future | None = None

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # A LightningModule of the user's may keep neither.
        confusion, worst = getattr(pl_module, "val_confusion", None), getattr(pl_module, "val_worst", None)
        if confusion is None or trainer.sanity_checking:
            for metric in (confusion, worst):
                if metric is not None:
                    metric.reset()
            return
        matrix = confusion.compute()  # every process's counts, summed
        confusion.reset()
        found = worst.compute() if worst is not None and self.images else None  # every process's, gathered
        if worst is not None:
            worst.reset()
        classes = [str(name) for name in (getattr(datamodule_of(trainer), "classes", None) or range(matrix.shape[0]))]
        accuracy = matrix.diagonal() / matrix.sum(dim=1).clamp(min=1)
        for name, value in zip(classes, accuracy.tolist()):
            pl_module.log(f"val/acc_by_class/{name}", value)
        loggers = [logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]
        if not (self.images and trainer.is_global_zero and loggers):
            return
        self._finish_drawing()
        if found is not None:
            found = tuple(tensor.cpu() for tensor in found)
        stats = getattr(datamodule_of(trainer), "known_stats", None)
        if self._drawer is None:
            self._drawer = ThreadPoolExecutor(1, thread_name_prefix="validation-images")
        step = trainer.global_step
        self._drawing = self._drawer.submit(self._draw, loggers, matrix.cpu(), found, classes, stats, step)

    @staticmethod
    def _draw(
        loggers: list[TensorBoardLogger],
        matrix: Tensor,
        found: tuple[Tensor, ...] | None,
        classes: list[str],
        stats: Any,
        step: int,
    ) -> None:
        figures = {"val/confusion_matrix": confusion_figure(matrix.to(torch.float64), classes)}
        if found is not None and len(found[0]):
            _, images, targets, predictions = found
            figures["val/most_wrong"] = worst_figure(images, targets, predictions, classes, stats)
        for tag, figure in figures.items():
            for logger in loggers:
                logger.experiment.add_figure(tag, figure, step, close=False)

    def _finish_drawing(self) -> None:
        """Wait for the images being drawn, if any; raise what stopped them."""
        drawing, self._drawing = self._drawing, None
        if drawing is not None:
            drawing.result()

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn != TrainerFn.FITTING:  # ``validate``: nothing goes on after it
            self._finish_drawing()

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._finish_drawing()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        drawing, self._drawing = self._drawing, None
        if drawing is not None:
            wait((drawing,), timeout=30)  # a few seconds at most; the run's own exception is the one to tell

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._finish_drawing()
        if self._drawer is not None:
            self._drawer.shutdown()
            self._drawer = None
