"""A run as one row of TensorBoard's HPARAMS dashboard: its layout and recipe as hyperparameters, its best and last
validation accuracy and loss as metrics, so that last night's runs, each on another layout, compare in one table."""

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from multigpu.run.replicas import LayoutRecord, micro_batches_per_batch
from multigpu.run.trainer_parts import datamodule_of
from multigpu.typed_options import ModuleOptions

__all__ = ["METRICS", "RunHparams", "run_hparams"]

METRICS = ("hp/val_acc_best", "hp/val_acc_last", "hp/val_loss_best", "hp/val_loss_last")


def run_hparams(trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
    """What sets one run apart from another: strategy, devices, nodes, precision, batch and global batch, learning
    rate, network, dataset, and the micro-batches where the strategy cuts its batches."""
    layout = LayoutRecord.of(trainer, pl_module)
    model, data = ModuleOptions.of(pl_module), ModuleOptions.of(datamodule_of(trainer))
    optimizer = trainer.optimizers[0] if trainer.optimizers else None
    values = {
        "strategy": layout.strategy,
        "devices": trainer.num_devices,
        "nodes": trainer.num_nodes,
        "precision": str(trainer.precision),
        "batch_size": model.batch_size,
        "global_batch_size": layout.global_batch_size,
        "accumulated_batches": layout.accumulated_batches,
        "lr": optimizer.param_groups[0].get("initial_lr") if optimizer is not None else None,
        "arch": model.arch,
        "dataset": "synthetic" if data.synthetic or data.dataset is None else data.dataset,
        "micro_batches": micro_batches_per_batch(trainer),
    }
    return {name: value for name, value in values.items() if value is not None}


class RunHparams(Callback):
    """Writes the run's hyperparameters with the four ``METRICS`` once, as it starts (not again on resume: a resumed
    run keeps its one row), and the metrics after each validation; the best ones go on across a resume through the
    checkpoint. TensorBoard only: the other loggers get the validation's scalars as they are."""

    def __init__(self) -> None:
        self.best: dict[str, float] = {}

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.ckpt_path is not None:
            return
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger) and trainer.is_global_zero:
                logger.log_hyperparams(run_hparams(trainer, pl_module), metrics=dict.fromkeys(METRICS, float("nan")))

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero or trainer.state.fn != TrainerFn.FITTING:
            return
        metrics = trainer.callback_metrics
        found = {name: float(metrics[f"val/{name}"]) for name in ("acc", "loss") if f"val/{name}" in metrics}
        if not found:
            return
        better = {"acc": max, "loss": min}
        values = {}
        for name, value in found.items():
            self.best[name] = better[name](self.best.get(name, value), value)
            values[f"hp/val_{name}_best"], values[f"hp/val_{name}_last"] = self.best[name], value
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.log_metrics(values, step=trainer.global_step)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"best": dict(self.best)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best = dict(state_dict.get("best", {}))
