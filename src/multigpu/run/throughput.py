"""The throughput of training: images per second, MFU and the epoch time, logged and printed once per epoch."""

import time
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from multigpu.errors import UsageError
from multigpu.run.peak_flops import peak_flops as device_peak_flops
from multigpu.run.replicas import data_parallel_size

__all__ = ["ThroughputSummary"]


class ThroughputSummary(Callback):
    """Logs training images per second, model FLOP utilisation (MFU) and the epoch time, and prints
    one line per epoch with them and the epoch's losses.

    Images per second count training batches over all data-parallel replicas and exclude
    validation. MFU is ``images/s x FLOPs per image / (peak FLOP/s x devices)``: the FLOPs
    of one image's forward and backward pass come once from the model's
    ``training_flops_per_image()`` (torch's flop counter), the peak from ``peak_flops``
    or, on known GPUs, from the table for the run's precision (``multigpu.run.peak_flops``:
    H100, H200, A100, L4, and Lightning's for others). Without either, MFU is left out.

    Args:
        peak_flops: peak FLOP/s of one device, for devices no table knows (the CPU, say), or to
            compare against another figure than the table's.
    """

    def __init__(self, peak_flops: float | None = None) -> None:
        if peak_flops is not None and peak_flops <= 0:
            raise UsageError(f"throughput.peak_flops must be a positive FLOP/s figure, not {peak_flops}.")
        self.peak_flops = peak_flops
        self._peak: float | None = None  # all devices' peak FLOP/s, when known
        self._flops_per_image: int | None = None
        self._start = self._train_end = 0.0
        self._images = 0

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Once per run, and the FLOPs only where there is a peak to divide them by.
        peak = self.peak_flops or device_peak_flops(trainer.strategy.root_device, str(trainer.precision))
        self._peak = peak * trainer.num_devices * trainer.num_nodes if peak else None
        count = getattr(pl_module, "training_flops_per_image", None)
        self._flops_per_image = count() if self._peak and count else None

    def mfu(self, images_per_s: float) -> float | None:
        """The model FLOP utilisation of training at ``images_per_s`` over all replicas; ``None`` where the devices'
        peak is not known (once ``fit`` has started)."""
        if not self._peak or not self._flops_per_image:
            return None
        return images_per_s * self._flops_per_image / self._peak

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.on_train_epoch_start(trainer, pl_module)  # a run resumed mid-epoch gets no epoch start

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start = self._train_end = time.perf_counter()
        self._images = 0

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._images += len(batch[0])
        self._train_end = time.perf_counter()

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._images:  # an epoch resumed after its last batch: nothing trained, no point to log
            return
        epoch_time = time.perf_counter() - self._start
        train_time = max(self._train_end - self._start, 1e-9)
        images_per_s = self._images * data_parallel_size(trainer) / train_time
        pl_module.log("perf/epoch_time_s", epoch_time, sync_dist=True)
        pl_module.log("perf/images_per_s", images_per_s, sync_dist=True)
        metrics = trainer.callback_metrics
        parts = [f"epoch {trainer.current_epoch}", f"step {trainer.global_step}"]
        parts += [f"{key} {float(metrics[key]):.4f}" for key in ("train/loss", "val/loss", "val/acc") if key in metrics]
        parts.append(f"{images_per_s:.1f} img/s")
        if (mfu := self.mfu(images_per_s)) is not None:
            pl_module.log("perf/mfu", mfu, sync_dist=True)
            parts.append(f"MFU {100 * mfu:.1f}%")
        parts.append(f"{epoch_time:.1f} s")
        pl_module.print(" | ".join(parts))
