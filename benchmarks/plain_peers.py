"""The plain PyTorch counterpart of each multi-device strategy: the loop a PyTorch user writes by hand, no Lightning.

    python benchmarks/plain_peers.py ddp --processes 2 --batch-size 32 --steps 5 --out ddp.json
    python benchmarks/plain_peers.py pipeline --arch resnet18 --out pipeline.json

    ddp       processes, ``DistributedDataParallel``, a ``DistributedSampler``
    fsdp      FSDP2: ``fully_shard`` on each block, then on the whole network (as ``fsdp`` and torchtitan shard)
    pipeline  ``torch.distributed.pipelining``, one stage per process, 1F1B over 4 micro-batches (``pipeline``'s
              defaults)
    mmp       one process, the network cut into ``--processes`` parts on as many devices (on the CPU each of them
              the CPU), the activations moved from each part to the next

Each trains the application's network (``--arch``, its blocks: ``multigpu.model.architectures``), built in every
process from one seed, so all hold the same weights; the pipeline and the model-parallel split cut it into parts of
equal block counts. The optimizer and learning-rate schedule are ``ImageClassifier``'s as ``throughput.py`` runs it
(``--model.warmup_epochs=0``): SGD with Nesterov momentum, weight decay except on BatchNorm and biases, 0.2 per 256
images of the global batch and a cosine decay over the run's steps. The images are random, drawn once; each replica
reads its share through a ``DistributedSampler``. Processes are forked (``torch.multiprocessing``) and meet over
gloo on the CPU, NCCL on GPUs. ``--warmup`` untimed steps come first, then ``--steps`` timed ones; the figures are
``plain_loop.py``'s, and every process writes its peak memory beside them (``multigpu.timing.step_timer``).
``tests/test_plain_peers.py`` holds each against its strategy: the same losses, step by step.
"""

import argparse
import itertools
import json
import math
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from multigpu.model.architectures import DEFAULT_ARCH, network_blocks
from multigpu.model.lazy_blocks import LazyBlocks
from multigpu.run.device_sync import synchronize
from multigpu.run.host_memory import keep_freed_memory
from multigpu.timing.step_timer import peak_memory_bytes, result

MICRO_BATCHES = 4  # pipeline's default, under its default schedule, 1F1B
Step = Callable[[Tensor, Tensor], Tensor | None]  # one optimizer step on a batch; its loss where this process has it
Trained = tuple[list[Tensor | None], float]  # each step's loss, and the seconds of the steps after the warm-up


@dataclass(frozen=True)
class Loop:
    """How long a peer trains, and on what.

    Args:
        batch_size: images per process (ddp, fsdp), else per step (pipeline, mmp).
        steps: optimizer steps in all, the learning-rate schedule's length.
        warmup: the first steps, left out of the time.
        bf16: forward passes under ``torch.autocast`` to bfloat16 (``--trainer.precision=bf16-mixed``).
    """

    batch_size: int
    steps: int
    warmup: int = 0
    bf16: bool = False

    def autocast(self, device: torch.device) -> torch.autocast:
        return torch.autocast(device.type, torch.bfloat16, enabled=self.bf16)


def network(arch: str, stem: str, seed: int = 0) -> nn.Sequential:
    """The application's network as its chain of blocks, built from ``seed``: the same weights in every process, and
    those of ``ImageClassifier(arch=arch, stem=stem)`` built after ``seed_everything(seed)``."""
    torch.manual_seed(seed)
    blocks = LazyBlocks(network_blocks(arch, 10, stem))
    blocks.materialize()
    return nn.Sequential(*blocks)


def synthetic(length: int) -> TensorDataset:
    """``length`` random normalised images of CIFAR's shape with random labels, the same in every process."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(length, 3, 32, 32, generator=generator)
    return TensorDataset(images, torch.randint(10, (length,), generator=generator))


def batches(data: Dataset, batch_size: int, replicas: int = 1, replica: int = 0) -> DataLoader:
    """Replica ``replica``'s share of ``data``, shuffled, in batches of ``batch_size``."""
    sampler = DistributedSampler(data, replicas, replica, shuffle=True, seed=0)
    return DataLoader(data, batch_size, sampler=sampler, drop_last=True)


def sgd(net: nn.Module, global_batch: int, steps: int, fused: bool) -> tuple[torch.optim.SGD, Callable[[], None]]:
    """``ImageClassifier``'s optimizer for ``net``'s parameters, and the step of its learning-rate schedule."""
    decay = [param for param in net.parameters() if param.ndim > 1]
    no_decay = [param for param in net.parameters() if param.ndim <= 1]  # BatchNorm's weights, the biases
    optimizer = torch.optim.SGD(
        [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=0.2 * global_batch / 256,
        momentum=0.9,
        nesterov=True,
        weight_decay=5e-4,
        fused=fused or None,  # as ImageClassifier's: one fused kernel for plain CUDA tensors, else torch's default
    )
    cosine = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 * (1.0 + math.cos(math.pi * (step / steps))))
    return optimizer, cosine.step


def train(step: Step, loader: DataLoader, loop: Loop, device: torch.device) -> Trained:
    """``loop.steps`` optimizer steps over as many epochs of ``loader`` as they take: the losses ``step`` returned,
    and the seconds of the steps after the first ``loop.warmup``."""
    losses: list[Tensor | None] = []
    start, epoch = 0.0, 0
    while True:
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            if len(losses) == loop.warmup:
                synchronize(device)
                start = time.perf_counter()
            losses.append(step(x, y))
            if len(losses) == loop.steps:
                synchronize(device)
                return losses, time.perf_counter() - start
        epoch += 1


def data_parallel(
    model: nn.Module, net: nn.Module, data: Dataset, loop: Loop, device: torch.device, fused: bool
) -> Trained:
    """Forward, loss, backward and step of ``model`` (``net``, wrapped), each process on its share of the samples."""
    world = dist.get_world_size()
    optimizer, schedule_step = sgd(net, loop.batch_size * world, loop.steps, fused)
    criterion = nn.CrossEntropyLoss()

    def step(x: Tensor, y: Tensor) -> Tensor:
        with loop.autocast(device):
            loss = criterion(model(x.to(device)), y.to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule_step()
        return loss.detach()

    return train(step, batches(data, loop.batch_size, world, dist.get_rank()), loop, device)


def ddp(net: nn.Sequential, data: Dataset, loop: Loop, device: torch.device) -> Trained:
    """``net`` in ``DistributedDataParallel``."""
    net = net.to(device)
    model = DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)
    return data_parallel(model, net, data, loop, device, fused=device.type == "cuda")


def fsdp(net: nn.Sequential, data: Dataset, loop: Loop, device: torch.device) -> Trained:
    """Each block of ``net`` sharded over the processes, then ``net`` itself (what no block holds)."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    net = net.to(device)
    for block in net:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return data_parallel(net, net, data, loop, device, fused=False)  # sharded parameters (DTensors): not fused


def cut(blocks: nn.Sequential, count: int) -> list[nn.Sequential]:
    """``blocks`` cut into ``count`` parts of consecutive blocks, of equal numbers (the first ones one more)."""
    sizes = [len(blocks) // count + (part < len(blocks) % count) for part in range(count)]
    starts = list(itertools.accumulate(sizes, initial=0))
    return [blocks[start:end] for start, end in itertools.pairwise(starts)]


class Stage(nn.Sequential):
    """A pipeline stage's blocks. The schedule passes what the stage before sent as arguments: a cut inside a
    bottleneck sends two tensors, its output and its shortcut, which the next block takes as one pair."""

    def forward(self, *inputs: Tensor) -> Tensor | tuple[Tensor, ...]:
        return super().forward(inputs[0] if len(inputs) == 1 else inputs)


def pipeline(net: nn.Sequential, data: Dataset, loop: Loop, device: torch.device) -> Trained:
    """This process's stage of ``net`` cut into one per process, under 1F1B."""
    rank, world = dist.get_rank(), dist.get_world_size()
    stage = Stage(*cut(net, world)[rank]).to(device)
    schedule = Schedule1F1B(PipelineStage(stage, rank, world, device), MICRO_BATCHES, loss_fn=nn.CrossEntropyLoss())
    optimizer, schedule_step = sgd(stage, loop.batch_size, loop.steps, fused=device.type == "cuda")

    def step(x: Tensor, y: Tensor) -> Tensor | None:
        losses: list[Tensor] = []  # the last stage's, one per micro-batch
        with loop.autocast(device):
            inputs = (x.to(device),) if rank == 0 else ()
            schedule.step(*inputs, target=y.to(device) if rank == world - 1 else None, losses=losses)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule_step()
        return torch.stack(losses).mean().detach() if losses else None

    return train(step, batches(data, loop.batch_size), loop, device)  # every stage reads every batch


def moved(x: Tensor | tuple[Tensor, ...], device: torch.device) -> Tensor | tuple[Tensor, ...]:
    """``x`` on ``device``: a cut inside a bottleneck passes its output and its shortcut."""
    return tuple(tensor.to(device) for tensor in x) if isinstance(x, tuple) else x.to(device)


def mmp(net: nn.Sequential, data: Dataset, loop: Loop, devices: list[torch.device]) -> Trained:
    """``net`` cut into a part per device, in one process."""
    parts = [part.to(device) for part, device in zip(cut(net, len(devices)), devices, strict=True)]
    optimizer, schedule_step = sgd(net, loop.batch_size, loop.steps, fused=devices[0].type == "cuda")
    criterion = nn.CrossEntropyLoss()

    def step(x: Tensor, y: Tensor) -> Tensor:
        with loop.autocast(devices[0]):
            for part, device in zip(parts, devices):
                x = part(moved(x, device))
            loss = criterion(x, y.to(devices[-1]))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule_step()
        return loss.detach()

    return train(step, batches(data, loop.batch_size), loop, devices[0])


DISTRIBUTED = {"ddp": ddp, "fsdp": fsdp, "pipeline": pipeline}


def write_figures(args: argparse.Namespace, images_per_step: int, seconds: float, peaks: list[int]) -> None:
    figures = result(images_per_step * args.steps, args.steps, seconds, peaks)
    Path(args.out).write_text(json.dumps(figures))


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    """Process ``rank`` of ``ddp``, ``fsdp`` or ``pipeline``."""
    keep_freed_memory()  # as main.py does: a process setting, not part of the recipe
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    url = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=url, rank=rank, world_size=args.processes)
    data = synthetic(args.batch_size * args.processes * 4)
    loop = Loop(args.batch_size, args.warmup + args.steps, args.warmup, args.precision == "bf16-mixed")
    _, seconds = DISTRIBUTED[args.peer](network(args.arch, args.stem), data, loop, device)
    Path(f"{args.out}.rank{rank}").write_text(json.dumps([peak_memory_bytes(device)]))
    if rank == 0:
        write_figures(args, args.batch_size * (1 if args.peer == "pipeline" else args.processes), seconds, [])
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("peer", choices=[*DISTRIBUTED, "mmp"])
    parser.add_argument("--processes", type=int, default=2, help="processes; with mmp, devices")
    parser.add_argument("--batch-size", type=int, default=32, help="per process (ddp, fsdp), else per step")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--precision", choices=["32-true", "bf16-mixed"], default="32-true")
    parser.add_argument("--stem", choices=["cifar", "imagenet"], default="cifar")
    parser.add_argument("--arch", default=DEFAULT_ARCH, help="the network, as the app's --model.arch names it")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", required=True, help="JSON file for the figures")
    args = parser.parse_args()
    if args.peer in DISTRIBUTED:
        # Forked: the processes start without importing everything again (nothing has touched a device yet).
        mp.start_processes(worker, (args, free_port()), nprocs=args.processes, start_method="fork")
        return
    keep_freed_memory()
    cuda = args.device == "cuda"
    devices = [torch.device("cuda", index) if cuda else torch.device("cpu") for index in range(args.processes)]
    loop = Loop(args.batch_size, args.warmup + args.steps, args.warmup, args.precision == "bf16-mixed")
    _, seconds = mmp(network(args.arch, args.stem), synthetic(args.batch_size * 4), loop, devices)
    write_figures(args, args.batch_size, seconds, [peak_memory_bytes(device) for device in dict.fromkeys(devices)])


if __name__ == "__main__":
    main()
