"""``main.py``'s commands: ``plan``, ``export``, or one of the training CLI's, each with the same error handling.

The entry point stands above everything it sends a command to: ``plan`` (``multigpu.planning``) and the others
(``multigpu.cli``) both build on ``multigpu.cli.lightning_cli``.
"""

import difflib
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

from multigpu.checkpointing.elastic import separate_restart_attempts
from multigpu.cli.export_command import export
from multigpu.cli.lightning_cli import MultiGPUCLI
from multigpu.cli.quiet_console import quiet_console
from multigpu.errors import JobFailed, RunFinished, UsageError
from multigpu.planning.command import plan
from multigpu.run.process_groups import end_process_groups

__all__ = ["COMMANDS", "main"]

COMMANDS = {
    "fit": "train a run, or resume it with --ckpt_path last",
    "validate": "evaluate a checkpoint on the validation split",
    "test": "evaluate a checkpoint on the test split",
    "predict": "write a checkpoint's classes and probabilities of images to predictions.csv",
    "plan": "forecast every layout of these devices, measure the fastest and write it as a config for fit",
    "export": "write a checkpoint's network for torchvision, TorchScript or ONNX",
}


def _usage() -> str:
    lines = ["usage: python main.py COMMAND [OPTIONS]   (python main.py COMMAND --help: its options)", "", "commands:"]
    return "\n".join([*lines, *(f"  {name:<10}{what}" for name, what in COMMANDS.items())])


def _check_command(argv: Sequence[str]) -> None:
    """Refuse a first argument that is neither a command nor an option, naming the nearest command."""
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        near = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        raise UsageError(
            f"{argv[0]} is not a command{hint}: python main.py {' | '.join(COMMANDS)}; python main.py --help says "
            "what each does."
        )


def _exit_after_a_failure() -> None:
    """Exit with status 1 once a failure is reported. Among several processes, at once: the others are being ended,
    or wait in a collective, so no process group ends cleanly, and gloo's threads would abort the interpreter as it
    ends (run/process_groups.py)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.exit(1)


def main(args: list[str] | None = None, default_config_files: Sequence[str | Path] = ()) -> None:
    """Run ``main.py``'s command: ``plan`` (``multigpu.planning``), ``export`` (``multigpu.cli.export_command``), or
    one of LightningCLI's (``fit``, ``validate``, ``test``, ``predict``); a bad request ends with one ``error: ...``
    line and exit status 2."""
    separate_restart_attempts()
    quiet_console()
    argv = sys.argv[1:] if args is None else list(args)
    if argv in ([], ["-h"], ["--help"]):
        print(_usage())
        return
    try:
        _check_command(argv)
        if argv[:1] == ["plan"]:
            plan(argv[1:], default_config_files)
        elif argv[:1] == ["export"]:
            export(argv[1:], default_config_files)
        else:
            MultiGPUCLI(default_config_files=default_config_files, args=args)
    except SIGTERMException:  # every process stopped after the same step: they end their groups together
        end_process_groups()
        raise
    except RunFinished as finished:
        rank_zero_info(str(finished))
    except JobFailed as failure:
        if not failure.printed:
            print(f"error: {' '.join(str(failure).split())}", file=sys.stderr, flush=True)
        _exit_after_a_failure()
    except (UsageError, MisconfigurationException) as error:
        message = " ".join(str(error).split())  # one line, whatever the message's own layout
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)
    except Exception as error:
        if not getattr(error, "printed", False):  # printed as the other processes were ended (StopAllProcessesOnError)
            raise
        _exit_after_a_failure()
    end_process_groups()
