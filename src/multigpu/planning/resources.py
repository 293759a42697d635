"""What this machine can give ``plan``'s layouts: the memory each may use, read from CUDA, /proc and the control
group's limit."""

from pathlib import Path

import torch

__all__ = ["budget"]


def budget(cuda: bool, device_ids: list[int], memory_per_device: float | None) -> tuple[int, bool]:
    """The bytes a layout may use, and whether that is per device (else for all processes together)."""
    if memory_per_device is not None:
        return int(memory_per_device * 2**30), True
    if cuda:
        return int(0.9 * min(torch.cuda.mem_get_info(index)[0] for index in device_ids)), True
    return int(0.9 * _available_bytes()), False


def _available_bytes() -> int:
    """Memory the processes can have on this machine: MemAvailable (free memory and reclaimable cache),
    within the control group's limit."""
    with open("/proc/meminfo") as file:
        available = next(int(line.split()[1]) * 1024 for line in file if line.startswith("MemAvailable:"))
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return available
    return available if limit == "max" else min(available, int(limit) - used)
