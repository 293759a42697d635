"""``python main.py export``: the command's options, and its lines; what it writes is ``multigpu.trained.export``'s.

It takes ``fit``'s options, so that ``--ckpt_path last`` finds the run's newest checkpoint
(``--run_name``, ``--checkpoint_root``).
"""

import glob
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lightning.pytorch.cli import LightningArgumentParser
from typing_extensions import override

from multigpu.checkpointing.files import resolve_ckpt_path
from multigpu.cli.lightning_cli import MultiGPUCLI
from multigpu.cli.run_options import RunOptions
from multigpu.errors import UsageError, check_writable
from multigpu.model.network_options import NetworkOptions
from multigpu.trained.export import (
    SUFFIXES,
    Format,
    input_line,
    input_notes,
    torchvision_load_lines,
    write_export,
)

__all__ = ["ExportCLI", "export"]


@dataclass(frozen=True)
class ExportOptions(RunOptions):
    """``export``'s options: ``fit``'s, the format and the file."""

    to: Format = "torchvision"
    out: str | None = None


class ExportCLI(MultiGPUCLI):
    """``fit``'s parser with ``--ckpt_path``, ``--to`` and ``--out``; it builds nothing."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        super().add_arguments_to_parser(parser)
        parser.add_argument("--ckpt_path", type=str, default="last", help="The checkpoint: a file, last or best.")
        parser.add_argument("--to", type=Format, default="torchvision", help="torchvision, torchscript or onnx.")
        parser.add_argument("--out", type=str, default=None, help="The file to write (default: beside the checkpoint).")

    @override
    def resolve_checkpoint_path(self) -> None:
        """``export`` reads the checkpoint itself (``resolve_ckpt_path``), after parsing."""

    @override
    def instantiate_classes(self) -> None:
        """Nothing is built from the options: the network comes from the checkpoint."""


def export(args: Sequence[str], default_config_files: Sequence[str | Path]) -> None:
    """Run ``python main.py export <args>``."""
    options = ExportOptions.of(ExportCLI(default_config_files=default_config_files, args=list(args), run=False).config)
    folder = Path(options.checkpoint_root) / options.run_name
    path, checkpoint = resolve_ckpt_path(options.ckpt_path, folder, training=False)
    if not checkpoint:
        raise UsageError(f"--ckpt_path {path}: export reads a checkpoint file on this machine; copy it here first.")
    assert path is not None  # a checkpoint read from it
    to = options.to
    arch = NetworkOptions.saved_in(checkpoint).arch.rsplit(".", 1)[-1]
    out = Path(options.out or Path(path).with_name(f"{arch}-{Path(path).stem}{SUFFIXES[to]}"))
    check_writable("--out", out)  # before the network is built
    out.parent.mkdir(parents=True, exist_ok=True)
    before = {file: file.stat().st_mtime_ns for file in out.parent.glob(f"{glob.escape(out.name)}*")}
    checked = write_export(checkpoint, to, out)
    notes = input_notes(checkpoint)
    out.with_name(f"{out.name}.input.json").write_text(json.dumps(notes, indent=2) + "\n")
    written = [  # ONNX puts large weights in a file of their own beside the model (``.onnx.data``)
        str(file)
        for file in sorted(out.parent.glob(f"{glob.escape(out.name)}*"))
        if before.get(file) != file.stat().st_mtime_ns
    ]
    print(f"export ({to}) from {path}: wrote {', '.join(written)}; {checked}.")
    print(input_line(notes))
    if to == "torchvision":
        print(f"load it:\n{torchvision_load_lines(checkpoint, out)}")
