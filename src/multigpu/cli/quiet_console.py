"""What Lightning and its dependencies print that says nothing about this run, kept off the console: a clean run
prints the project's lines, Lightning's device line, the model summary and the progress bar."""

import logging
import warnings

__all__ = ["quiet_console"]

# Lightning's info lines that are advertisements or internals, not facts about this run.
_LIGHTNING_LINES = (
    "💡 Tip:",  # litlogger and litmodels
    "TPU available:",
    "Loading `train_dataloader` to estimate number of stepping batches.",
)

_WARNINGS = (
    # Lightning's own use of a torch name that torch deprecated; nothing a user can change.
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    # A loader without state of its own resumes mid-epoch unreliably, Lightning warns; the data module's state
    # makes the resumed epoch skip exactly the batches the checkpoint trained on.
    "You're resuming from a checkpoint that ended before the epoch ended",
    # A resumed run writes into its own folder; starting a new run in a folder that holds checkpoints is refused
    # before this could be said (``refuse_a_second_run``).
    r"Checkpoint directory .* exists and is not empty",
    # FSDP2 warns of a wrapped block that returns a view, since an in-place op on it would skip a gather. Our
    # BottleneckEntry returns its input for the shortcut, which FSDP2's own hook has made a view; BottleneckExit uses
    # it out of place only (``out + identity``, the downsampling); torchvision's blocks (``FSDPSequential``, ...)
    # return views of the same kind. Every family of networks trains under fsdp as on one device
    # (test_networks.py, test_fsdp.py), so no such view is written in place.
    r"FSDP2-wrapped module \(FSDP\w+\) returned a view tensor",
)


# Lightning's lines as it sets up a process group, where the group has one process (manual_model_parallel without
# replicas): nothing distributed happens.
_ONE_PROCESS_LINES = ("Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/1", "Starting with 1 processes")


def _keeps_seed(record: logging.LogRecord) -> bool:
    """Lightning's ``Seed set to N``, which came before every error line: the seed is in the run's config.yaml and
    its checkpoints."""
    return "Seed set to" not in str(record.msg)  # "[rank: R] Seed set to N" in the processes of a launcher


def _keeps(record: logging.LogRecord) -> bool:
    message = str(record.msg)
    return not message.startswith(_LIGHTNING_LINES) and not any(line in message for line in _ONE_PROCESS_LINES)


def quiet_console() -> None:
    """Filter Lightning's lines and the warnings above out of this process's console, for the rest of it."""
    for name in (
        "lightning.pytorch.utilities.rank_zero",
        "lightning.fabric.utilities.rank_zero",
        "lightning.fabric.utilities.distributed",
    ):
        logging.getLogger(name).addFilter(_keeps)
    logging.getLogger("lightning.fabric.utilities.seed").addFilter(_keeps_seed)
    for message in _WARNINGS:
        warnings.filterwarnings("ignore", message=f".*{message}")
