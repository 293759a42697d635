"""The links between the devices, measured on the real backend: what ``plan``'s forecasts charge for moving
tensors and for the runtimes that move them, and, on the CPU, how much processes running at once slow each other.

``measure_links`` runs ``link_probe`` in one process per device: on GPUs started with ``torchrun`` (NCCL), which
imports torch alone; on the CPU (gloo) forked from ``plan``'s process as it begins, before it computes anything
(``ForkedRanks``), so that they wait, idle, through the profile, with everything imported, and start and measure in
far less time than ``torchrun``'s (docs/measurements.md, "Links"; ``torchrun`` starts them off Linux and for a
second profile too). Rank 0 and 1 time a ping-pong of a small and a large tensor (the latency and bandwidth of a
send); all ranks time an all-reduce, an all-gather and a reduce-scatter of both sizes (latency and bus bandwidth: a
ring all-reduce moves ``2 (n-1)/n`` of the bytes, the other two ``(n-1)/n``). Two tiny networks, whose arithmetic
costs nothing, give what the runtimes add besides moving bytes: a GPipe step of one small layer per process (seconds
per pipeline action), and a forward and backward pass and an SGD step of ``fully_shard``-ed small layers (seconds
per sharded block, and per sharded parameter's update); a pass through ``fully_shard``-ed large matrices, against
the same unsharded and their collectives alone, gives its cost per byte of parameters (the copies into and out of
the collectives' buffers). Each figure is the median of a few runs. How much processes computing at once on the CPU
slow each other (``contention``, ``lockstep``) is not the links' to measure: ``plan`` takes it from the profile's
rounds (``BlockProfile.contention``), at the moment the passes' level was timed.
"""

import json
import math
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import wait
from pathlib import Path

from multigpu.errors import UsageError
from multigpu.planning import link_probe
from multigpu.timing.busy_cores import threads_per_process

__all__ = ["ForkedRanks", "Link", "Links", "fork_ranks", "measure_links"]

LINK_TIMEOUT_S = 180
DISMISS_S = 10  # how long a dismissed rank has to end before it is killed


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
    block, per byte of a block's parameters and per parameter's update, besides computing and moving bytes; and
    how much slower a process computes with ``world`` processes at once, on average (``contention``) and the
    slowest of them against that average (``lockstep``; both 1 on GPUs, and set by ``plan`` from its profile)."""

    world: int
    cuda: bool = False
    sends: Link = Link()
    reduces: Link = Link()
    gathers: Link = Link()
    scatters: Link = Link()
    pipeline_action: float = 0.0
    sharded_block: float = 0.0
    sharded_byte: float = 0.0
    sharded_update: float = 0.0
    contention: float = 1.0
    lockstep: float = 1.0

    @property
    def overlap(self) -> bool:
        """Whether transfers run beside the computation: on GPUs; on the CPU the same cores do both."""
        return self.cuda

    def figures(self) -> dict:
        """Every figure, as ``plan.json`` records it (an unmeasured link's infinite bandwidth as None)."""
        figures = asdict(self)
        for name in ("sends", "reduces", "gathers", "scatters"):
            if math.isinf(figures[name]["bandwidth"]):
                figures[name]["bandwidth"] = None
        return figures

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

    def slowdown(self, processes: float, in_lockstep: bool = False) -> float:
        """How much slower a process computes with ``processes`` processes at once (on average: a pipeline's
        processes compute at once only between their bubbles); ``in_lockstep``, where each waits for the others
        throughout the step, as slow as the slowest of them. Both figures were measured with ``world`` processes
        and are scaled down to fewer alike."""
        if processes <= 1 or self.world < 2:
            return 1.0
        share = (processes - 1) / (self.world - 1)
        average = 1.0 + (self.contention - 1.0) * share
        return average * (1.0 + (self.lockstep - 1.0) * share) if in_lockstep else average

    def _collective(self, link: Link, nbytes: float, group: int, traffic: float) -> float:
        if group < 2 or not nbytes:
            return 0.0
        return link.latency * (group - 1) / max(1, self.world - 1) + nbytes * traffic / link.bandwidth


class ForkedRanks:
    """``link_probe``'s ranks on the CPU, ``processes`` of them forked at once, each waiting idle (``forked_rank``)
    until ``measure`` says how many measure; used once (then none are left). Fork them before this process
    computes anything: GNU OpenMP's thread pool does not survive a fork, and a forked rank's first parallel
    region on more than one thread then hangs. Those not measuring, or all where ``dismiss`` is called first,
    end at once; all end with this process. They write to its output (torch's FutureWarnings silenced)."""

    def __init__(self, processes: int) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="multigpu-links-")
        context = multiprocessing.get_context("fork")
        self._pipes, self._ranks = [], []
        for rank in range(processes):
            receive, send = context.Pipe(duplex=False)
            process = context.Process(
                target=link_probe.forked_rank, args=(rank, receive, self._folder.name), daemon=True
            )
            process.start()
            self._pipes.append(send)
            self._ranks.append(process)

    def __len__(self) -> int:
        return len(self._ranks)

    def measure(self, processes: int) -> dict:
        """The figures of the first ``processes`` ranks measuring together (at most ``len(self)``), each with its
        share of the cores; the others end. A ``UsageError`` says why not: a rank that failed ends the others at
        once (they would wait for it until the time limit), and so does an error or Ctrl-C here."""
        self._send(processes, threads_per_process(processes))
        deadline = time.monotonic() + LINK_TIMEOUT_S
        try:
            while (running := [rank.sentinel for rank in self._ranks if rank.exitcode is None]) and not any(
                rank.exitcode for rank in self._ranks
            ):
                if not wait(running, max(0.0, deadline - time.monotonic())):
                    break  # the time limit
        finally:  # before the ranks still running are ended
            failed = {index: rank.exitcode for index, rank in enumerate(self._ranks) if rank.exitcode}
            hung = not failed and any(rank.exitcode is None for rank in self._ranks)
            self._end()
        out = Path(self._folder.name) / "links.json"
        figures = json.loads(out.read_text()) if out.exists() and not (hung or failed) else None
        self._folder.cleanup()
        if hung:
            raise _took_too_long()
        if figures is None:
            codes = ", ".join(f"rank {index} exited with {code}" for index, code in failed.items()) or "no figures"
            raise _failed(f"{codes}; see the output above")
        return figures

    def dismiss(self) -> None:
        """End every rank that has not measured, without measuring."""
        self._send(0, 1)
        deadline = time.monotonic() + DISMISS_S
        for rank in self._ranks:
            rank.join(max(0.0, deadline - time.monotonic()))
        self._end()
        self._folder.cleanup()

    def _send(self, processes: int, threads: int) -> None:
        for pipe in self._pipes:
            try:
                pipe.send((processes, threads))
            except OSError:  # a rank already gone (killed, say)
                pass
            pipe.close()
        self._pipes = []

    def _end(self) -> None:
        for rank in self._ranks:
            rank.kill()
            rank.join()
        self._ranks = []


def fork_ranks(processes: int, cuda: bool) -> ForkedRanks | None:
    """``processes`` ranks of the link probe, forked now, on a CPU of Linux: None on GPUs (``torchrun`` starts
    them), for one process (no links), and off Linux (Windows cannot fork; macOS's system libraries are not safe to
    fork), where ``torchrun`` starts them too."""
    return ForkedRanks(processes) if not cuda and processes > 1 and sys.platform == "linux" else None


def _took_too_long() -> UsageError:
    return UsageError(f"measuring the links between the devices took over {LINK_TIMEOUT_S} s: stopped.")


def _failed(why: str) -> UsageError:
    return UsageError(f"measuring the links between the devices failed: {why}")


def measure_links(processes: int, cuda: bool, device_ids: list[int] | None, forked: ForkedRanks | None = None) -> Links:
    """Measure the links between ``processes`` devices in as many processes (see the module's docstring):
    ``forked``'s ranks on the CPU where it has as many (they are then used up), else fresh ones."""
    if processes < 2:
        if forked is not None:
            forked.dismiss()
        return Links(world=1, cuda=cuda)
    print(f"measuring the links between {processes} {'GPUs' if cuda else 'CPU processes'}", flush=True)
    if forked is not None and processes <= len(forked):  # forked: on the CPU only (``fork_ranks``)
        figures = forked.measure(processes)
    else:
        if forked is not None:
            forked.dismiss()
        figures = _measured_by_torchrun(processes, cuda, device_ids)
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
        sharded_byte=figures["sharded_byte"],
        sharded_update=figures["sharded_update"],
    )


def _measured_by_torchrun(processes: int, cuda: bool, device_ids: list[int] | None) -> dict:
    """``link_probe``'s figures from ``processes`` processes started by ``torchrun``."""
    ids = ",".join(map(str, device_ids or range(processes))) if cuda else "cpu"
    with tempfile.TemporaryDirectory(prefix="multigpu-links-") as folder:
        out = Path(folder) / "links.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
        command += ["-m", "multigpu.planning.link_probe", str(out), ids]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_process(processes))}
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=LINK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise _took_too_long() from None
        if done.returncode or not out.exists():
            last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise _failed(last[0])
        return json.loads(out.read_text())
