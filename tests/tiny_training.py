"""Train a tiny network of blocks under a strategy and save its final parameters.

Run as a script (Lightning relaunches it once per process):

    python tests/tiny_training.py STRATEGY OUT.pt

The data are the same 64 samples, in order, for every strategy: each of the n
processes of a data-parallel run takes every n-th sample, so one process with n
times the batch sees the union of the shards in each step.
"""

import sys

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from multigpu.strategies import ManualModelParallelStrategy, PipelineStrategy

# name: (strategy, devices, batch per process)
SETUPS = {
    "single": ("auto", 1, 16),
    "mmp_1x2": (lambda: ManualModelParallelStrategy(balance=[2, 2]), 2, 16),
    "mmp_2x2": (lambda: ManualModelParallelStrategy(balance=[2, 2], devices_per_replica=2), 4, 8),
    "pipe_gpipe": (lambda: PipelineStrategy(micro_batches=4, schedule="gpipe", balance=[2, 2]), 2, 16),
    "pipe_1f1b": (lambda: PipelineStrategy(micro_batches=4, schedule="1f1b", balance=[1, 3]), 2, 16),
    "pipe_2x2": (lambda: PipelineStrategy(num_stages=2, micro_batches=2, balance_by="params"), 4, 8),
}
STEPS = 4


class TinyBlocks(LightningModule):
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


def main(name: str, out: str) -> None:
    strategy, devices, batch_size = SETUPS[name]
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=generator), torch.randint(0, 4, (64,), generator=generator))
    seed_everything(0)
    model = TinyBlocks()
    trainer = Trainer(
        accelerator="cpu", devices=devices, strategy=strategy() if callable(strategy) else strategy,
        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False,
    )
    replicas = trainer.strategy.distributed_sampler_kwargs if trainer.world_size > 1 else {}
    shard = DistributedSampler(data, num_replicas=replicas.get("num_replicas", 1), rank=replicas.get("rank", 0), shuffle=False)
    trainer.fit(model, DataLoader(data, batch_size=batch_size, sampler=shard))
    state = trainer.strategy.lightning_module_state_dict()  # on every rank: a pipeline gathers its stages
    if trainer.is_global_zero:
        torch.save({key.removeprefix("net."): value.cpu() for key, value in state.items() if key.startswith("net.")}, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
