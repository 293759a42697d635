"""Train a network under a strategy on fixed samples and save its final parameters.

Run as a script (Lightning relaunches it once per process):

    python tests/strategy_training.py SETUP[,SETUP...] OUT_DIR    # writes OUT_DIR/SETUP.pt for each

The setups of one launch train one after the other in the same processes (``LAUNCHES``: those of one process
count), as ``network_training.py`` trains its layouts: a process's start-up, not its training, is most of a setup's
time.

The samples come in order, the same for every setup: each data-parallel replica takes
every n-th one, so one process with n times the batch sees the union of the shards.
A setup with micro-batches is matched by one process that accumulates them. Every
process uses one thread: the order of a convolution's sums then does not depend on
the thread count, and the results can be compared bit for bit.
"""

import gc

if __name__ == "__main__":
    gc.disable()  # while the imports run, as in main.py

import json
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from helpers import bare_trainer, fit_in_order
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.plugins import MixedPrecision
from run_layouts import LAYOUTS
from torch import nn
from torch.utils.data import TensorDataset

from multigpu.data.synthetic import SyntheticCIFAR10
from multigpu.model.classifier import ImageClassifier
from multigpu.model.deferred_batch_norm import defer_batch_norm
from multigpu.model.lazy_blocks import LazyBlocks, is_materialized
from multigpu.run.gradient_norm import GradientNorm
from multigpu.run.process_groups import end_process_groups

STEPS = 4


class TinyBlocks(LightningModule):
    """Four blocks of linear layers, no BatchNorm: micro-batching does not change its maths."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(8, 16),
            nn.Sequential(nn.Tanh(), nn.Linear(16, 16)),
            nn.Sequential(nn.Tanh(), nn.Linear(16, 16)),
            nn.Sequential(nn.Tanh(), nn.Linear(16, 4)),
        )
        self.example_input_array = torch.zeros(2, 8)
        self.criterion = nn.CrossEntropyLoss()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.criterion(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Overflow(nn.Module):
    """The identity, whose input's gradient is infinite while ``armed``: a 16-mixed step that must be skipped."""

    armed = False

    def forward(self, x):
        if self.armed and x.requires_grad:
            x.register_hook(lambda grad: torch.full_like(grad, float("inf")))
        return x


class OverflowBlocks(TinyBlocks):
    """``TinyBlocks`` whose first block's gradients overflow when armed; only the first stage holds that block."""

    def __init__(self) -> None:
        super().__init__()
        self.net[0] = nn.Sequential(self.net[0], Overflow())


class OverflowAt(Callback):
    """Arms the overflow in the second step, on the processes of ``ranks`` that hold the first block only."""

    def __init__(self, ranks: tuple[int, ...]) -> None:
        self.ranks = ranks

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        pl_module.net[0][1].armed = trainer.global_step == 1 and trainer.global_rank in self.ranks


class LoggedNorms(Callback):
    """Records each step's logged ``train/grad_norm`` (``GradientNorm``, every step a log step) and, where this
    process holds every gradient (``whole``), ``clip_grad_norm_``'s value on them before Lightning's clipping."""

    def __init__(self, whole: bool) -> None:
        self.whole, self.logged, self.clipped = whole, [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.whole:
            self.clipped.append(torch.nn.utils.clip_grad_norm_(pl_module.parameters(), float("inf")))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx:  # the step before's, logged after its on_train_batch_end
            self.logged.append(trainer.callback_metrics["train/grad_norm"])

    def on_train_end(self, trainer, pl_module) -> None:
        self.logged.append(trainer.callback_metrics["train/grad_norm"])


# Setups that log their gradient norm (``grad_norm`` in their state; ``clip_grad_norm`` on one device): the same
# samples in every step as ``single``, whose norms they must log.
LOGS_NORMS = (
    "single",
    "mmp_1x2",
    "mmp_2x2",
    "pipe_gpipe",
    "pipe_1f1b",
    "pipe_2x2",
    "tiny_ddp_4",
    "tiny_fsdp_4",
    "tiny_fsdp_2x2",
)


BUILT: list[int] = []  # the blocks this process built for real, in order


def _factory_block(index: int) -> nn.Module:
    if torch.get_default_device().type != "meta":
        BUILT.append(index)
    return nn.Sequential(nn.Linear(8 if index == 0 else 32, 4 if index == 7 else 32), nn.Tanh())


class FactoryBlocks(TinyBlocks):
    """Eight blocks built by a factory (``LazyBlocks``), each only where the strategy places it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = LazyBlocks([partial(_factory_block, index) for index in range(8)])

    def configure_model(self) -> None:
        self.net.materialize()


class HeldBlocks(Callback):
    """At each hook, records which blocks this process holds: built parameters, gradients, optimizer state.

    Writes ``OUT.rank<r>.json``: the hooks seen and, for each, the blocks held; fails the run
    if a gradient or an optimizer state ever belongs to a block this process does not hold.
    """

    HOOKS = (
        "setup",
        "on_fit_start",
        "on_train_batch_start",
        "on_before_backward",
        "on_after_backward",
        "on_before_optimizer_step",
        "on_train_batch_end",
        "on_train_epoch_end",
        "on_fit_end",
        "teardown",
    )

    def __init__(self, out: str) -> None:
        self.out, self.seen = out, []
        for hook in self.HOOKS:
            setattr(self, hook, partial(self._record, hook))

    def _record(self, hook: str, trainer: Trainer, pl_module: LightningModule, *args, **kwargs) -> None:
        blocks = pl_module.net
        held = [index for index, block in enumerate(blocks) if is_materialized(block)]
        owner = {id(param): index for index, block in enumerate(blocks) for param in block.parameters()}
        with_grad = {owner[id(p)] for p in pl_module.parameters() if p.grad is not None}
        with_state = {owner[id(p)] for optimizer in trainer.optimizers for p in optimizer.state}
        if not with_grad | with_state <= set(held):
            raise AssertionError(f"{hook}: gradients or optimizer state of blocks {with_grad | with_state} not held")
        devices = [str(next(block.parameters()).device) for block in blocks]
        self.seen.append({"hook": hook, "held": held, "devices": devices, "built": list(BUILT)})
        Path(f"{self.out}.rank{trainer.global_rank}.json").write_text(json.dumps(self.seen))


def factory(batch_size: int) -> tuple[LightningModule, TensorDataset]:
    return FactoryBlocks(), tiny(batch_size)[1]


def tiny(batch_size: int) -> tuple[LightningModule, TensorDataset]:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=generator), torch.randint(0, 4, (64,), generator=generator))
    return TinyBlocks(), data


def overflowing(batch_size: int) -> tuple[LightningModule, TensorDataset]:
    return OverflowBlocks(), tiny(batch_size)[1]


def bottleneck(
    batch_size: int, recompute_activations: bool = False, arch: str = "helpers.tiny_resnet"
) -> tuple[LightningModule, SyntheticCIFAR10]:
    """ResNet-50's blocks at 4 to 8 channels (``helpers.tiny_resnet``: 8 blocks, BatchNorm, the pair passed from a
    bottleneck's entry to its exit), or ``arch``."""
    model = ImageClassifier(
        arch=arch, batch_size=batch_size, stem="imagenet", warmup_epochs=0, recompute_activations=recompute_activations
    )
    return model, SyntheticCIFAR10(64, seed=1)


recomputed = partial(bottleneck, recompute_activations=True)
resnet50 = partial(bottleneck, arch="resnet50")  # the real layout; the ImageNet stem keeps it fast on a CPU


class DeferredStatistics(ImageClassifier):
    """One device with BatchNorm's running statistics of each whole step (2 accumulated batches)."""

    def configure_model(self) -> None:
        super().configure_model()
        defer_batch_norm(self.net, micro_batches=2)


def deferred(batch_size: int) -> tuple[LightningModule, SyntheticCIFAR10]:
    model = DeferredStatistics(arch="helpers.tiny_resnet", batch_size=batch_size, warmup_epochs=0)
    return model, SyntheticCIFAR10(64, seed=1)


# Under bf16 with clipping by a norm the gradients exceed (in layouts of two accumulated batches).
CLIPPED = {"precision": "bf16-mixed", "gradient_clip_val": 0.05}


def fp16(overflow_ranks: tuple[int, ...]) -> dict:
    """Real 16-mixed on the CPU, with its GradScaler (``precision="16-mixed"`` would be bf16-mixed there), and an
    overflow in the second step on ``overflow_ranks``."""
    return {"plugins": lambda: [MixedPrecision("16-mixed", "cpu")], "callbacks": lambda: [OverflowAt(overflow_ranks)]}


# name: (model, its layout in run_layouts.LAYOUTS, other Trainer arguments)
SETUPS = {
    "single": (tiny, "one_device_b16", {}),
    "mmp_1x2": (tiny, "mmp_2_2", {}),
    "mmp_2x2": (tiny, "mmp_2_2_replicas", {}),
    "pipe_gpipe": (tiny, "pipe_gpipe_2_2", {}),
    "pipe_1f1b": (tiny, "pipe_1f1b_1_3", {}),
    "pipe_2x2": (tiny, "pipe_params_replicas", {}),
    "single_clipped": (tiny, "one_device_b8_x2", CLIPPED),
    "pipe_clipped": (tiny, "pipe_gpipe_2_2_x2", CLIPPED),
    "bottleneck_accumulated": (bottleneck, "one_device_x2", {}),
    # ResNet-50 itself, split inside a bottleneck as in the other setups.
    "resnet50_accumulated": (resnet50, "one_device_x2", {}),
    "resnet50_pipe_1f1b": (resnet50, "pipe_1f1b_12_22", {}),
    "bottleneck_pipe_gpipe": (bottleneck, "pipe_gpipe_2_6", {}),
    "bottleneck_pipe_1f1b": (bottleneck, "pipe_1f1b_2_6", {}),
    # Activation recomputation: against the same training without it.
    "bottleneck_accumulated_recomputed": (recomputed, "one_device_x2", {}),
    "bottleneck_dp_recomputed": (recomputed, "dp_b4_x2", {}),
    "bottleneck_mmp": (bottleneck, "mmp_2_6_x2", {}),
    "bottleneck_mmp_recomputed": (recomputed, "mmp_2_6_x2", {}),
    "bottleneck_pipe_1f1b_recomputed": (recomputed, "pipe_1f1b_2_6", {}),
    # BatchNorm statistics of the whole batch: the pipeline against one device that defers them the same way.
    "bottleneck_accumulated_deferred": (deferred, "one_device_x2", {}),
    "bottleneck_pipe_deferred": (bottleneck, "pipe_deferred_2_6", {}),
    "bottleneck_pipe_deferred_recomputed": (recomputed, "pipe_deferred_2_6", {}),
    "bottleneck_ddp": (bottleneck, "ddp_b2_x2", {}),
    "bottleneck_ddp_recomputed": (recomputed, "ddp_b2_x2", {}),
    # Sharded (FSDP2) against ddp on the same samples: parameters, BatchNorm buffers and momentum.
    "bottleneck_fsdp": (bottleneck, "fsdp_b2_x2", {}),
    # Recomputation and bf16-mixed, each block's gathered parameters kept until its backward pass.
    "bottleneck_ddp_bf16_recomputed": (recomputed, "ddp_b2_x2", {"precision": "bf16-mixed"}),
    "bottleneck_fsdp_bf16_recomputed_kept": (recomputed, "fsdp_kept_b2_x2", {"precision": "bf16-mixed"}),
    # Over 4 processes the reduction adds in another order than DDP's, a last-bit difference that ResNet's
    # BatchNorm of 4 values per channel (1x1 images in layer4) blows up within a step: the network without it.
    "tiny_ddp_4": (tiny, "ddp_4", {}),
    "tiny_fsdp_4": (tiny, "fsdp_4", {}),
    "tiny_fsdp_2x2": (tiny, "fsdp_2x2_shards", {}),
    # The default over accumulated batches (each one's gradients reduce-scattered), with clipping by norm.
    "tiny_ddp_accumulated_clipped": (tiny, "ddp_b8_x2", {"gradient_clip_val": 0.05}),
    "tiny_fsdp_accumulated_clipped": (tiny, "fsdp_b8_x2", {"gradient_clip_val": 0.05}),
    # 16-mixed with loss scaling; the second step overflows on one process only (one that holds the first block),
    # and every process must skip it.
    "single_fp16": (overflowing, "one_device_b16", fp16((0,))),
    "ddp_fp16": (overflowing, "ddp", fp16((1,))),
    "mmp_fp16": (overflowing, "mmp_2_2", fp16((0,))),
    "pipe_fp16": (overflowing, "pipe_gpipe_2_2", fp16((0,))),
    "pipe_2x2_fp16": (overflowing, "pipe_2_2_replicas", fp16((2,))),
    # A network built by a factory, block by block where the strategy places it.
    "factory_single": (factory, "one_device_b16", {}),
    "factory_mmp": (factory, "mmp_params", {}),
    "factory_pipe": (factory, "pipe_params", {}),
}


WITH_MOMENTUM = {name for name in SETUPS if "fsdp" in name} | {
    "bottleneck_ddp",
    "bottleneck_ddp_recomputed",
    "bottleneck_ddp_bf16_recomputed",
    "tiny_ddp_4",
    "tiny_ddp_accumulated_clipped",
}


# Setups that share a launch: those of one process count. A setup of no list (model parallel over 2 processes of 2
# devices, and the factory's, which count the blocks each process ever built) has a launch of its own.
LAUNCHES = [
    [
        "single", "single_clipped", "mmp_1x2", "single_fp16", "mmp_fp16", "resnet50_accumulated",
        "bottleneck_accumulated", "bottleneck_accumulated_recomputed", "bottleneck_dp_recomputed", "bottleneck_mmp",
        "bottleneck_mmp_recomputed", "bottleneck_accumulated_deferred",
    ],
    [
        "pipe_gpipe", "pipe_1f1b", "pipe_clipped", "resnet50_pipe_1f1b", "bottleneck_pipe_gpipe",
        "bottleneck_pipe_1f1b", "bottleneck_pipe_1f1b_recomputed", "bottleneck_pipe_deferred",
        "bottleneck_pipe_deferred_recomputed", "bottleneck_ddp", "bottleneck_ddp_recomputed", "bottleneck_fsdp",
        "bottleneck_ddp_bf16_recomputed", "bottleneck_fsdp_bf16_recomputed_kept", "tiny_ddp_accumulated_clipped",
        "tiny_fsdp_accumulated_clipped", "ddp_fp16", "pipe_fp16",
    ],
    ["pipe_2x2", "tiny_ddp_4", "tiny_fsdp_4", "tiny_fsdp_2x2", "pipe_2x2_fp16"],
]  # fmt: skip


def launch_of(setup: str) -> list[str]:
    """The setups trained in the launch that trains ``setup``."""
    return next((launch for launch in LAUNCHES if setup in launch), [setup])


def train(name: str, out: str) -> None:
    """Train setup ``name`` in this process (and the others of its launch); save its state to ``out``."""
    BUILT.clear()
    build, layout_name, trainer_arguments = SETUPS[name]
    layout = LAYOUTS[layout_name]
    trainer_arguments = {key: value() if callable(value) else value for key, value in trainer_arguments.items()}
    callbacks = trainer_arguments.pop("callbacks", []) + ([HeldBlocks(out)] if build is factory else [])
    norms = LoggedNorms(whole=name == "single") if name in LOGS_NORMS else None
    if norms is not None:
        callbacks += [GradientNorm(), norms]
        trainer_arguments["log_every_n_steps"] = 1
    torch.set_num_threads(1)
    seed_everything(0)
    model, data = build(layout.batch_size)
    trainer = bare_trainer(
        layout.trainer_strategy(),
        layout.devices,
        STEPS,
        accumulate_grad_batches=layout.accumulate,
        callbacks=callbacks,
        **trainer_arguments,
    )
    fit_in_order(trainer, model, data, layout.batch_size)
    state = trainer.strategy.lightning_module_state_dict()  # on every rank: a pipeline gathers its stages
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None:  # every process's loss scale (a plain collective: Lightning's all_gather is autograd's)
        scales = [torch.tensor(scaler.get_scale())]
        if dist.is_initialized():
            scales = [torch.zeros(()) for _ in range(dist.get_world_size())]
            dist.all_gather(scales, torch.tensor(scaler.get_scale()))
        state["loss_scales"] = torch.stack(scales)
    if norms is not None:
        state["grad_norm"] = torch.stack(norms.logged)
        if norms.clipped:
            state["clip_grad_norm"] = torch.stack(norms.clipped)
    if name in WITH_MOMENTUM:  # and each parameter's momentum, in the optimizer's order
        optimizer_state = trainer.strategy.optimizer_state(trainer.optimizers[0])  # gathered on rank 0
        for index, parameter_state in optimizer_state.get("state", {}).items():
            state[f"momentum.{index}"] = parameter_state["momentum_buffer"]
    if trainer.is_global_zero:
        torch.save({key: value.cpu() for key, value in state.items()}, out)


def main(names: str, folder: str) -> None:
    for name in names.split(","):
        train(name, str(Path(folder) / f"{name}.pt"))
    end_process_groups()


if __name__ == "__main__":
    gc.freeze()  # as main.py does
    gc.enable()
    main(*sys.argv[1:])
