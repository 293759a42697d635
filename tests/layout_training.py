"""Train a small BatchNorm network on the data module's synthetic CIFAR-10 under one layout, resuming from its
``last.ckpt`` when there is one; record the images of each step; save the final state.

Run as a script (Lightning relaunches it once per process):

    python tests/layout_training.py LAYOUT FOLDER ATTEMPT STEPS [KILL_AT]
    python tests/layout_training.py LAYOUT,LAYOUT... FOLDER ATTEMPT STEPS  # of one process count, in FOLDER/LAYOUT

``FOLDER`` holds the run's checkpoints (``last.ckpt`` every step), ``records/ATTEMPT/rank<N>.txt`` (the
images of each step, ``helpers.RecordIndices``) and ``final.pt`` (every parameter and buffer). With
``KILL_AT``, every process SIGKILLs itself as optimizer step ``KILL_AT`` starts. Every process uses one
thread, so that the order of a convolution's sums does not depend on the layout.
"""

import gc

if __name__ == "__main__":
    gc.disable()  # while the imports run, as in main.py

import sys
from functools import partial
from pathlib import Path

import torch
from helpers import KillAt, RecordIndices
from lightning.pytorch import Trainer, seed_everything
from run_layouts import LAYOUTS
from torch import nn

from multigpu.checkpointing.checkpoint_io import AtomicCheckpointIO
from multigpu.checkpointing.files import find_last_checkpoint
from multigpu.checkpointing.resume import RunMetadata
from multigpu.checkpointing.saving import LastCheckpoint
from multigpu.data.datamodule import ImageDataModule
from multigpu.model.classifier import ImageClassifier
from multigpu.model.lazy_blocks import LazyBlocks
from multigpu.run.process_groups import end_process_groups


def _block(index: int) -> nn.Module:
    if index == 0:
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
    if index == 1:
        return nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


class SmallBatchNormClassifier(ImageClassifier):
    """The recipe's LightningModule (loss, SGD, schedule, BatchNorm's step statistics) on three small blocks."""

    def __init__(self, batch_size: int) -> None:
        super().__init__(batch_size=batch_size, warmup_epochs=0, base_lr=0.4)
        self.net = LazyBlocks([partial(_block, index) for index in range(3)], seed=0)


SAMPLES = 48


def train(layout: str, folder: Path, attempt: str, steps: str, kill_at: str | None = None) -> None:
    chosen = LAYOUTS[layout]
    seed_everything(0)
    callbacks = [RunMetadata(), LastCheckpoint(str(folder / "checkpoints"), 1)]
    callbacks.append(RecordIndices(str(folder / "records" / attempt)))
    if kill_at is not None:
        callbacks.append(KillAt(int(kill_at)))
    trainer = Trainer(
        accelerator="cpu",
        devices=chosen.devices,
        strategy=chosen.trainer_strategy(),
        accumulate_grad_batches=chosen.accumulate,
        max_steps=int(steps),
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        plugins=[AtomicCheckpointIO()],  # as the CLI writes and reads them: fsdp's sharded, in the background
    )
    data = ImageDataModule(synthetic=True, synthetic_size=SAMPLES, batch_size=chosen.batch_size, num_workers=0)
    last = find_last_checkpoint(folder / "checkpoints")
    trainer.fit(SmallBatchNormClassifier(chosen.batch_size), datamodule=data, ckpt_path=str(last) if last else None)
    state = trainer.strategy.lightning_module_state_dict()
    if trainer.is_global_zero:
        torch.save({key: value.cpu() for key, value in state.items()}, folder / "final.pt")


def main(layouts: str, folder: str, attempt: str, steps: str, kill_at: str | None = None) -> None:
    torch.set_num_threads(1)
    names = layouts.split(",")
    for name in names:  # several: one after the other in the same processes, each in FOLDER/LAYOUT
        train(name, Path(folder) / name if len(names) > 1 else Path(folder), attempt, steps, kill_at)
    end_process_groups()


if __name__ == "__main__":
    gc.freeze()  # as main.py does
    gc.enable()
    main(*sys.argv[1:])
