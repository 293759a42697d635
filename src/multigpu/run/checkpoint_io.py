"""Checkpoint files written in the background and atomically: a save holds training only while it copies the state,
and a kill at any moment, during a write too, leaves the previous file intact."""

import os
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.serialization import config as serialization
from typing_extensions import override

from multigpu.run.sharded_checkpoints import (
    SHARDED,
    TENSORS,
    named_folder,
    shard_of,
    shards_folder,
    wait_for_shards,
    whole_checkpoint,
)

__all__ = ["AtomicCheckpointIO", "staged"]


_WITHOUT_CRC32 = threading.Lock()  # torch's serialization settings are the process's: one write changes them at once


def _local(path: Any) -> bool:
    protocol = get_filesystem(path).protocol
    return "file" in (protocol if isinstance(protocol, tuple) else (protocol,))


def staged(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``checkpoint`` that training can no longer change: every tensor copied to host memory, every dict and
    list rebuilt (a callback's state may hold its own dict, which it changes at the next save)."""
    return apply_to_collection(checkpoint, torch.Tensor, lambda tensor: tensor.detach().to("cpu", copy=True))


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint in a thread of its own, to a temporary file beside its target, syncs it, then renames it
    into place.

    ``save_checkpoint`` copies the state to host memory (``staged``), starts the write and returns: training goes on
    while the file is written (docs/fault-tolerance.md says what that costs in memory). At most one write is in flight:
    the next save waits for it before it copies anything, and so do a load, a removal and the end of the run
    (``teardown``, which Lightning calls at the end of ``fit`` and after an interruption); an error of the write
    is raised there. With ``background=False`` the file is written before ``save_checkpoint`` returns.

    The rename is atomic on a local or network file system, so a reader sees the old file or the new one, never a
    truncated one, whatever moment a kill strikes. (Lightning's own save goes through a temporary file in the system's
    temp folder, and moving it across file systems is a copy that a kill can cut short.) Remote paths (``s3://`` ...)
    keep Lightning's way, in the foreground.
    """

    def __init__(self, background: bool = True) -> None:
        super().__init__()
        self.background = background
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None
        self._named: dict[Path, Path | None] = {}  # the shards' folder each sharded checkpoint file names now
        self._writing: Path | None = None  # the file the write in flight is for
        self._abort = threading.Event()  # set when the other processes' shards will not come (``abort``)

    def __getstate__(self) -> dict[str, Any]:
        # Pickled with its strategy into the processes ``ddp_spawn`` starts: without its thread and event
        return {**self.__dict__, "_writer": None, "_abort": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _abort=threading.Event())

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        self.wait()
        if not _local(path) or storage_options is not None:
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._start(path, self.write, staged(checkpoint), path)

    def save_sharded(self, checkpoint: dict[str, Any], path: Any, rank: int, processes: int, token: str) -> None:
        """Save ``checkpoint``, whose tensors are sharded over ``processes`` processes, as each holds them: every
        process (this one is ``rank``) writes its shard into a folder of this save (``token``, the same in every
        process); the first one then writes the checkpoint file, which names that folder, once every shard is there,
        and removes the folder the file named before (``multigpu.run.sharded_checkpoints``). The other processes may
        be writing the next save's shards by then: a folder is removed only once no file names it."""
        self.wait()
        path = Path(path)
        folder = shards_folder(path) / f"step{checkpoint['global_step']}-{token}"
        folder.mkdir(parents=True, exist_ok=True)
        shard = staged(shard_of(checkpoint, rank))
        if rank != 0:
            return self._start(path, self.write, shard, folder / f"rank{rank}.pt")
        if path not in self._named:  # this process's first save of it: what a kill left, but the file's own folder
            self._named[path] = named_folder(path)
            for left in shards_folder(path).iterdir():
                if left not in (folder, self._named[path]):
                    shutil.rmtree(left, ignore_errors=True)
        named = staged({key: value for key, value in checkpoint.items() if key not in TENSORS})
        named[SHARDED] = {"folder": str(folder.relative_to(path.parent)), "processes": processes}
        self._start(path, self._publish, shard, named, folder, processes, path)

    def _publish(self, shard, named, folder: Path, processes: int, path: Path) -> None:
        self.write(shard, folder / "rank0.pt")
        wait_for_shards(folder, processes, self._abort)
        self.write(named, path)
        before, self._named[path] = self._named[path], folder
        if before is not None and before != folder:
            shutil.rmtree(before, ignore_errors=True)

    def abort(self) -> None:
        """Give up the write in flight where it waits for other processes' shards (they failed, or were stopped):
        the checkpoint file keeps naming the folder before."""
        self._abort.set()

    def _start(self, path: Path, write, *args) -> None:
        """Run ``write(*args)`` in the background, or here without ``background``."""
        self._abort.clear()
        if not self.background:
            return write(*args)
        self._writing = path
        self._writer = threading.Thread(target=self._in_background, args=(write, *args))
        self._writer.name = f"checkpoint writer of {path.name}"
        self._writer.start()  # not a daemon: the interpreter waits for it before it exits

    def _in_background(self, write, *args) -> None:
        try:
            write(*args)
        except BaseException as error:  # raised in the training thread, at the next save, load or teardown
            self._error = error
            print(f"error: writing {self._writing} failed: {error!r}", file=sys.stderr, flush=True)

    def write(self, checkpoint: dict[str, Any], path: Path) -> None:
        """Write ``checkpoint`` to ``path`` atomically: a temporary file beside it, synced, renamed into place."""
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        for left in path.parent.glob(f".{path.name}.*.tmp"):  # a write a kill cut short, in an earlier process
            if left != temporary:
                left.unlink(missing_ok=True)
        try:
            with open(temporary, "wb") as file, _WITHOUT_CRC32:
                crc32, serialization.save.compute_crc32 = serialization.save.compute_crc32, False
                try:  # torch.load never checks it, and it is a third of a write's CPU time
                    torch.save(checkpoint, file)
                finally:
                    serialization.save.compute_crc32 = crc32
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # the rename itself survives a crash of the machine
        finally:
            os.close(directory)

    def wait(self) -> None:
        """Wait for the write in flight, if any; raise its error."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    @override
    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> Any:
        self.wait()
        checkpoint = super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        return whole_checkpoint(checkpoint, Path(path)) if isinstance(checkpoint, dict) else checkpoint

    @override
    def remove_checkpoint(self, path: Any) -> None:
        if self._writing is not None and Path(path) == self._writing:  # another file's write goes on
            self.wait()
        super().remove_checkpoint(path)
        if _local(path):
            shutil.rmtree(shards_folder(Path(path)), ignore_errors=True)

    @override
    def teardown(self) -> None:
        self.wait()
        super().teardown()
