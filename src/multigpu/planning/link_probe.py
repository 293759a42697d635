"""One rank of ``links.measure_links``'s processes: it times the links and the runtimes' own costs and writes them
(rank 0) to a JSON file. Started by ``torchrun`` it imports torch alone, so that its processes start quickly:

    python -m torch.distributed.run --standalone --nproc_per_node=N -m multigpu.planning.link_probe OUT cpu|IDS

On the CPU ``plan`` forks its ranks instead (``links.ForkedRanks``, ``forked_rank``), with all of it imported.
"""

import json
import math
import os
import signal
import statistics
import sys
import time
import warnings
from multiprocessing import parent_process
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from multigpu.run.device_sync import synchronize
from multigpu.run.host_memory import keep_freed_memory
from multigpu.run.process_groups import end_process_groups

__all__ = ["REPEATS", "SIZES", "forked_rank"]

SIZES = (2**12, 2**25)  # bytes: one small and one large tensor
REPEATS = 7
# Rounds of the sharded runtime's cost per byte, the median round counting: enough for a median, and each round
# lengthens the probe (docs/measurements.md, "Link probe")
SHARDED_ROUNDS = 5


def _once(function, device: torch.device) -> float:
    """Seconds of one run of ``function()``, all ranks starting together, its queued work included."""
    dist.barrier()
    start = time.perf_counter()
    function()
    synchronize(device)
    return time.perf_counter() - start


def _timed(function, device: torch.device) -> float:
    """The median of ``REPEATS`` runs of ``function()`` after one untimed: the collectives a training step meets,
    not the luckiest one (on the CPU the same gather's time varies widely within one probe: docs/plan.md,
    "Accuracy")."""
    return statistics.median([_once(function, device) for _ in range(REPEATS + 1)][1:])


def _pipeline_action_time(device: torch.device) -> float:
    """Seconds per action of a GPipe step over every rank, one tiny layer per rank: the schedule's own cost."""
    rank, world = dist.get_rank(), dist.get_world_size()
    micro_batches = 2 * world
    stage = PipelineStage(nn.Linear(16, 16).to(device), rank, world, device)  # one stage per process
    schedule = ScheduleGPipe(stage, micro_batches, loss_fn=lambda output, target: output.sum())
    x = torch.randn(2 * micro_batches, 16, device=device)

    def step() -> None:
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=x)
        else:
            schedule.step()

    # Along the longest path: each micro-batch's forward and backward actions, and the stages' fill and drain.
    return _timed(step, device) / (2 * (micro_batches + world - 1))


def _sharded_costs(device: torch.device, blocks: int = 8) -> tuple[float, float, float]:
    """The runtime's own costs: seconds per block of a forward and backward pass through ``fully_shard``-ed
    tiny blocks; per byte of a block's parameters, from the same through blocks of one large matrix each, less
    the same blocks unsharded and their gathers and reduce-scatters alone (the copies into and out of the
    collectives' buffers, which grow with the bytes); and per parameter tensor of an SGD step on their shards.
    Each tiny block holds 5 parameter tensors, as ResNet-50's blocks do on average (161 in 34 blocks)."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))

    def sharded(net: nn.Sequential) -> nn.Sequential:
        for block in net:
            fully_shard(block, mesh=mesh)
        fully_shard(net, mesh=mesh)
        return net

    net = sharded(
        nn.Sequential(
            *(nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 16, bias=False)) for _ in range(blocks))
        ).to(device)
    )
    x = torch.randn(4, 16, device=device)
    per_block = _timed(lambda: net(x).sum().backward(), device) / blocks
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0, momentum=0.9)
    per_tensor = _timed(optimizer.step, device) / len(list(net.parameters()))

    # 32 MiB of parameters a block, the links' large size, whose gathers the forecast charges; one row of input:
    # next to no arithmetic
    width, large = math.isqrt(SIZES[-1] // 4), 2  # 2896 float32s a side
    matrices = lambda: nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(large))).to(device)  # noqa: E731
    whole, split = matrices(), sharded(matrices())
    row = torch.randn(1, width, device=device)
    full = torch.empty(width * width // dist.get_world_size() * dist.get_world_size(), device=device)
    shard = full[: full.numel() // dist.get_world_size()]

    def excess() -> float:
        """One round: the sharded pass less the unsharded one, per matrix, less a matrix's collectives timed alone
        (its gather in the forward and again in the backward pass, its reduce-scatter)."""
        collectives = 2 * _once(lambda: dist.all_gather_into_tensor(full, shard), device)
        collectives += _once(lambda: dist.reduce_scatter_tensor(shard, full), device)
        passes = [_once(lambda net=net: net(row).sum().backward(), device) for net in (split, whole)]
        return (passes[0] - passes[1]) / large - collectives

    # The excess is a small part of the sharded pass, so a slow moment on the sharded passes alone moves it many times
    # over: with the parts timed apart, one probe read many times what the others read
    # (docs/measurements.md, "Link probe"; docs/plan.md, "Accuracy"). Each round times every part back to back; the
    # median round counts.
    rounds = [excess() for _ in range(SHARDED_ROUNDS + 1)][1:]
    per_byte = max(0.0, statistics.median(rounds) - per_block) / (4 * width * width)
    return per_block, per_byte, per_tensor


def _probe(out: str, ids: str) -> None:
    """One rank of ``measure_links``'s processes started by ``torchrun``."""
    local_rank = int(os.environ["LOCAL_RANK"])
    cuda = ids != "cpu"
    device = torch.device("cuda", int(ids.split(",")[local_rank])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    _measure(Path(out), device)


def forked_rank(rank: int, go: Connection, folder: str) -> None:
    """Rank ``rank`` of ``links.ForkedRanks``, forked on the CPU: it waits, idle, for the number of processes to
    measure and their threads each, then measures with those of them whose rank is below it (gloo, through a store
    file in ``folder``, the figures to ``folder``/links.json); it ends without measuring where ``plan`` ends first.
    Ctrl-C is ``plan``'s to handle: its end ends this rank."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = parent_process()
    assert parent is not None  # a forked rank
    if go not in wait([go, parent.sentinel]):
        return
    world, threads = go.recv()
    if rank >= world:
        return
    warnings.simplefilter("ignore", FutureWarning)  # torch's deprecated names, on plan's output (torchrun's is kept)
    torch.set_num_threads(threads)
    store = dist.FileStore(os.path.join(folder, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    _measure(Path(folder) / "links.json", torch.device("cpu"))


def _measure(out: Path, device: torch.device) -> None:
    """Time the links and the runtimes' costs on ``device``, in the process group begun; rank 0 writes them to
    ``out``."""
    rank = dist.get_rank()
    world = dist.get_world_size()
    figures: dict = {"send": [], "all_reduce": [], "all_gather": [], "reduce_scatter": []}
    for size in SIZES:
        tensor = torch.zeros(size // 4, device=device)

        def ping_pong(tensor=tensor) -> None:
            if rank == 0:
                dist.send(tensor, 1)
                dist.recv(tensor, 1)
            elif rank == 1:
                dist.recv(tensor, 0)
                dist.send(tensor, 0)

        figures["send"].append([size, _timed(ping_pong, device) / 2])
        figures["all_reduce"].append([size, _timed(lambda tensor=tensor: dist.all_reduce(tensor), device)])
        shard = tensor[: tensor.numel() // world]
        gather = lambda tensor=tensor, shard=shard: dist.all_gather_into_tensor(tensor[: len(shard) * world], shard)  # noqa: E731
        figures["all_gather"].append([size, _timed(gather, device)])
        scatter = lambda tensor=tensor, shard=shard: dist.reduce_scatter_tensor(shard, tensor[: len(shard) * world])  # noqa: E731
        figures["reduce_scatter"].append([size, _timed(scatter, device)])
    figures["pipeline_action"] = _pipeline_action_time(device)
    figures["sharded_block"], figures["sharded_byte"], figures["sharded_update"] = _sharded_costs(device)
    if rank == 0:
        out.write_text(json.dumps(figures))
    end_process_groups()


if __name__ == "__main__":
    keep_freed_memory()  # as main.py does, whose runs these figures forecast
    _probe(*sys.argv[1:3])
