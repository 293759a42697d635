"""Whether the CPU cores a measurement runs on are busy: other processes on them would be measured too.

The check runs ``probe_pass`` (one convolution's forward and backward pass) on all the threads one process gets,
and compares the CPU time the process got with the
time that passed: on quiet cores its threads hold them all the while (97-100% here, 2 threads on 2 cores);
where another process runs, the kernel shares the cores with it (56-74% with one of the 2 taken, 46-50% with
both). The best of ``TRIES`` counts, so that a brief burst elsewhere is not a busy machine. On GPUs
``plan`` profiles on the device, and does not check.
"""

import statistics
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from multigpu.errors import UsageError
from multigpu.planning.profile import threads_per_process

__all__ = ["IF_BUSY", "QUIET_SHARE", "WAIT_S", "CoreCheck", "check_cores", "note_if_busy", "until_quiet"]

QUIET_SHARE = 0.85  # the share of their cores below which the threads found them busy
TRIES = 3
WAIT_S = 60.0  # how long ``until_quiet`` waits for busy cores
IF_BUSY = Literal["wait", "refuse", "go"]
REPEATS = 7


@dataclass(frozen=True)
class CoreCheck:
    """The share of ``threads`` cores that the convolution's threads got while it ran."""

    threads: int
    share: float

    @property
    def busy(self) -> bool:
        return self.share < QUIET_SHARE

    def __str__(self) -> str:
        return (
            f"a convolution on {self.threads} thread(s) got {self.share:.0%} of their cores "
            f"(quiet cores: {QUIET_SHARE:.0%} or more)"
        )


def probe_pass(threads: int | None = None) -> float:
    """Seconds of one 3x3 convolution's forward and backward pass on 8 CIFAR-sized feature maps (the median of
    ``REPEATS`` after one untimed), with ``threads`` threads."""
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


def _share(threads: int) -> float:
    cpu, wall = time.process_time(), time.perf_counter()  # the CPU time of all the process's threads
    probe_pass(threads)
    return (time.process_time() - cpu) / ((time.perf_counter() - wall) * threads)


def check_cores(threads: int | None = None) -> CoreCheck:
    """The share of their cores that ``threads`` threads (default: all of one process's) got, the best of
    ``TRIES``."""
    threads = threads or threads_per_process(1)
    return CoreCheck(threads, min(1.0, max(_share(threads) for _ in range(TRIES))))


def note_if_busy(who: str, moment: str) -> CoreCheck:
    """Check the cores, and say in one line when they are busy."""
    check = check_cores()
    if check.busy:
        print(f"{who}: the cores are busy {moment}: {check}; another process is running on them.", flush=True)
    return check


def until_quiet(if_busy: IF_BUSY, who: str, moment: str, remedy: str) -> bool:
    """Check the cores; when busy, say so in one line and, as ``if_busy`` says, go on (``go``), refuse
    (``refuse``), or wait up to ``WAIT_S`` for them to quieten and refuse if they don't (``wait``). Returns
    whether they were quiet at once (``False``: they were busy, and ``who`` went on or waited)."""
    if not (check := note_if_busy(who, moment)).busy:
        return True
    if if_busy == "go":
        print(f"{who}: going on (if_busy=go): its figures measure that process too.", flush=True)
        return False
    if if_busy == "wait":
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            time.sleep(5)
            if not (check := check_cores()).busy:
                print(f"{who}: the cores are quiet again ({check.share:.0%}).", flush=True)
                return False
    waited = f" for {WAIT_S:.0f} s" if if_busy == "wait" else ""
    raise UsageError(
        f"the cores stayed busy{waited} ({check}): {who}'s figures would measure the other process too. "
        f"Stop it, or {remedy}."
    )
