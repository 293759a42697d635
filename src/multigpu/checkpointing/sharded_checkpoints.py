"""Checkpoints of a sharded network (``fsdp``), written where the state is: each process writes its own shard of the
network's and the optimizer's tensors, and no process gathers the whole state.

A sharded checkpoint is the usual file (``last.ckpt``: the loops, the callbacks, the options, the run's metadata)
whose network and optimizer tensors lie in a folder beside it, one file per process:

    last.ckpt                                  written last, by the first process, once every shard is on disk
    last.ckpt.shards/step<N>-<token>/rank<R>.pt   process R's part of each sharded tensor, and where it sits

``last.ckpt`` names its folder (``SHARDED``), so a kill at any moment leaves the previous ``last.ckpt`` and the folder
it names whole: a folder is removed only once a newer ``last.ckpt`` names another (``AtomicCheckpointIO.save_sharded``
writes them in that order). Read back (``read_checkpoint``, ``whole_checkpoint``), the shards are put together into
whole tensors, in the layout every other strategy's checkpoint has: any strategy, any device count, ``test``,
``predict`` and ``export`` read it as any other.
"""

import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard

from multigpu.errors import JobFailed, UsageError

__all__ = [
    "SHARDED",
    "failed_shard",
    "named_folder",
    "read_checkpoint",
    "shard_of",
    "shards_folder",
    "wait_for_shards",
    "whole_checkpoint",
]

SHARDED = "sharded"  # the key of a sharded checkpoint's folder and process count
TENSORS = ("state_dict", "optimizer_states")  # what the shards hold; the rest stays in the checkpoint file
_PIECE = "__shard__"  # marks a process's piece of a sharded tensor in its file


def shards_folder(path: Path) -> Path:
    """The folder that holds the shard folders of checkpoint ``path``."""
    return path.with_name(f"{path.name}.shards")


def _piece(tensor: DTensor) -> dict[str, Any]:
    """This process's piece of ``tensor``, and where it sits: for each dimension of the mesh, the tensor dimension it
    cuts (``Shard``) or ``None`` (``Replicate``), and this process's coordinate."""
    dims: list[int | None] = []
    for placement in tensor.placements:
        if isinstance(placement, Shard):
            dims.append(placement.dim)
        elif isinstance(placement, Replicate):
            dims.append(None)
        else:
            raise ValueError(f"a sharded checkpoint holds sharded and replicated tensors, not {placement}")
    coordinate = tensor.device_mesh.get_coordinate()
    assert coordinate is not None  # this process holds a piece: it is on the mesh
    return {_PIECE: tensor.to_local(), "dims": dims, "coordinate": list(coordinate), "shape": list(tensor.shape)}


def shard_of(checkpoint: dict[str, Any], rank: int) -> dict[str, Any]:
    """What process ``rank`` writes of ``checkpoint``'s tensors: its piece of each sharded one; the others (buffers,
    plain values) from the first process only."""

    def take(value: Any) -> Any:
        if isinstance(value, DTensor):
            return _piece(value)
        if isinstance(value, dict):
            return {key: take(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(take(item) for item in value)
        return value if rank == 0 else None

    return {name: take(checkpoint[name]) for name in TENSORS if name in checkpoint}


def named_folder(path: Path) -> Path | None:
    """The shards' folder the checkpoint file ``path`` names, or ``None`` (no file, or a whole one)."""
    if not path.is_file():
        return None
    sharded = torch.load(path, map_location="cpu", mmap=True, weights_only=True).get(SHARDED)
    return path.parent / sharded["folder"] if sharded else None


def _failure_mark(shard: Path) -> Path:
    return shard.with_name(f"{shard.name}.failed")


def failed_shard(shard: Path, reason: str) -> None:
    """Mark beside ``shard`` that its write failed, and why, so that the first process, which waits for every shard
    before it writes the checkpoint file, stops waiting at once (best effort: a full disk may refuse even the mark's
    words, or the mark, and then the failing process ends the job at its next step)."""
    try:
        with open(_failure_mark(shard), "w") as mark:
            mark.write(reason)
    except OSError:
        pass


def wait_for_shards(folder: Path, processes: int, abort: threading.Event, timeout_s: float = 1800.0) -> None:
    """Wait until every process's shard file is in ``folder`` (each is renamed into place whole); a ``JobFailed`` that
    names the process when another process's write failed (``failed_shard``), a ``RuntimeError`` when ``abort`` is
    set (the other processes failed or were stopped) or after ``timeout_s`` (torch's default timeout of a
    collective)."""
    deadline = time.monotonic() + timeout_s
    while any(not (folder / f"rank{rank}.pt").is_file() for rank in range(processes)):
        if failed := [rank for rank in range(processes) if _failure_mark(folder / f"rank{rank}.pt").exists()]:
            mark = _failure_mark(folder / f"rank{failed[0]}.pt")
            reason = mark.read_text(errors="replace").strip() or "see its own error"
            raise JobFailed(f"process {failed[0]} could not write its shard {mark.with_suffix('')}: {reason}; the "
                            "checkpoint file keeps naming the folder before")  # fmt: skip
        if abort.is_set() or time.monotonic() > deadline:
            raise RuntimeError(f"{folder}: the shards of {processes} processes were not all written; the checkpoint "
                               "file keeps naming the folder before")  # fmt: skip
        time.sleep(0.05)


def _whole(pieces: list[dict[str, Any]]) -> Tensor:
    """The tensor the processes' ``pieces`` cut: the pieces of the first replica, put together along the dimension the
    sharded mesh dimension cuts, in the order of their coordinates."""
    dims = pieces[0]["dims"]
    replicated = [index for index, dim in enumerate(dims) if dim is None]
    sharded = [index for index, dim in enumerate(dims) if dim is not None]
    first = [piece for piece in pieces if all(piece["coordinate"][index] == 0 for index in replicated)]
    if not sharded:
        return first[0][_PIECE]
    if len(sharded) > 1:
        raise ValueError("a sharded checkpoint's tensors are cut along one dimension of the mesh")
    mesh_dim = sharded[0]
    ordered = sorted(first, key=lambda piece: piece["coordinate"][mesh_dim])
    whole = torch.cat([piece[_PIECE] for piece in ordered], dim=dims[mesh_dim])
    assert list(whole.shape) == pieces[0]["shape"], (whole.shape, pieces[0]["shape"])
    return whole


def _joined(shards: list[Any]) -> Any:
    first = shards[0]
    if isinstance(first, dict) and _PIECE in first:
        return _whole(shards)
    if isinstance(first, dict):
        return {key: _joined([shard[key] for shard in shards]) for key in first}
    if isinstance(first, list | tuple):
        return type(first)(_joined([shard[index] for shard in shards]) for index in range(len(first)))
    return first


def whole_checkpoint(checkpoint: dict[str, Any], path: Path, tries: int = 3) -> dict[str, Any]:
    """``checkpoint``, read from ``path``, with the whole tensors of its shards where it is sharded; as it is else.
    A run that saves meanwhile replaces the folder of a file read two saves before: the file is then read again, up
    to ``tries`` times."""
    if SHARDED not in checkpoint:
        return checkpoint
    folder, processes = path.parent / checkpoint[SHARDED]["folder"], checkpoint[SHARDED]["processes"]
    files = [folder / f"rank{rank}.pt" for rank in range(processes)]
    if missing := [file for file in files if not file.is_file()]:
        again = torch.load(path, map_location="cpu", mmap=True, weights_only=True) if path.is_file() else {}
        if tries > 1 and again.get(SHARDED, checkpoint[SHARDED]) != checkpoint[SHARDED]:
            return whole_checkpoint(again, path, tries - 1)
        raise UsageError(
            f"checkpoint {path} is sharded, and its shard {missing[0]} is missing: restore the folder {folder} "
            "beside it, or resume from another checkpoint."
        )
    shards = [torch.load(file, map_location="cpu", mmap=True, weights_only=True) for file in files]
    whole = {key: value for key, value in checkpoint.items() if key != SHARDED}
    return {**whole, **{name: _joined([shard[name] for shard in shards]) for name in shards[0]}}


def read_checkpoint(path: str | Path, **load: Any) -> dict[str, Any]:
    """``torch.load`` of checkpoint ``path`` (with the keyword arguments ``load``), its shards put together."""
    path = Path(path)
    return whole_checkpoint(torch.load(path, **{"map_location": "cpu", "weights_only": True, **load}), path)
