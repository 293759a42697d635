"""What a finished ``fit`` says on the console: its throughput, each device's peak memory, its best checkpoint and the
command that opens TensorBoard on the run (or where another logger wrote)."""

import resource

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from multigpu.contracts import parallelism_of
from multigpu.run.replicas import data_parallel_size
from multigpu.run.step_times import StepTimes
from multigpu.run.trainer_parts import callbacks_of

__all__ = ["FitSummary", "peak_memory"]


def peak_memory(trainer: Trainer) -> list[str]:
    """This process's peak memory, per device: CUDA's most allocated (and reserved) on each device it trains on, or
    its resident memory on the CPU."""
    devices = [device for device in parallelism_of(trainer).process_devices if device.type == "cuda"]
    if not devices:
        peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        return [f"process {trainer.global_rank} (CPU): {peak_mib:,.0f} MiB resident"]
    return [
        f"{device}: {torch.cuda.max_memory_allocated(device) / 2**20:,.0f} MiB allocated, "
        f"{torch.cuda.max_memory_reserved(device) / 2**20:,.0f} MiB reserved"
        for device in devices
    ]


class FitSummary(Callback):
    """Prints, once ``fit`` has ended (not after a stop or a failure, which say their own), a few lines: images per
    second over the run's training (all replicas, validations left out) and the share of it the first process waited
    for its loader (``StepTimes.run``, where the run has it), every device's peak memory, the best ``val/acc`` and its
    checkpoint, and ``tensorboard --logdir <the run's logs>`` (where another logger wrote, for another)."""

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        memory = peak_memory(trainer)
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            every: list[list[str] | None] = [None] * trainer.world_size
            dist.all_gather_object(every, memory)
            memory = [line for lines in every for line in lines or []]
        lines = ["Finished:"]
        times = next((callback.run for callback in callbacks_of(trainer) if isinstance(callback, StepTimes)), None)
        if times is not None and times.images:
            seconds = times.seconds()
            images_per_s = times.images * data_parallel_size(trainer) / seconds
            line = f"  training: {images_per_s:,.1f} images/s over {seconds:,.1f} s"
            if (wait_share := times.wait_share(trainer)) is not None:
                line += f", {100 * wait_share:.0f}% of it waiting for the loader"
            lines.append(line)
        lines += [f"  peak memory, {line}" for line in memory]
        best = trainer.checkpoint_callback
        if isinstance(best, ModelCheckpoint) and best.best_model_path and best.best_model_score is not None:
            lines.append(f"  best {best.monitor} {float(best.best_model_score):.4f}: {best.best_model_path}")
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                lines.append(f"  tensorboard --logdir {logger.log_dir}")
            elif logger.log_dir or logger.save_dir:
                lines.append(f"  {type(logger).__name__}: {logger.log_dir or logger.save_dir}")
        rank_zero_info("\n".join(lines))
