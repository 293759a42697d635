"""Each strategy and its plain PyTorch counterpart (``benchmarks/plain_peers.py``) trained side by side: the
tiny ResNet (``helpers.tiny_resnet``) from the same weights, on the same samples in the same order, and the loss
of each step of each.

Run as a script (Lightning relaunches it once per process), it trains ``ddp``, ``fsdp`` and ``pipeline`` over two
processes, each followed by its counterpart in the same processes, and writes what each process saw:

    python tests/peer_training.py OUT    # OUT.rank0.json, OUT.rank1.json: {strategy: {"app": [...], "peer": [...]}}

``benchmarks`` must be importable (``PYTHONPATH``). A process without a step's loss (a pipeline's first stage
under the counterpart) writes None for it. Every process computes on one thread.
"""

import json
import sys
from pathlib import Path

import plain_peers
import torch
import torch.distributed as dist
from helpers import bare_trainer
from lightning.pytorch import Callback, seed_everything
from lightning.pytorch.strategies import Strategy

from multigpu.data.synthetic import SyntheticCIFAR10
from multigpu.model.classifier import ImageClassifier
from multigpu.run.process_groups import end_process_groups
from multigpu.strategies import FullyShardedStrategy, ManualModelParallelStrategy, PipelineStrategy

ARCH, STEPS = "helpers.tiny_resnet", 4
DATA = SyntheticCIFAR10(64, seed=1)


class Losses(Callback):
    """Each training step's loss, as the LightningModule's ``training_step`` returned it."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item())


def app_losses(strategy: Strategy | str, devices: int, batch_size: int) -> list[float]:
    """The application's ``ImageClassifier`` trained for ``STEPS`` steps under ``strategy``, each replica reading its
    share of ``DATA`` as the counterpart's does (``plain_peers.batches``); its losses in this process."""
    seed_everything(0)
    model = ImageClassifier(arch=ARCH, batch_size=batch_size, warmup_epochs=0)
    recorded = Losses()
    # Every step a log step: a pipeline gives every stage the logits in those only (else its loss is of zeros).
    trainer = bare_trainer(strategy, devices, STEPS, callbacks=[recorded], log_every_n_steps=1)
    shard = trainer.strategy.distributed_sampler_kwargs if trainer.world_size > 1 else {}
    loader = plain_peers.batches(DATA, batch_size, shard.get("num_replicas", 1), shard.get("rank", 0))
    trainer.fit(model, loader)
    return recorded.losses


def peer_losses(name: str, batch_size: int, devices: list[torch.device] | None = None) -> list[float | None]:
    """The counterpart ``name`` of ``plain_peers`` trained for ``STEPS`` steps from the weights ``app_losses``
    starts from; its losses in this process (``devices``: the model-parallel one's)."""
    net, loop = plain_peers.network(ARCH, "cifar", seed=0), plain_peers.Loop(batch_size, STEPS)
    if name == "mmp":
        losses, _ = plain_peers.mmp(net, DATA, loop, devices)
    else:
        losses, _ = plain_peers.DISTRIBUTED[name](net, DATA, loop, torch.device("cpu"))
    return [None if loss is None else loss.item() for loss in losses]


# name: (our strategy, batch per process); over 2 processes of one thread each
TWO_PROCESSES = {
    "ddp": (lambda: "ddp", 4),
    "fsdp": (FullyShardedStrategy, 4),
    "pipeline": (PipelineStrategy, 8),  # 4 micro-batches of 2, as the counterpart's
}


def mmp_losses() -> dict[str, list]:
    """``manual_model_parallel`` over two CPU devices that compare unequal (the moves between them in place), and its
    counterpart: their losses. One process, so it runs inside the caller's."""
    strategy = ManualModelParallelStrategy()
    strategy.parallel_devices = devices = [torch.device("cpu", 0), torch.device("cpu", 1)]
    return {"app": app_losses(strategy, 2, 8), "peer": peer_losses("mmp", 8, devices)}


def main(out: str) -> None:
    torch.set_num_threads(1)
    seen = {}
    for name, (strategy, batch_size) in TWO_PROCESSES.items():
        seen[name] = {"app": app_losses(strategy(), 2, batch_size), "peer": peer_losses(name, batch_size)}
    Path(f"{out}.rank{dist.get_rank()}.json").write_text(json.dumps(seen))
    end_process_groups()


if __name__ == "__main__":
    main(*sys.argv[1:])
