"""The machine a benchmark ran on, as each benchmark's JSON records it and the docs quote it."""

import platform

import torch

from multigpu.planning.profile import cores


def machine(device: str | None = None) -> dict:
    """The device (default: this CPU), its cores, torch's and Python's versions."""
    return {
        "device": device or f"CPU, {cores()} cores",
        "cores": cores(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def in_words(described: dict) -> str:
    """``machine()``'s record in one phrase."""
    return f"{described['device']}, torch {described['torch']}, Python {described['python']}"
