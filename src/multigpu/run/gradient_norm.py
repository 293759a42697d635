"""The global gradient norm before clipping, beside the loss and the learning rate."""

from lightning.pytorch import Callback, LightningModule, Trainer
from torch.optim import Optimizer
from typing_extensions import override

from multigpu.compat import is_log_step
from multigpu.contracts import parallelism_of

__all__ = ["GradientNorm"]


class GradientNorm(Callback):
    """Logs ``train/grad_norm`` at each log step: the 2-norm of all of the network's gradients after the step's
    backward passes (accumulated, averaged between replicas, unscaled under 16-mixed) and before Lightning clips them,
    the value ``torch.nn.utils.clip_grad_norm_`` returns. The strategy computes it over every process that holds a
    part of the network (``Parallelism.gradient_norm``: a sharded gradient, a pipeline's stages), on the device;
    Lightning reads it with the step's other figures. Other steps compute nothing."""

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer) -> None:
        if is_log_step(trainer):
            pl_module.log("train/grad_norm", parallelism_of(trainer).gradient_norm(pl_module))
