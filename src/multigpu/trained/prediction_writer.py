"""``predict``'s results as a file a user can read: ``predictions.csv`` beside the run's logs, and a summary.

One row per image, in the order of the dataset (under ``ddp`` each process predicts its share;
rank 0 gathers every row and writes each image once): the image (its index in the test
split, or its path), its true class where it has one, and the ``top_k`` classes with their
probabilities. ``plot`` also draws the first images with their predicted and true classes
(``predictions.png``).
"""

import csv
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from multigpu.data.cifar import CIFAR10_MEAN, CIFAR10_STD
from multigpu.errors import check_at_least
from multigpu.run.trainer_parts import datamodule_of
from multigpu.trained.prediction_plot import plot_predictions

__all__ = ["PredictionWriter"]

PLOTTED = 32  # images in predictions.png


class PredictionWriter(BasePredictionWriter):
    """Writes ``predict``'s results (see the module's docstring).

    Args:
        path: the CSV file (default: ``predictions.csv`` in the run's log folder,
            ``<trainer.default_root_dir>/<run_name>/``).
        top_k: the classes written per image, most probable first.
        plot: also draw the first 32 images with their predicted and true classes, as ``predictions.png``
            beside the CSV.
    """

    def __init__(self, path: str | None = None, top_k: int = 5, plot: bool = False) -> None:
        super().__init__(write_interval="batch")
        check_at_least("--predictions.top_k", top_k, 1)
        self.path, self.top_k, self.plot = path, top_k, plot
        self._rows: list[tuple] = []
        self._images: dict[int, torch.Tensor] = {}

    @override
    def on_predict_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._rows, self._images = [], {}

    @override
    def write_on_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        prediction: Any,
        batch_indices: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        images, labels, indices = batch
        probabilities = prediction.float().softmax(dim=1)
        top = probabilities.topk(min(self.top_k, probabilities.shape[1]), dim=1)
        for image, label, index, classes, values in zip(
            images, labels.tolist(), indices.tolist(), top.indices.tolist(), top.values.tolist()
        ):
            self._rows.append((index, label, classes, values))
            if self.plot and index < PLOTTED:
                self._images[index] = image.float().cpu()

    @override
    def on_predict_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        rows, images = self._rows, self._images
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (rows, images))
            rows = [row for part, _ in gathered for row in part]
            images = {index: image for _, part in gathered for index, image in part.items()}
        if not trainer.is_global_zero:
            return
        unique = sorted({row[0]: row for row in rows}.values())  # padding repeats an image: once each
        names = _names(trainer)
        class_name = _class_names(trainer)
        path = self._csv_path(trainer)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", newline="") as file:
            writer = csv.writer(file)
            k = len(unique[0][2]) if unique else self.top_k
            writer.writerow(["image", "label", *(f"{kind}_{n}" for n in range(1, k + 1) for kind in ("class", "prob"))])
            for index, label, classes, values in unique:
                cells = [cell for c, v in zip(classes, values) for cell in (class_name(c), f"{v:.4f}")]
                writer.writerow([names(index), class_name(label) if label >= 0 else "", *cells])
        labelled = [row for row in unique if row[1] >= 0]
        said = f"predict: {len(unique)} images"
        if labelled:
            top1 = sum(row[2][0] == row[1] for row in labelled) / len(labelled)
            topk = sum(row[1] in row[2] for row in labelled) / len(labelled)
            said += f", top-1 accuracy {top1:.1%} (top-{k} {topk:.1%})"
        rank_zero_info(f"{said}; wrote {path}.")
        if self.plot:
            plotted = [row for row in unique if row[0] in images]
            stats = getattr(datamodule_of(trainer), "stats", (CIFAR10_MEAN, CIFAR10_STD))
            plot_predictions([images[row[0]] for row in plotted], plotted, path.with_suffix(".png"), class_name, stats)
            rank_zero_info(f"predict: drew the first {len(plotted)} images in {path.with_suffix('.png')}.")

    def _csv_path(self, trainer: Trainer) -> Path:
        if self.path:
            return Path(self.path)
        logger = trainer.logger
        if isinstance(logger, TensorBoardLogger):
            return Path(logger.save_dir) / str(logger.name) / "predictions.csv"
        return Path(trainer.default_root_dir) / "predictions.csv"


def _class_names(trainer: Trainer) -> Callable[[int], str]:
    """The name of each class of the run's data (CIFAR-10's, CIFAR-100's, an image folder's), its number where the
    data module names none."""
    classes = getattr(datamodule_of(trainer), "classes", None) or []
    return lambda index: classes[index] if 0 <= index < len(classes) else str(index)


def _names(trainer: Trainer):
    """Each image's name in the CSV: the path of the user's file, or its index in the split."""
    loader = trainer.predict_dataloaders
    assert loader is not None  # set while predict runs
    dataset = loader.dataset
    paths = getattr(getattr(dataset, "dataset", None), "paths", None)
    return (lambda index: str(paths[index])) if paths is not None else str
