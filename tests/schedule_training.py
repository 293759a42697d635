"""Train a small BatchNorm network under every pipeline schedule, one launch of the processes for all of them.

    python tests/schedule_training.py LAYOUT OUT.pt

LAYOUT is ``2`` (one pipeline of 2 processes), ``4`` (one of 4), ``2x2`` (2 replicas of a
2-process pipeline), or ``reference-2`` / ``reference-4``: one device that accumulates
the same micro-batches as one pipeline or as both replicas (in the order of the replicas).
``2x2`` and ``reference-4`` compute in float64.
Multi-stage schedules hold 2 stages per process, single-stage ones 1. OUT holds, for
each schedule (or for the reference), the state dict and the optimizer state.
One thread per process, so the sums of a micro-batch do not depend on the thread count.
"""

import gc

if __name__ == "__main__":
    gc.disable()  # while the imports run, as in main.py

import sys

import torch
from helpers import bare_trainer, fit_in_order
from lightning.pytorch import seed_everything
from strategy_training import TinyBlocks
from torch import nn
from torch.utils.data import Subset, TensorDataset

from multigpu.run.process_groups import end_process_groups
from multigpu.strategies import PipelineStrategy
from multigpu.strategies.pipeline.stage_placement import SCHEDULES, natural_stages_per_process

STEPS, MICRO_BATCHES, MICRO_BATCH = 3, 8, 2
BATCH = MICRO_BATCHES * MICRO_BATCH


class NormBlocks(TinyBlocks):
    """Eight blocks of a linear layer, BatchNorm and tanh: one block per stage of 4 processes x 2 stages."""

    def __init__(self) -> None:
        super().__init__()
        widths = [8, 16, 16, 16, 16, 16, 16, 16, 4]
        self.net = nn.Sequential(
            *(
                nn.Sequential(nn.Linear(widths[index], widths[index + 1]), nn.BatchNorm1d(widths[index + 1]), nn.Tanh())
                for index in range(8)
            )
        )
        self.example_input_array = None  # split by parameters: no blocks to time (BatchNorm would need 2 rows)


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    size = 2 * STEPS * BATCH
    return TensorDataset(torch.randn(size, 8, generator=generator), torch.randint(0, 4, (size,), generator=generator))


def _fit(strategy, devices: int, data, batch_size: int, accumulate: int = 1) -> dict:
    seed_everything(0)
    model = NormBlocks()
    trainer = bare_trainer(strategy, devices, STEPS, accumulate_grad_batches=accumulate)
    fit_in_order(trainer, model, data, batch_size)
    state = trainer.strategy.lightning_module_state_dict()  # on every rank: a pipeline gathers its stages
    optimizer = trainer.strategy.optimizer_state(trainer.optimizers[0])
    if not trainer.is_global_zero:  # rank 0 holds what was gathered
        return {}
    momentum = {index: entry["momentum_buffer"] for index, entry in optimizer["state"].items()}
    return {"state": {key: value.cpu() for key, value in state.items()}, "momentum": momentum}


def _replica_order(data: TensorDataset) -> Subset:
    """The samples in the order one device must see them to accumulate both replicas' micro-batches:
    each step, replica 0's batch (every other sample), then replica 1's."""
    shards = [list(range(replica, len(data), 2)) for replica in range(2)]
    order = [index for step in range(STEPS) for shard in shards for index in shard[step * BATCH : (step + 1) * BATCH]]
    return Subset(data, order)


def main(layout: str, out: str) -> None:
    torch.set_num_threads(1)
    if layout in ("2x2", "reference-4"):
        # Replicas average two sums where one device sums every micro-batch once; BatchNorm over
        # micro-batches of 2 samples grows float32's rounding of that to 1e-5 in 3 steps.
        torch.set_default_dtype(torch.float64)
    data = _data()
    if layout.startswith("reference"):
        replicas = int(layout.split("-")[1]) // 2
        results = {
            "reference": _fit(
                "auto",
                1,
                _replica_order(data) if replicas == 2 else data,
                MICRO_BATCH,
                accumulate=MICRO_BATCHES * replicas,
            )
        }
    else:
        devices = 4 if layout in ("4", "2x2") else 2
        processes = 2 if layout == "2x2" else devices
        results = {}
        for schedule in SCHEDULES:
            per_process = natural_stages_per_process(schedule)
            strategy = PipelineStrategy(
                num_stages=processes * per_process,
                micro_batches=MICRO_BATCHES,
                schedule=schedule,
                stages_per_process=per_process,
                balance_by="params",
            )
            results[schedule] = _fit(strategy, devices, data, BATCH)
    if all(results.values()):
        torch.save(results, out)
    end_process_groups()


if __name__ == "__main__":
    gc.freeze()  # as main.py does
    gc.enable()
    main(*sys.argv[1:])
