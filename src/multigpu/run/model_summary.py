"""The model summary of a run: Lightning's rich table, without a FLOP count that was never made.

Lightning counts the FLOPs of one forward pass of the module's ``example_input_array``; a strategy that cannot run
that pass in one process (``pipeline``: each process holds its stage's blocks) has none, and Lightning's summary
then says ``Total FLOPs: 0``.
"""

from typing import Any

from lightning.pytorch.callbacks import RichModelSummary
from rich import get_console
from typing_extensions import override

__all__ = ["RunSummary"]


class RunSummary(RichModelSummary):
    """``RichModelSummary`` that leaves out the FLOP count where none was made; the run's default."""

    @staticmethod
    @override
    def summarize(*args: Any, total_flops: int = 0, **kwargs: Any) -> None:
        if total_flops:
            RichModelSummary.summarize(*args, total_flops=total_flops, **kwargs)  # type: ignore[misc]  # see below
            return
        console = get_console()
        with console.capture() as captured:  # (args: Lightning's positional ones, which end before total_flops)
            RichModelSummary.summarize(*args, total_flops=total_flops, **kwargs)  # type: ignore[misc]
        kept = [line for line in captured.get().splitlines(keepends=True) if "Total FLOPs" not in line]
        console.file.write("".join(kept))
