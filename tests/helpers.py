"""Test-only Lightning callbacks, loaded by class path from configs the tests write."""

import os
import signal
from pathlib import Path

import torch
from lightning.pytorch import Callback
from typing_extensions import override

from multigpu.run.replicas import data_parallel_size


class RecordSamples(Callback):
    """Writes a fingerprint of every training image this rank saw to ``out_dir/rank<N>.txt``."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        fingerprints = [f"{image.flatten()[:4].tolist()}".replace(" ", "") for image in batch[0]]
        with open(self.out_dir / f"rank{trainer.global_rank}.txt", "a") as file:
            file.write("\n".join(fingerprints) + "\n")


class KillAt(Callback):
    """SIGKILLs this process at optimizer step ``step``: as the step starts (``step``), or while a
    checkpoint is being saved (``save``); or sends it SIGTERM as the step starts (``sigterm``).

    Only on global rank ``rank``, when given. A process that torchrun restarted
    (``TORCHELASTIC_RESTART_COUNT`` above 0) is left to finish.
    """

    def __init__(self, step: int, moment: str = "step", rank: int | None = None) -> None:
        self.step, self.moment, self.rank = step, moment, rank

    def _signal_if(self, trainer, moment: str, signum: int) -> None:
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return  # a restart by torchrun is left to finish
        if self.rank is not None and trainer.global_rank != self.rank:
            return
        if trainer.global_step == self.step and self.moment == moment:
            os.kill(os.getpid(), signum)

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._signal_if(trainer, "step", signal.SIGKILL)
        self._signal_if(trainer, "sigterm", signal.SIGTERM)

    @override
    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._signal_if(trainer, "save", signal.SIGKILL)


class FailOnRank(Callback):
    """Raises an error on rank ``rank`` at optimizer step ``step``, as a crashing process would."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            raise RuntimeError(f"rank {self.rank} failed on purpose at step {self.step}")


class RecordIndices(Callback):
    """Writes, for every loader batch this rank trains, the optimizer step and the indices of its images in the
    training set, as lines ``step index index ...`` of ``out_dir/rank<N>.txt`` (data without augmentation:
    each image is found by its first values). Of the processes of one pipeline, which read the same images,
    only the first records them."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self._index: dict[tuple[float, ...], int] = {}

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        train = trainer.datamodule.datasets["train"]
        self._index = {tuple(train[index][0].flatten()[:4].tolist()): index for index in range(len(train))}

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank % (trainer.world_size // data_parallel_size(trainer)):
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        indices = [self._index[tuple(image.flatten()[:4].tolist())] for image in batch[0].cpu()]
        with open(self.out_dir / f"rank{trainer.global_rank}.txt", "a") as file:
            file.write(" ".join(map(str, [trainer.global_step, *indices])) + "\n")


def trained_steps(attempts: list[Path]) -> dict[int, list[int]]:
    """The images each optimizer step trained, from ``RecordIndices``' folders of successive attempts of one run:
    a step that a later attempt trained again (after a kill) counts as that attempt trained it."""
    steps: dict[int, list[int]] = {}
    for folder in attempts:
        found: dict[int, list[int]] = {}
        for path in sorted(folder.glob("rank*.txt")):
            for line in path.read_text().split("\n"):
                if line:
                    step, *indices = map(int, line.split())
                    found.setdefault(step, []).extend(indices)
        steps.update(found)
    return steps


class RecordSteps(Callback):
    """On global rank 0, saves the network's initial weights (``init.pt``, torchvision's names) and, after each of
    the first ``steps`` optimizer steps, its state dict and the learning rate the step used (``step<K>.pt``), so
    that a plain loop can be compared with the application step by step."""

    def __init__(self, out_dir: str, steps: int) -> None:
        self.out_dir, self.steps, self._lr = Path(out_dir), steps, None

    def _save(self, pl_module, name: str, **extra) -> None:
        from multigpu.model.torchvision_weights import to_torchvision

        state = {key: tensor.detach().clone() for key, tensor in pl_module.net.state_dict().items()}
        torch.save({"state": to_torchvision(state), **extra}, self.out_dir / name)

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._save(pl_module, "init.pt")

    @override
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._lr = optimizer.param_groups[0]["lr"]

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if trainer.global_rank == 0 and 0 < step <= self.steps and not (self.out_dir / f"step{step}.pt").exists():
            self._save(pl_module, f"step{step}.pt", lr=self._lr)
