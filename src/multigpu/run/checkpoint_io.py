"""Checkpoint files written atomically: a kill during a save leaves the previous file intact."""

import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

__all__ = ["AtomicCheckpointIO"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint to a temporary file beside its target, syncs it, then renames it into place.

    The rename is atomic on a local or network file system, so a reader sees the old
    file or the new one, never a truncated one. (Lightning's own save goes through a
    temporary file in the system's temp folder, and moving it across file systems is a
    copy that a kill can cut short.) Remote paths (``s3://`` ...) keep Lightning's way.
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        protocol = get_filesystem(path).protocol
        if "file" not in (protocol if isinstance(protocol, tuple) else (protocol,)) or storage_options is not None:
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(temporary, "wb") as file:
                torch.save(checkpoint, file)
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
