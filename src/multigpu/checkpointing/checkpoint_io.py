"""Checkpoint files written in the background and atomically: a save holds training only while it copies the state,
a kill at any moment, during a write too, leaves the previous file intact, and a write that fails ends the job with
one line that names the process, the file and the error."""

import functools
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.serialization import config as serialization
from typing_extensions import override

from multigpu.checkpointing.sharded_checkpoints import (
    SHARDED,
    TENSORS,
    failed_shard,
    named_folder,
    shard_of,
    shards_folder,
    wait_for_shards,
    whole_checkpoint,
)
from multigpu.errors import JobFailed

__all__ = ["AtomicCheckpointIO", "CheckpointWriteFailed", "staged"]


_WITHOUT_CRC32 = threading.Lock()  # torch's serialization settings are the process's: one write changes them at once


def _local(path: Any) -> bool:
    protocol = get_filesystem(path).protocol
    return "file" in (protocol if isinstance(protocol, tuple) else (protocol,))


class CheckpointWriteFailed(JobFailed):
    """A checkpoint file this process could not write: the message names the process, the file and the error."""

    @staticmethod
    def reason(error: BaseException) -> str:
        """What went wrong, in a few words: the system's words where there is a system error in the chain."""
        cause = _in_chain(error, OSError)
        return f"{cause.strerror or cause}" if isinstance(cause, OSError) else f"{type(error).__name__}: {error}"

    @classmethod
    def of(cls, path: Path, error: BaseException) -> "CheckpointWriteFailed":
        """The failure of the write of ``path``, named by the first system error in ``error``'s chain (torch wraps a
        full disk's ``No space left on device`` into its own ``unexpected pos``)."""
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        reason = cls.reason(error)
        return cls(
            f"process {rank} could not write the checkpoint {path}: {reason}. The checkpoint before it is whole: free "
            "the space (or fix the folder's permissions) and resume with --ckpt_path last."
        )


def _in_chain(error: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The first exception of type ``kind`` in ``error``'s chain (``torch.save`` raises its own error when a write to
    its file fails, the file's error as its context)."""
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, kind):
        cause = cause.__cause__ or cause.__context__
    return cause


class _Abandoned(Exception):
    """A write given up (``AtomicCheckpointIO.abandon``): its temporary file is removed, the file before stays."""


def _interrupted(error: BaseException) -> bool:
    """Whether ``error`` stopped a write on purpose: given up (``abandon``), or a Ctrl-C in the training thread."""
    return _in_chain(error, _Abandoned) is not None or _in_chain(error, KeyboardInterrupt) is not None


class _CountedFile:
    """A file that counts the bytes written to it (the watchdog sees a slow write progress), and stops the write when
    it is abandoned."""

    def __init__(self, file: Any, io: "AtomicCheckpointIO") -> None:
        self._file, self._io = file, io

    def write(self, data: Any) -> int:
        if self._io._abandoned.is_set():
            raise _Abandoned
        written = self._file.write(data)
        self._io.bytes_written += written
        return written

    def flush(self) -> None:
        self._file.flush()


def _holds(save: Callable) -> Callable:
    """``save``, which records in ``held_s`` how long it held the training thread (a wait for the write before, the
    copy to host memory; the whole write in the foreground)."""

    @functools.wraps(save)
    def timed(self: "AtomicCheckpointIO", *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return save(self, *args, **kwargs)
        finally:
            self.held_s = time.perf_counter() - start

    return timed


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
        self._named: dict[Path, Sequence[Path | None]] = {}  # each sharded file's folder now, and the one before
        self._writing: Path | None = None  # the file the write in flight is for
        self._abort = threading.Event()  # set when the other processes' shards will not come (``abort``)
        self._abandoned = threading.Event()  # set when the process stops at once (``abandon``)
        self._removals: list[Path] = []  # files to remove once the write in flight is on disk
        self._lock = threading.Lock()  # over ``_removals`` and the writer's end
        self.bytes_written = 0  # by every write so far: the watchdog's sign that a long write progresses
        self.writing_elsewhere = False  # a save to remote storage (s3:// ...) in progress, whose bytes are not counted
        self.held_s: float | None = None  # how long the last save held the training thread
        self._read: tuple[Path, Mapping[str, Any]] | None = None  # a checkpoint read before the run (``hand_over``)

    def __getstate__(self) -> dict[str, Any]:
        # Pickled with its strategy into the processes ``ddp_spawn`` starts: without its thread, events and lock
        # and without a checkpoint read before the launch: each process reads its own
        return {**self.__dict__, "_writer": None, "_abort": None, "_abandoned": None, "_lock": None, "_read": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _abort=threading.Event(), _abandoned=threading.Event(), _lock=threading.Lock())

    @override
    @_holds
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        self.wait()
        self._read = None  # a run saves after its restore: the checkpoint it was handed is no longer wanted
        if not _local(path) or storage_options is not None:
            self.writing_elsewhere = True
            try:
                return super().save_checkpoint(checkpoint, path, storage_options)
            finally:
                self.writing_elsewhere = False
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._start(path, self.write, staged(checkpoint), path)

    @_holds
    def save_sharded(self, checkpoint: dict[str, Any], path: Any, rank: int, processes: int, token: str) -> None:
        """Save ``checkpoint``, whose tensors are sharded over ``processes`` processes, as each holds them: every
        process (this one is ``rank``) writes its shard into a folder of this save (``token``, the same in every
        process); the first one then writes the checkpoint file, which names that folder, once every shard is there,
        and removes the folder the file named before (``checkpointing.sharded_checkpoints``). The other processes may
        be writing the next save's shards by then: a folder is removed only once no file names it."""
        self.wait()
        self._read = None  # as in save_checkpoint
        path = Path(path)
        folder = shards_folder(path) / f"step{checkpoint['global_step']}-{token}"
        if not folder.is_dir():
            folder.mkdir(parents=True, exist_ok=True)
            _sync_folder(folder.parent)  # the new folder's entry, and the shards' folder's own, survive a crash
            _sync_folder(folder.parent.parent)
        shard = staged(shard_of(checkpoint, rank))
        if rank != 0:
            return self._start(path, self.write, shard, folder / f"rank{rank}.pt")
        if path not in self._named:  # this process's first save of it: what a kill left, but the file's own folder
            self._named[path] = [named_folder(path)]
            for left in shards_folder(path).iterdir():
                if left not in (folder, *self._named[path]):
                    shutil.rmtree(left, ignore_errors=True)
        named = staged({key: value for key, value in checkpoint.items() if key not in TENSORS})
        named[SHARDED] = {"folder": str(folder.relative_to(path.parent)), "processes": processes}
        self._start(path, self._publish, shard, named, folder, processes, path)

    KEPT_FOLDERS = 2  # the folder the file names and the one before: a reader that read the file before still finds it

    def _publish(self, shard, named, folder: Path, processes: int, path: Path) -> None:
        self.write(shard, folder / "rank0.pt")
        wait_for_shards(folder, processes, self._abort)
        self.write(named, path)
        kept = [folder, *(before for before in self._named[path] if before is not None and before != folder)]
        self._named[path] = kept[: self.KEPT_FOLDERS]
        for before in kept[self.KEPT_FOLDERS :]:
            shutil.rmtree(before, ignore_errors=True)

    def abort(self) -> None:
        """Give up the write in flight where it waits for other processes' shards (they failed, or were stopped):
        the checkpoint file keeps naming the folder before."""
        self._abort.set()

    def abandon(self) -> None:
        """Stop the write in flight at its next chunk, without a word (a second Ctrl-C): every file keeps its
        previous content, and the end of the run waits no longer than that chunk."""
        self._abandoned.set()
        self._abort.set()

    def _start(self, path: Path, write, *args) -> None:
        """Run ``write(*args)`` in the background, or here without ``background``."""
        self._abort.clear()
        if not self.background:
            try:
                return write(*args)
            except Exception as error:
                if _interrupted(error):  # a second Ctrl-C in the write: torch.save wraps it into its own error
                    raise KeyboardInterrupt from None
                if self._abort.is_set():
                    raise
                raise CheckpointWriteFailed.of(path, error) from error
        self._writing = path
        self._writer = threading.Thread(target=self._in_background, args=(path, write, *args))
        self._writer.name = f"checkpoint writer of {path.name}"
        self._writer.start()  # not a daemon: the interpreter waits for it before it exits

    def _in_background(self, path: Path, write, *args) -> None:
        failed = False
        try:
            write(*args)
        except BaseException as error:  # raised in the training thread: at its next step, save, load or teardown
            failed = True
            if not isinstance(error, Exception):  # an interruption: raised as it is
                self._error = error
            elif not _interrupted(error) and not self._abort.is_set():  # given up on purpose: no error of its own
                self._error = error if isinstance(error, JobFailed) else CheckpointWriteFailed.of(path, error)
                self._error.__cause__ = None if error is self._error else error
                print(f"error: {self._error}", file=sys.stderr, flush=True)  # at once: the step may be long
                self._error.printed = True
        with self._lock:
            removals, self._removals, self._writing = self._removals, [], None
        if not failed:  # the files this write replaces go once it is on disk; after a failure they stay
            for removal in removals:
                self._remove(removal)

    def write(self, checkpoint: dict[str, Any], path: Path) -> None:
        """Write ``checkpoint`` to ``path`` atomically: a temporary file beside it, synced, renamed into place. A
        failure leaves a mark beside a shard (``failed_shard``), for the first process waiting for it."""
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        for left in path.parent.glob(f".{path.name}.*.tmp"):  # a write a kill cut short, in an earlier process
            if left != temporary:
                left.unlink(missing_ok=True)
        try:
            with open(temporary, "wb") as file, _WITHOUT_CRC32:
                crc32, serialization.save.compute_crc32 = serialization.save.compute_crc32, False
                try:  # torch.load never checks it, and it is a third of a write's CPU time
                    torch.save(checkpoint, _CountedFile(file, self))  # type: ignore[arg-type]  # any writer serves
                finally:
                    serialization.save.compute_crc32 = crc32
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, path)
        except Exception as error:
            if path.parent.parent.name.endswith(".shards") and not _interrupted(error):
                failed_shard(path, CheckpointWriteFailed.reason(error))
            raise
        finally:
            temporary.unlink(missing_ok=True)
        _sync_folder(path.parent)  # the rename itself survives a crash of the machine

    def wait(self) -> None:
        """Wait for the write in flight, if any (``join``); raise its error."""
        self.join()
        self.raise_failure()

    def join(self) -> None:
        """Wait for the write in flight, if any, leaving its error to be raised at the next ``wait``. A Ctrl-C while it
        waits (the second one, at the end of a run a first one stopped) gives the write up: the file before stays."""
        if self._writer is not None:
            try:
                self._writer.join()
            except KeyboardInterrupt:
                self.abandon()
                raise
            self._writer = None

    @property
    def failed(self) -> bool:
        """Whether a write has failed, its error not raised yet."""
        return self._error is not None

    def raise_failure(self) -> None:
        """Raise the error of a background write that has failed, without waiting for one in flight: called after
        each step, so that a failed write ends the job at once rather than at the next save."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def hand_over(self, path: Any, checkpoint: Mapping[str, Any]) -> None:
        """Give ``checkpoint``, the contents of ``path`` as the CLI read them before the run (safely, on the CPU, an
        ``fsdp`` checkpoint's shards put together: ``check_checkpoint``), to the next load of that file, which then
        returns it instead of reading the file a second time."""
        self._read = (Path(path).resolve(), checkpoint)

    @override
    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> Any:
        self.wait()
        read, self._read = self._read, None
        if read is not None and _local(path) and Path(path).resolve() == read[0]:
            # The CLI's read maps the file (``check_checkpoint``): tensors the run keeps, such as a CPU optimizer's
            # state, would keep the file mapped, and its disk space held after the next save replaces it, all run
            # long. They are read out of it here, the one read of the file.
            return apply_to_collection(read[1], torch.Tensor, torch.Tensor.clone)
        checkpoint = super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        return whole_checkpoint(checkpoint, Path(path)) if isinstance(checkpoint, dict) else checkpoint

    @override
    def remove_checkpoint(self, path: Any) -> None:
        """Remove ``path`` (and its shards) once the write in flight is on disk, in the writer's thread: Lightning
        removes a best-k file it replaces as soon as the save of the new one returns, before that one exists. A
        failed write keeps it."""
        with self._lock:
            if self._writing is not None and self._writing != Path(path):
                self._removals.append(Path(path))
                return
        if self._writing is not None:  # the file being written itself
            self.wait()
        self._remove(path)

    def _remove(self, path: Any) -> None:
        super().remove_checkpoint(path)
        if _local(path):
            shutil.rmtree(shards_folder(Path(path)), ignore_errors=True)

    @override
    def teardown(self) -> None:
        """Wait for the write in flight. While the run ends with another exception (a failure, a second Ctrl-C), that
        one stays the one reported: a write's own error was printed when it happened. A stop (SIGTERM: a
        ``SystemExit``) is no error, and a failed write of its checkpoint is raised."""
        self._read = None  # a run that never restored (ddp_spawn's launching process) lets it go here
        if sys.exc_info()[1] is None or isinstance(sys.exc_info()[1], SystemExit):
            self.wait()
        else:
            try:
                self.wait()
            except Exception:
                pass
        super().teardown()


def _sync_folder(folder: Path) -> None:
    """fsync ``folder``, so that the entries made in it survive a crash of the machine."""
    directory = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
