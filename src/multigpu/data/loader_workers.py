"""How loader workers start, and that they end with the training process they read for.

A worker forked from a training process can hang before its first batch when another thread of that process (gloo's,
pin memory's, TensorBoard's writer) held a lock at that moment (pytorch/pytorch#75147, #130610): the fork copies the
lock, not the thread that would release it. So the workers start from a fork server, a process of one thread that
imported this package once (Python 3.14 makes it the default for that reason). A worker's parent is then the fork
server, which lives as long as its workers, so torch's own check (is my parent alive?) cannot see a training process
killed with SIGKILL: each worker watches the training process itself, through a pidfd, and ends with it. Where a
process cannot watch another that way (not Linux, or a kernel or container that refuses pidfds) the workers are
spawned instead, children of the training process.
"""

import multiprocessing
import multiprocessing.forkserver
import os
import select
import signal
import threading
from functools import partial
from multiprocessing.context import BaseContext
from typing import Any

from lightning.fabric.utilities.seed import pl_worker_init_function

# Imported in the fork server before any worker starts, so each worker finds what it unpickles (the datasets, their
# transforms, ``start_worker``) already loaded and starts in milliseconds, sharing these pages with the server. The data
# modules only (``worker_preload``): ``main.py``, which a worker runs again as ``__mp_main__``, imports the CLI under
# its ``__main__`` guard.
PRELOADED = ["multigpu.data.worker_preload"]


def worker_start(workers: int, rank: int = 0) -> dict[str, Any]:
    """The ``DataLoader`` arguments that start ``workers`` workers of process ``rank`` safely: none without
    workers."""
    if not workers:
        return {}
    context = start_worker_server()
    if context is None:
        return {"multiprocessing_context": "spawn", "worker_init_fn": partial(start_worker, None, rank)}
    return {"multiprocessing_context": context, "worker_init_fn": partial(start_worker, os.getpid(), rank)}


def start_worker_server() -> BaseContext | None:
    """Start the fork server now, if it is not running yet, and return its context; ``None`` where workers are
    spawned instead, children of the training process: without pidfds (not Linux, a kernel before 5.3, a container
    that forbids them) or in a process forked from one that started its own server (``ddp_fork``). Started as the
    data is set up, the server imports ``PRELOADED`` while the training process goes on (builds its network, joins
    its process group), not when the first worker starts, so that the run starts sooner (docs/measurements.md,
    "Loader workers")."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return None
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED)
    try:
        multiprocessing.forkserver.ensure_running()
    except ChildProcessError:  # the server of the process this one was forked from
        return None
    return context


def start_worker(training_pid: int | None, rank: int, worker_id: int) -> None:
    """Run by each worker as it starts: leave Ctrl-C to the training process, which reaches every process of the
    job from a terminal (the training process finishes its step on it and saves, reading the batches its workers
    made); end this worker when the process ``training_pid`` ends, however it ends (where pidfds serve: the fork
    server's workers); and seed it as Lightning seeds the workers of a loader without a ``worker_init_fn``
    (``seed_everything(workers=True)``, which LightningCLI asks for)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if training_pid is not None:
        try:
            training = os.pidfd_open(training_pid)
        except ProcessLookupError:  # it ended while this worker started
            os._exit(0)
        threading.Thread(target=_exit_when_ended, args=(training,), name="end-with-training", daemon=True).start()
    if int(os.environ.get("PL_SEED_WORKERS", 0)):
        pl_worker_init_function(worker_id, rank)


def _exit_when_ended(training: int) -> None:
    poll = select.poll()
    poll.register(training, select.POLLIN)  # a process's pidfd turns readable when the process ends
    poll.poll()
    os._exit(0)
