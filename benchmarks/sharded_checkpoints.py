"""fsdp's sharded checkpoints, ours beside torch.distributed.checkpoint (DCP), on the same sharded state.

    python benchmarks/sharded_checkpoints.py                      # ResNet-50, 2 gloo processes, 5 rounds
    python benchmarks/sharded_checkpoints.py --arch resnet18 --rounds 3

Two processes on the CPU shard ResNet-50 with FSDP2 (``fully_shard`` on each block, then on the whole network, as
``--trainer.strategy=fsdp``), take one SGD step with momentum, and save the network and the optimizer, in turn each
round, two ways:

    ours   ``AtomicCheckpointIO.save_sharded``: each process copies its shards to host memory and writes them in a
           thread; the first then writes the checkpoint file that names their folder (what ``fit`` does)
    dcp    ``torch.distributed.checkpoint.async_save`` of ``get_model_state_dict`` / ``get_optimizer_state_dict``
           (torchtitan's way), on a gloo group of its own, its default staging to host memory

For each, per save, the first process's:

    held ms      how long the save held the training thread (until the call returned)
    wall ms      until the checkpoint was whole on disk (the write waited for)
    peak MiB     the rise of the process's resident memory during the save, sampled every millisecond
    load 1 ms    reading the checkpoint back whole in one process, without a process group (``read_checkpoint``;
                 DCP's ``dcp_to_torch_save``): what a resume on another process count, test, predict and export do

Medians with their intervals over the rounds (``multigpu.timing.intervals``), and ``<out>/sharded_checkpoints.json``.
"""

import argparse
import json
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torchvision
from machine import in_words, machine
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from multigpu.checkpointing.checkpoint_io import AtomicCheckpointIO
from multigpu.checkpointing.sharded_checkpoints import read_checkpoint
from multigpu.timing.intervals import median_interval

WAYS = ("ours", "dcp")


def _resident_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class _PeakMemory:
    """The highest resident memory above the start's while it runs, sampled every millisecond."""

    def __enter__(self) -> "_PeakMemory":
        self.start, self.peak, self._done = _resident_mib(), 0.0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.001):
            self.peak = max(self.peak, _resident_mib() - self.start)

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


def _sharded(arch: str, mesh) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    network = torchvision.models.get_model(arch, num_classes=10)
    for block in [*network.children()][:-1]:
        if any(True for _ in block.parameters()):
            fully_shard(block, mesh=mesh)
    fully_shard(network, mesh=mesh)
    optimizer = torch.optim.SGD(network.parameters(), lr=0.1, momentum=0.9)
    network(torch.randn(4, 3, 32, 32)).sum().backward()
    optimizer.step()
    return network, optimizer


def _save_ours(network, optimizer, folder: Path, rank: int, token: str) -> tuple[float, float]:
    io = AtomicCheckpointIO()
    checkpoint = {
        "state_dict": get_model_state_dict(network),
        "optimizer_states": [optimizer.state_dict()],
        "global_step": 1,
        "epoch": 0,
    }
    start = time.perf_counter()
    io.save_sharded(checkpoint, folder / "last.ckpt", rank, dist.get_world_size(), token)
    held = time.perf_counter() - start
    io.wait()
    dist.barrier()  # the first process's file is written once every shard is: the others wait for it here
    return held, time.perf_counter() - start


def _save_dcp(network, optimizer, folder: Path, group) -> tuple[float, float]:
    state = {"model": get_model_state_dict(network), "optim": get_optimizer_state_dict(network, optimizer)}
    start = time.perf_counter()
    future = dcp.async_save(state, checkpoint_id=str(folder / "dcp"), process_group=group)
    held = time.perf_counter() - start
    future.result()
    dist.barrier()
    return held, time.perf_counter() - start


def _load(way: str, folder: Path) -> float:
    start = time.perf_counter()
    if way == "ours":
        read_checkpoint(folder / "last.ckpt")
    else:
        dcp_to_torch_save(str(folder / "dcp"), str(folder / "whole.pt"))
        torch.load(folder / "whole.pt", weights_only=True)
    return time.perf_counter() - start


def _process(rank: int, world: int, port: int, arch: str, rounds: int, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    group = dist.new_group(backend="gloo")  # DCP's async collectives, apart from training's
    network, optimizer = _sharded(arch, mesh)
    figures = {way: [] for way in WAYS}
    for round_ in range(rounds):
        for way in WAYS if round_ % 2 == 0 else reversed(WAYS):
            folder = out / f"{way}-{round_}"
            if rank == 0:
                folder.mkdir(parents=True)
            dist.barrier()
            with _PeakMemory() as memory:
                if way == "ours":
                    held, wall = _save_ours(network, optimizer, folder, rank, f"r{round_}")
                else:
                    held, wall = _save_dcp(network, optimizer, folder, group)
            load = _load(way, folder) if rank == 0 else 0.0
            dist.barrier()
            figures[way].append({"held": held, "wall": wall, "peak": memory.peak, "load": load})
    if rank == 0:
        (out / "figures.json").write_text(json.dumps(figures))
    dist.destroy_process_group()


def summary(figures: dict[str, list[dict]]) -> list[dict]:
    rows = []
    for way in WAYS:
        runs = figures[way]
        row = {"way": way}
        for key, scale in (("held", 1000), ("wall", 1000), ("peak", 1), ("load", 1000)):
            interval = median_interval([run[key] * scale for run in runs])
            row[key] = (interval.median, interval.low, interval.high)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--out", default=None, help="where the figures go (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(args.out or scratch)
        out.mkdir(parents=True, exist_ok=True)
        with socket.socket() as probe:  # a free port for the rendezvous
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        mp.spawn(_process, args=(args.processes, port, args.arch, args.rounds, out), nprocs=args.processes)
        rows = summary(json.loads((out / "figures.json").read_text()))
        print(f"{args.arch}, {args.processes} gloo processes, {args.rounds} rounds; {in_words(machine())}")
        print(f"{'way':<6} {'held ms':>22} {'wall ms':>22} {'peak MiB':>22} {'load 1 ms':>22}")
        for row in rows:
            figures = (row[key] for key in ("held", "wall", "peak", "load"))
            cells = [f"{median:.0f} ({low:.0f}-{high:.0f})" for median, low, high in figures]
            print(f"{row['way']:<6} " + " ".join(f"{cell:>22}" for cell in cells))
        (out / "sharded_checkpoints.json").write_text(json.dumps({"arch": args.arch, "rows": rows}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
