"""The links between the devices, measured on the real backend: what ``plan``'s predictions charge for moving
tensors and for the runtimes that move them, and, on the CPU, how much processes running at once slow each other.

``measure_links`` starts one process per device with ``torchrun`` (gloo on the CPU, NCCL on
GPUs) running this module. Rank 0 and 1 time a ping-pong of a small and a large tensor (the
latency and bandwidth of a send); all ranks time an all-reduce, an all-gather and a
reduce-scatter of both sizes (latency and bus bandwidth: a ring all-reduce moves ``2 (n-1)/n``
of the bytes, the other two ``(n-1)/n``). Two tiny networks, whose arithmetic costs nothing,
give what the runtimes add besides moving bytes: a GPipe step of one small layer per process
(seconds per pipeline action), and a forward and backward pass and an SGD step of
``fully_shard``-ed small layers (seconds per sharded block, and per sharded parameter's
update). On the CPU every rank then times one convolution's forward and backward pass at the
same moment, which ``plan`` compares with the same pass run alone: the share of the memory
bandwidth and caches a process loses. Each figure is the fastest of a few runs.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import ScheduleGPipe

from multigpu.compat import pipeline_stage
from multigpu.errors import UsageError
from multigpu.planning.profile import threads_per_process
from multigpu.process_groups import end_process_groups

__all__ = ["Link", "Links", "measure_links"]

SIZES = (2**12, 2**25)  # bytes: one small and one large tensor
REPEATS = 7
LINK_TIMEOUT_S = 180


@dataclass(frozen=True)
class Link:
    """A collective's (or a send's) latency in seconds and bus bandwidth in bytes per second, measured over
    ``world`` devices."""

    latency: float = 0.0
    bandwidth: float = float("inf")

    @classmethod
    def fitted(cls, points: list[list[float]], traffic: float) -> "Link":
        """The line through two (bytes, seconds) points, each moving ``traffic`` times its bytes."""
        (small, t_small), (large, t_large) = points
        bandwidth = (large - small) * traffic / max(t_large - t_small, 1e-9)
        return cls(max(0.0, t_small - small * traffic / bandwidth), bandwidth)


@dataclass(frozen=True)
class Links:
    """The measured links of ``world`` devices (``cuda``: GPUs, not processes on one CPU): sends, all-reduces,
    all-gathers and reduce-scatters; the seconds a pipeline schedule spends per action, and ``fully_shard`` per
    block and per parameter's update, besides computing and moving bytes; and how much slower a process computes
    with ``world`` processes at once (1 on GPUs)."""

    world: int
    cuda: bool = False
    sends: Link = Link()
    reduces: Link = Link()
    gathers: Link = Link()
    scatters: Link = Link()
    pipeline_action: float = 0.0
    sharded_block: float = 0.0
    sharded_update: float = 0.0
    contention: float = 1.0

    @property
    def overlap(self) -> bool:
        """Whether transfers run beside the computation: on GPUs; on the CPU the same cores do both."""
        return self.cuda

    def send(self, nbytes: float) -> float:
        return self.sends.latency + nbytes / self.sends.bandwidth if nbytes else 0.0

    def all_reduce(self, nbytes: float, group: int) -> float:
        """A ring all-reduce of ``nbytes`` over ``group`` devices."""
        return self._collective(self.reduces, nbytes, group, 2 * (group - 1) / group)

    def all_gather(self, nbytes: float, group: int, latency: bool = True) -> float:
        """A ring all-gather whose whole tensor has ``nbytes`` over ``group`` devices; without
        its latency when ``latency`` is false (where a runtime's measured cost per call holds it)."""
        link = self.gathers if latency else Link(0.0, self.gathers.bandwidth)
        return self._collective(link, nbytes, group, (group - 1) / group)

    def reduce_scatter(self, nbytes: float, group: int, latency: bool = True) -> float:
        """A ring reduce-scatter of a tensor of ``nbytes`` over ``group`` devices (``latency`` as ``all_gather``)."""
        link = self.scatters if latency else Link(0.0, self.scatters.bandwidth)
        return self._collective(link, nbytes, group, (group - 1) / group)

    def slowdown(self, processes: int) -> float:
        """How much slower a process computes with ``processes`` processes at once."""
        if processes < 2 or self.world < 2:
            return 1.0
        return 1.0 + (self.contention - 1.0) * (processes - 1) / (self.world - 1)

    def _collective(self, link: Link, nbytes: float, group: int, traffic: float) -> float:
        if group < 2 or not nbytes:
            return 0.0
        return link.latency * (group - 1) / max(1, self.world - 1) + nbytes * traffic / link.bandwidth


def _probe_pass(threads: int | None = None) -> float:
    """Seconds of one 3x3 convolution's forward and backward pass on 8 CIFAR-sized feature maps (the median of
    ``REPEATS``), with ``threads`` threads."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    x = torch.randn(8, 128, 16, 16, requires_grad=True)
    weight = torch.randn(128, 128, 3, 3, requires_grad=True)
    times = []
    for _ in range(REPEATS + 1):
        start = time.perf_counter()
        F.conv2d(x, weight, padding=1).sum().backward()
        times.append(time.perf_counter() - start)
    torch.set_num_threads(before)
    return statistics.median(times[1:])


def measure_links(processes: int, cuda: bool, device_ids: list[int] | None) -> Links:
    """Measure the links between ``processes`` devices in as many fresh processes (see the module's docstring)."""
    if processes < 2:
        return Links(world=1, cuda=cuda)
    print(f"measuring the links between {processes} {'GPUs' if cuda else 'CPU processes'}", flush=True)
    ids = ",".join(map(str, device_ids or range(processes))) if cuda else "cpu"
    threads = threads_per_process(processes)
    with tempfile.TemporaryDirectory(prefix="multigpu-links-") as folder:
        out = Path(folder) / "links.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
        command += ["-m", "multigpu.planning.links", str(out), ids]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=LINK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise UsageError(
                f"measuring the links between the devices took over {LINK_TIMEOUT_S} s: stopped."
            ) from None
        if done.returncode or not out.exists():
            last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise UsageError(f"measuring the links between the devices failed: {last[0]}")
        figures = json.loads(out.read_text())
    share = (processes - 1) / processes
    return Links(
        processes,
        cuda,
        sends=Link.fitted(figures["send"], 1.0),
        reduces=Link.fitted(figures["all_reduce"], 2 * share),
        gathers=Link.fitted(figures["all_gather"], share),
        scatters=Link.fitted(figures["reduce_scatter"], share),
        pipeline_action=figures["pipeline_action"],
        sharded_block=figures["sharded_block"],
        sharded_update=figures["sharded_update"],
        contention=max(1.0, figures["probe"] / _probe_pass(threads)) if not cuda else 1.0,
    )


def _timed(function, device: torch.device) -> float:
    """The fastest of ``REPEATS`` runs of ``function()`` after one untimed, all ranks starting together (anything
    else on the machine only slows a run down)."""
    times = []
    for _ in range(REPEATS + 1):
        dist.barrier()
        start = time.perf_counter()
        function()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times[1:])


def _pipeline_action_time(device: torch.device) -> float:
    """Seconds per action of a GPipe step over every rank, one tiny layer per rank: the schedule's own cost."""
    rank, world = dist.get_rank(), dist.get_world_size()
    micro_batches = 2 * world
    stage = pipeline_stage(nn.Linear(16, 16).to(device), rank, world, device, dist.group.WORLD)
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


def _sharded_costs(device: torch.device, blocks: int = 8) -> tuple[float, float]:
    """Seconds per block of a forward and backward pass through ``fully_shard``-ed tiny blocks, and per
    parameter tensor of an SGD step on their shards: the runtime's own costs. Each block holds 5 parameter
    tensors, as ResNet-50's blocks do on average (161 in 34 blocks)."""
    net = nn.Sequential(
        *(nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 16, bias=False)) for _ in range(blocks))
    ).to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in net:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    x = torch.randn(4, 16, device=device)
    passes = _timed(lambda: net(x).sum().backward(), device) / blocks
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0, momentum=0.9)
    return passes, _timed(optimizer.step, device) / len(list(net.parameters()))


def _probe(out: str, ids: str) -> None:
    """One rank of ``measure_links``'s processes (started by ``torchrun``)."""
    local_rank = int(os.environ["LOCAL_RANK"])
    cuda = ids != "cpu"
    device = torch.device("cuda", int(ids.split(",")[local_rank])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
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
    figures["sharded_block"], figures["sharded_update"] = _sharded_costs(device)
    if not cuda:
        dist.barrier()
        probe = torch.tensor([_probe_pass()])
        dist.all_reduce(probe)
        figures["probe"] = probe.item() / dist.get_world_size()
    if rank == 0:
        Path(out).write_text(json.dumps(figures))
    end_process_groups()


if __name__ == "__main__":
    _probe(*sys.argv[1:3])
