"""The C heap of a training process: freed memory kept for the next step, not handed back to the kernel.

glibc's ``malloc`` serves every block above 32 MiB (ResNet-50's activations at a batch of 128, on the CPU) with its
own ``mmap`` and returns it to the kernel when freed, so each step faults the same memory in again, page by page:
on a 2-core CPU a third of the step went to the kernel (31 s a step, 33 s of system time per 100 s). Kept for
reuse, the same step took 21 s (1.45x), for a third more resident memory at the peak. On a GPU the host's blocks
are small and nothing changes. A user who sets glibc's thresholds (``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_MAX_``,
``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TOP_PAD_`` or a malloc tunable in ``GLIBC_TUNABLES``) keeps them:
``MALLOC_TRIM_THRESHOLD_=131072`` (glibc's default) gives the memory back as before.
"""

import ctypes
import os

__all__ = ["keep_freed_memory"]

# glibc's malloc.h and mallopt(3): free memory at the heap's top above the trim threshold goes back to the kernel
# (-1: never); at most ``M_MMAP_MAX`` blocks are served by their own mmap (0: none, every block from the heap).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_USER_SETTINGS = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_memory() -> bool:
    """Make glibc's ``malloc`` keep freed memory for reuse in this process (and the processes it forks); whether it
    did: not where the C library is not glibc, nor where the user set the allocator's thresholds themselves."""
    if any(name in os.environ for name in _USER_SETTINGS) or "malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        glibc = bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (AttributeError, ValueError, OSError):  # no confstr (Windows), or no such name (macOS)
        glibc = False
    if not glibc:
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, -1))
