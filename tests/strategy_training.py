"""Train a network under a strategy on fixed samples and save its final parameters.

Run as a script (Lightning relaunches it once per process):

    python tests/strategy_training.py SETUP OUT.pt

The samples come in order, the same for every setup: each data-parallel replica takes
every n-th one, so one process with n times the batch sees the union of the shards.
A setup with micro-batches is matched by one process that accumulates them. Every
process uses one thread: the order of a convolution's sums then does not depend on
the thread count, and the results can be compared bit for bit.
"""

import sys

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from multigpu.datasets import SyntheticCIFAR10
from multigpu.model import ResNet50Classifier
from multigpu.strategies import ManualModelParallelStrategy, PipelineStrategy

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


def tiny(batch_size: int) -> tuple[LightningModule, TensorDataset]:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=generator), torch.randint(0, 4, (64,), generator=generator))
    return TinyBlocks(), data


def resnet(batch_size: int) -> tuple[LightningModule, SyntheticCIFAR10]:
    """ResNet-50 with BatchNorm; the ImageNet stem keeps it fast on a CPU."""
    return ResNet50Classifier(batch_size=batch_size, stem="imagenet", warmup_epochs=0), SyntheticCIFAR10(64, seed=1)


# Under bf16 with clipping by a norm the gradients exceed, and two accumulated batches.
CLIPPED = {"precision": "bf16-mixed", "gradient_clip_val": 0.05, "accumulate_grad_batches": 2}

# name: (model, strategy, devices, batch per process, other Trainer arguments)
SETUPS = {
    "single": (tiny, "auto", 1, 16, {}),
    "mmp_1x2": (tiny, lambda: ManualModelParallelStrategy(balance=[2, 2]), 2, 16, {}),
    "mmp_2x2": (tiny, lambda: ManualModelParallelStrategy(balance=[2, 2], devices_per_replica=2), 4, 8, {}),
    "pipe_gpipe": (tiny, lambda: PipelineStrategy(micro_batches=4, schedule="gpipe", balance=[2, 2]), 2, 16, {}),
    "pipe_1f1b": (tiny, lambda: PipelineStrategy(micro_batches=4, schedule="1f1b", balance=[1, 3]), 2, 16, {}),
    "pipe_2x2": (tiny, lambda: PipelineStrategy(num_stages=2, micro_batches=2, balance_by="params"), 4, 8, {}),
    "single_clipped": (tiny, "auto", 1, 8, CLIPPED),
    "pipe_clipped": (tiny, lambda: PipelineStrategy(micro_batches=2, schedule="gpipe", balance=[2, 2]), 2, 8, CLIPPED),
    "resnet_accumulated": (resnet, "auto", 1, 4, {"accumulate_grad_batches": 2}),
    "resnet_pipe_gpipe": (resnet, lambda: PipelineStrategy(micro_batches=2, schedule="gpipe", balance=[6, 12]), 2, 8, {}),
    "resnet_pipe_1f1b": (resnet, lambda: PipelineStrategy(micro_batches=2, schedule="1f1b", balance=[6, 12]), 2, 8, {}),
}


def main(name: str, out: str) -> None:
    build, strategy, devices, batch_size, trainer_arguments = SETUPS[name]
    torch.set_num_threads(1)
    seed_everything(0)
    model, data = build(batch_size)
    trainer = Trainer(
        accelerator="cpu", devices=devices, strategy=strategy() if callable(strategy) else strategy,
        max_steps=STEPS, limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, **trainer_arguments,
    )
    replicas = trainer.strategy.distributed_sampler_kwargs if trainer.world_size > 1 else {}
    shard = DistributedSampler(data, num_replicas=replicas.get("num_replicas", 1), rank=replicas.get("rank", 0), shuffle=False)
    trainer.fit(model, DataLoader(data, batch_size=batch_size, sampler=shard))
    state = trainer.strategy.lightning_module_state_dict()  # on every rank: a pipeline gathers its stages
    if trainer.is_global_zero:
        torch.save({key: value.cpu() for key, value in state.items()}, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
