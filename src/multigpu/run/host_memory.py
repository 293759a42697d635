"""The C heap of a training process: freed memory kept for the next step, not handed back to the kernel.

glibc's ``malloc`` serves every block above 32 MiB (ResNet-50's activations at a batch of 128, on the CPU) with its
own ``mmap`` and returns it to the kernel when freed, so each step faults the same memory in again, page by page,
and on the CPU much of the step goes to the kernel. Kept for reuse, the same step is much faster, for more resident
memory at the peak: blocks that come from one heap leave holes there (docs/speed.md, "On the CPU", and
docs/measurements.md, "Host memory", have the figures). Host memory on a GPU holds small blocks, which glibc keeps
anyway, so little should change there. The setting is the main thread's heap; blocks of other threads (gloo's) above
64 MiB are still mapped one by one.

``resident_bytes`` reads the process's resident memory (``plan``'s overhead of a process, the CPU's figure at each
log step).

``MULTIGPU_KEEP_FREED_MEMORY=0`` leaves glibc's own behaviour. So does a user's own setting of its thresholds
(``MALLOC_MMAP_MAX_``, ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_``, or the same
tunables in ``GLIBC_TUNABLES``), or another allocator in ``LD_PRELOAD`` (jemalloc, tcmalloc, mimalloc).
"""

import ctypes
import os

__all__ = ["give_back_freed_memory", "keep_freed_memory", "resident_bytes"]

# glibc's malloc.h and mallopt(3): free memory at the heap's top above the trim threshold goes back to the kernel
# (-1: never); at most ``M_MMAP_MAX`` blocks are served by their own mmap (0: none, every block from the heap).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_USER_SETTINGS = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
_USER_TUNABLES = tuple(f"glibc.malloc.{name}" for name in ("mmap_max", "mmap_threshold", "trim_threshold", "top_pad"))
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def _glibc() -> ctypes.CDLL | None:
    """This process's C library, where it is glibc."""
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION")
    except (AttributeError, ValueError, OSError):  # no confstr (Windows), or no such name (macOS)
        return None
    return ctypes.CDLL(None) if version else None


def keep_freed_memory() -> bool:
    """Make glibc's ``malloc`` keep freed memory for reuse in this process (and the processes it forks); whether it
    did: not where the C library is not glibc, nor where the user opted out or chose the allocator (above)."""
    tunables, preloaded = os.environ.get("GLIBC_TUNABLES", ""), os.environ.get("LD_PRELOAD", "")
    if (
        os.environ.get("MULTIGPU_KEEP_FREED_MEMORY") == "0"
        or any(name in os.environ for name in _USER_SETTINGS)
        or any(name in tunables for name in _USER_TUNABLES)
        or any(name in preloaded for name in _OTHER_ALLOCATORS)
        or (libc := _glibc()) is None
    ):
        return False
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, -1))


def give_back_freed_memory() -> None:
    """Hand the freed memory this process kept back to the kernel now (``malloc_trim``), before it waits on others
    that need it (``plan``'s measured runs, after its profiling)."""
    if (libc := _glibc()) is not None:
        libc.malloc_trim(0)


def resident_bytes() -> int:
    """This process's resident memory now."""
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
