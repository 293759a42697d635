"""The end of the process groups of the ranks that ``multiprocessing`` starts (``ddp_spawn``'s, ``ddp_fork``'s): they
run only the Trainer's function and never return to ``multigpu.commands.main``, which ends the groups of every other
process. Without it a rank of ``ddp_spawn`` aborted at exit after a run that succeeded, 1 run in 12 on torch 2.11
(docs/measurements.md, "Process groups")."""

from multiprocessing import parent_process

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from multigpu.run.process_groups import end_process_groups

__all__ = ["EndSpawnedProcessGroups"]


class EndSpawnedProcessGroups(Callback):
    """Ends the process groups of a rank that ``multiprocessing`` started (``ddp_spawn``'s, ``ddp_fork``'s) once its
    Trainer has finished (``teardown``, after every collective of ``on_fit_end``); every rank of such a run is one, so
    they meet at the barrier together. The others end theirs in ``multigpu.commands.main``."""

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if parent_process() is not None:
            end_process_groups()
