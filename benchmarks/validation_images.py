"""What the validation's images cost: ``validate`` with ``--validation_report.images`` on and off, in turn.

    python benchmarks/validation_images.py                                   # ResNet-50, the CIFAR-10 subset, 5 rounds
    python benchmarks/validation_images.py --data-dir ../shared/data/cifar10-subset --rounds 3 --arch resnet18

One process validates the network (random weights: a validation's cost does not depend on them) on CIFAR-10's test
images, ``--data-dir`` (its official python layout; synthetic images of the same shape without one), with the run's
TensorBoard logger, in turn each round with and without the images (the confusion matrix and the grid of the 16
images of highest loss, drawn by ``ValidationReport``). ``validate`` waits for the images to be drawn before it
returns, where ``fit`` goes on training while a thread draws them: this is the images' whole cost, the most a
validation inside ``fit`` pays. Medians with their intervals over the rounds (``multigpu.timing.intervals``): the
images' share of the validation without them, and how long the drawing itself took in its thread.
"""

import argparse
import tempfile
import time
import warnings

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import TensorBoardLogger

from multigpu.data.datamodule import ImageDataModule
from multigpu.model.classifier import ImageClassifier
from multigpu.run.validation_report import ValidationReport
from multigpu.timing.intervals import median_interval

DRAWN: list[float] = []  # seconds each drawing of the images took, in its thread


def _timed_draw(*args) -> None:
    start = time.perf_counter()
    _draw(*args)
    DRAWN.append(time.perf_counter() - start)


_draw, ValidationReport._draw = ValidationReport._draw, staticmethod(_timed_draw)


def validate_once(model: ImageClassifier, data: ImageDataModule, images: bool, folder: str) -> float:
    trainer = Trainer(
        accelerator="auto",
        devices=1,
        logger=TensorBoardLogger(folder, name="validation_images"),
        callbacks=[ValidationReport(images=images)],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.validate(model, data, verbose=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--data-dir", default=None, help="a folder with cifar-10-batches-py/ (default: synthetic)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.data_dir:
        data = ImageDataModule(args.data_dir, batch_size=args.batch_size, download=False, verify_checksums=False)
    else:
        data = ImageDataModule(batch_size=args.batch_size, synthetic=True, synthetic_size=1017)
    model = ImageClassifier(arch=args.arch, batch_size=args.batch_size)
    seconds: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as folder:
        validate_once(model, data, False, folder)  # warm-up: the first validation's one-time costs
        for _ in range(args.rounds):
            for images in (True, False):
                seconds[images].append(validate_once(model, data, images, folder))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    print(f"{args.arch}, {len(data.datasets['val'])} validation images, {device}, {args.rounds} rounds")
    for images, label in ((False, "without images"), (True, "with images")):
        interval = median_interval(seconds[images])
        print(f"  {label:15} {interval.median:7.2f} s  [{interval.low:.2f}, {interval.high:.2f}]")
    share = median_interval([on / off - 1 for on, off in zip(seconds[True], seconds[False])])
    print(f"  images' cost    {100 * share.median:+6.1f} %  [{100 * share.low:+.1f}, {100 * share.high:+.1f}]")
    drawn = median_interval(DRAWN)
    print(f"  drawing them    {drawn.median:7.2f} s  [{drawn.low:.2f}, {drawn.high:.2f}] in their thread")


if __name__ == "__main__":
    main()
