"""Whether the CPU cores a measurement runs on are busy: other processes on them would be measured too.

The check runs ``probe_pass`` (one convolution's forward and backward pass) on all the threads one process gets, and
compares the CPU time the process got with the time that passed: on quiet cores its threads hold them nearly all the
while; where another process runs, the kernel shares the cores with it, and they get far less (docs/plan.md,
"Running it", has the shares). The best of ``TRIES`` counts, so that a brief burst elsewhere is not a busy machine.
On GPUs ``plan`` profiles on the device, and does not check.

A virtual machine's cores can be busy with what the check cannot see: other virtual machines on the same host, which
run while a virtual core waits to run ("steal" time, which Linux counts in ``/proc/stat``). Such a host can give
this one back all its cores when quiet and hold back a large share of their time under a sustained load, and then
every wait on another process takes longer: ``fsdp``, which waits on the other process about 100 times a step,
measured a far slower step than with none stolen (docs/plan.md, "Running it"). So every check also counts the share
of the cores' time stolen while its convolution ran, and a check after a measurement the share stolen since it began
(``since``), each of the time the cores ran or waited to run.
"""

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from multigpu.errors import UsageError

__all__ = [
    "IF_BUSY",
    "QUIET_SHARE",
    "STOLEN_SHARE",
    "WAIT_S",
    "CoreCheck",
    "CpuClock",
    "check_cores",
    "cores",
    "note_if_busy",
    "read_cpu_clock",
    "threads_per_process",
    "until_quiet",
    "wait_for_quiet",
]


def cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def threads_per_process(processes: int) -> int:
    """The threads each of ``processes`` processes on this machine gets from Lightning's launcher."""
    return max(1, cores() // processes)


QUIET_SHARE = 0.85  # the share of their cores below which the threads found them busy
STOLEN_SHARE = 0.10  # the share of the cores' time stolen by a virtual machine's host above which they were busy
TRIES = 3
WAIT_S = 60.0  # how long ``until_quiet`` waits for busy cores
IF_BUSY = Literal["wait", "refuse", "go"]
REPEATS = 7


@dataclass(frozen=True)
class CpuClock:
    """The machine's CPU time since it started, in clock ticks (``/proc/stat``'s first line): the time its cores ran
    or waited to run (idle time left out), and of that what its host stole (the time they waited while the host ran
    other virtual machines)."""

    wanted: int
    stolen: int

    def stolen_share_since(self, before: "CpuClock") -> float:
        """The share of the time the cores ran or waited to run, from ``before`` to this reading, that was stolen:
        on cores that half idle (one process of one thread on 2), as much as on busy ones."""
        share = (self.stolen - before.stolen) / max(1, self.wanted - before.wanted)
        return min(1.0, max(0.0, share))  # a counter that jumped (a migrated virtual machine) is not a share


def read_cpu_clock(stat: Path = Path("/proc/stat")) -> CpuClock | None:
    """The machine's CPU time now, or None where ``stat`` does not say (not Linux, or no count of stolen time)."""
    try:
        fields = stat.read_text().split("\n", 1)[0].split()
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
    except (OSError, ValueError):
        return None
    if fields[0] != "cpu":
        return None
    return CpuClock(wanted=user + nice + system + irq + softirq + steal, stolen=steal)


@dataclass(frozen=True)
class CoreCheck:
    """The share of ``threads`` cores that the convolution's threads got while it ran, and the share of the
    cores' time a virtual machine's host stole while it ran or over the measurement before it, the larger
    (``stolen``; None where not known)."""

    threads: int
    share: float
    stolen: float | None = None

    @property
    def busy(self) -> bool:
        return self.process_busy or self.stolen_busy

    @property
    def process_busy(self) -> bool:
        return self.share < QUIET_SHARE

    @property
    def stolen_busy(self) -> bool:
        return self.stolen is not None and self.stolen > STOLEN_SHARE

    @property
    def cause(self) -> str:
        """Why the cores are busy."""
        causes = ["another process is running on them"] if self.process_busy else []
        causes += ["the host runs other virtual machines on them"] if self.stolen_busy else []
        return ", and ".join(causes)

    @property
    def reason(self) -> str:
        """What was measured, and why the cores are busy: the text a busy line and a busy mark share."""
        return f"{self}; {self.cause}"

    @property
    def other(self) -> str:
        """What a measurement on these cores measures besides itself."""
        others = ["the other process"] if self.process_busy else []
        others += ["the host's other virtual machines"] if self.stolen_busy else []
        return " and ".join(others)

    @property
    def first_remedy(self) -> str:
        """What the user can do about it: stop another process; not the host's other virtual machines."""
        return "Stop it" if self.process_busy else "Try again when the host is quieter"

    def measures_too(self, whose: str, remedy: str) -> str:
        """The end of a refusal on these cores: what ``whose`` figures would measure, and what to do."""
        return f"{whose} figures would measure {self.other} too. {self.first_remedy}, or {remedy}."

    def __str__(self) -> str:
        text = (
            f"a convolution on {self.threads} thread(s) got {self.share:.0%} of their cores "
            f"(quiet cores: {QUIET_SHARE:.0%} or more)"
        )
        if self.stolen_busy:
            text += (
                f", and the host stole {self.stolen:.0%} of the cores' time while it measured (steal in "
                f"/proc/stat, of the time they ran or waited to run; quiet: {STOLEN_SHARE:.0%} or less)"
            )
        return text


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


def check_cores(threads: int | None = None, since: CpuClock | None = None) -> CoreCheck:
    """The share of their cores that ``threads`` threads (default: all of one process's) got, the best of
    ``TRIES``, and the share of the cores' time stolen while they ran (the least of the tries, as a brief burst on
    one is not a busy machine) or, with ``since`` (a reading taken as a measurement began), since then: the
    larger."""
    threads = threads or threads_per_process(1)
    clocks, shares = [read_cpu_clock()], []
    for _ in range(TRIES):
        shares.append(_share(threads))
        clocks.append(read_cpu_clock())
    tries = [after.stolen_share_since(before) for before, after in zip(clocks, clocks[1:]) if before and after]
    known = [min(tries)] if tries else []  # none where /proc/stat does not say (not Linux)
    known += [now.stolen_share_since(since)] if since is not None and (now := clocks[-1]) is not None else []
    return CoreCheck(threads, min(1.0, max(shares)), max(known, default=None))


def note_if_busy(who: str, moment: str, since: CpuClock | None = None) -> CoreCheck:
    """Check the cores (and the time stolen ``since``), and say in one line when they are busy."""
    check = check_cores(since=since)
    if check.busy:
        print(f"{who}: the cores are busy {moment}: {check.reason}.", flush=True)
    return check


def wait_for_quiet(who: str, check: CoreCheck) -> CoreCheck:
    """After ``check`` found the cores busy, check them every 5 s for up to ``WAIT_S``; once quiet, say so in one
    line. The last check."""
    deadline = time.monotonic() + WAIT_S
    while check.busy and time.monotonic() < deadline:
        time.sleep(5)
        if not (check := check_cores()).busy:
            print(f"{who}: the cores are quiet again ({check.share:.0%}).", flush=True)
    return check


def until_quiet(
    if_busy: IF_BUSY, who: str, moment: str, remedy: str, since: CpuClock | None = None
) -> CoreCheck | None:
    """Check the cores (and the time stolen ``since``); when busy, say so in one line and, as ``if_busy`` says,
    go on (``go``), refuse (``refuse``), or wait up to ``WAIT_S`` for them to quieten and refuse if they don't
    (``wait``). Returns the check that found them busy, where ``who`` went on or waited; None where they were
    quiet at once."""
    if not (busy := note_if_busy(who, moment, since)).busy:
        return None
    if if_busy == "go":
        print(f"{who}: going on (if_busy=go): its figures measure {busy.other} too.", flush=True)
        return busy
    if not (check := wait_for_quiet(who, busy) if if_busy == "wait" else busy).busy:
        return busy
    waited = f" for {WAIT_S:.0f} s" if if_busy == "wait" else ""
    whose = f"{who}'s"
    raise UsageError(f"the cores stayed busy{waited} ({check}): {check.measures_too(whose, remedy)}")
