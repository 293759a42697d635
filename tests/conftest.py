"""Shared fixtures: a clean process state after each test, a CUDA marker, strategies trained once per session, a
tiny CIFAR-10 on disk. What tests import lives in ``helpers``."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from filelock import FileLock
from helpers import ABORTED_AT_EXIT, REPO, write_tiny_cifar10

# Under pytest-xdist (`pytest -n 2`, the README's command), two tests share the machine's cores: every process
# of a worker computes on one thread, so that no thread pool spins waiting for a core the other test holds.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_configure(config):
    config.addinivalue_line("markers", "min_cuda_gpus(n): runs only where at least n CUDA devices are visible")
    config.addinivalue_line(
        "markers",
        "internals: relies on torch's or Lightning's internals; CI runs these on the lowest torch we declare too",
    )
    config.addinivalue_line("markers", "slow: launches training processes; `pytest -m 'not slow'` is the quick loop")


def pytest_runtest_setup(item):
    marker = item.get_closest_marker("min_cuda_gpus")
    if marker and torch.cuda.device_count() < marker.args[0]:
        pytest.skip(f"needs {marker.args[0]} CUDA device(s), {torch.cuda.device_count()} visible")


@pytest.fixture(autouse=True)
def _clean_process_state(monkeypatch):
    """In-process CLI runs see no pytest arguments; no process group or launcher variable outlives a test.

    Lightning's launcher leaves MASTER_PORT, LOCAL_RANK, WORLD_SIZE... in os.environ even for one
    process, and a later subprocess that inherits LOCAL_RANK would wait for ranks that never come.
    """
    monkeypatch.setattr(sys, "argv", ["main.py"])
    environ = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(environ)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def train_setup(tmp_path_factory):
    """``train_setup(name)`` runs ``tests/strategy_training.py`` for setup ``name`` and the others of its launch (those
    of its process count, ``strategy_training.LAUNCHES``) in a subprocess, once per session, and returns the trained
    state dict. The workers of ``pytest -n`` share what one of them trained, through a folder of the session's that
    they all see, until the one that trained it ends (then another would train it again)."""
    from strategy_training import launch_of

    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "strategy_training"
    folder.mkdir(exist_ok=True)
    trained: dict[str, dict] = {}
    written: list[Path] = []

    def train(setup: str) -> dict:
        if setup not in trained:
            launch = launch_of(setup)
            with FileLock(folder / f"{launch[0]}.lock"):  # a worker asking for a setup of this launch waits
                missing = [name for name in launch if not (folder / f"{name}.pt").exists()]
                if setup in missing:
                    result = subprocess.run(
                        [sys.executable, str(REPO / "tests" / "strategy_training.py"), ",".join(missing), str(folder)],
                        capture_output=True,
                        text=True,
                        timeout=900,
                    )
                    outs = [folder / f"{name}.pt" for name in missing]
                    if result.returncode != 0 or ABORTED_AT_EXIT in result.stderr:
                        for out in outs:
                            out.unlink(missing_ok=True)
                        pytest.fail(result.stdout + result.stderr)
                    written.extend(outs)
                trained[setup] = torch.load(folder / f"{setup}.pt")
        return trained[setup]

    train.folder = folder  # where each setup's files are (strategy_training.py writes records beside it)
    yield train
    for out in written:  # ResNet-50 state dicts, 100 MB each
        with FileLock(folder / f"{launch_of(out.stem)[0]}.lock"):
            out.unlink()


@pytest.fixture
def tiny_cifar10(tmp_path: Path) -> Path:
    return write_tiny_cifar10(tmp_path / "cifar")
