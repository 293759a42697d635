"""The machine a benchmark ran on, as each benchmark's JSON records it and the docs quote it."""

import platform
from pathlib import Path

import torch

from multigpu.timing.busy_cores import cores


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model as the kernel names it ("AMD EPYC", "Intel(R) Xeon(R) ..."), or what ``platform`` says where
    ``/proc/cpuinfo`` does not name it (not Linux; most ARM kernels; often only the architecture): two 2-core
    machines compute at paces a third apart, so the docs say which."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except (OSError, ValueError):  # unreadable, or not text
        pass
    return platform.processor()


def this_cpu(model: str | None = None) -> str:
    """This CPU in words: ``CPU (its model), N cores``."""
    model = cpu_model() if model is None else model
    return f"CPU ({model}), {cores()} cores" if model else f"CPU, {cores()} cores"


def machine(device: str | None = None) -> dict:
    """The device (default: this CPU, its model named), its cores, torch's and Python's versions."""
    return {
        "device": device or this_cpu(),
        "cores": cores(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def in_words(described: dict) -> str:
    """``machine()``'s record in one phrase."""
    return f"{described['device']}, torch {described['torch']}, Python {described['python']}"
