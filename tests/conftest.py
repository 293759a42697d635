"""Shared fixtures: the repository root, a CLI runner in a subprocess, a tiny CIFAR-10 on disk."""

import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
SMOKE = str(REPO / "configs" / "smoke.yaml")
DEFAULT_CONFIG = REPO / "configs" / "default.yaml"

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


# What a process prints when gloo's threads outlive the interpreter (multigpu.run.process_groups): a child
# rank's abort leaves the launching process's exit status at 0, so the output is checked as well.
ABORTED_AT_EXIT = "terminate called without an active exception"


def run_cli(*args: str, cwd: Path = REPO, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python main.py ARGS`` in a subprocess and return it (output in ``.stdout``)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    result = subprocess.run(
        [sys.executable, str(REPO / "main.py"), *args],
        cwd=cwd,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    assert ABORTED_AT_EXIT not in result.stdout, result.stdout
    return result


@pytest.fixture(scope="session")
def train_setup(tmp_path_factory):
    """``train_setup(name)`` runs ``tests/strategy_training.py NAME`` in a subprocess, once per
    session, and returns the trained state dict."""
    folder = tmp_path_factory.mktemp("strategy_training")
    trained: dict[str, dict] = {}

    def train(setup: str) -> dict:
        if setup not in trained:
            out = folder / f"{setup}.pt"
            result = subprocess.run(
                [sys.executable, str(REPO / "tests" / "strategy_training.py"), setup, str(out)],
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert result.returncode == 0 and ABORTED_AT_EXIT not in result.stderr, result.stdout + result.stderr
            trained[setup] = torch.load(out)
            out.unlink()  # ResNet-50 state dicts: keep them in memory, not on the disk
        return trained[setup]

    return train


def cli_main(*args: str) -> None:
    """Run the CLI in this process, with configs/default.yaml read first as main.py does."""
    from multigpu.cli.commands import main

    main(list(args), default_config_files=[DEFAULT_CONFIG])


def cli_error(capsys, *args: str) -> str:
    """Run ``fit`` with the smoke config and ARGS in this process; return its one ``error:`` line."""
    with pytest.raises(SystemExit) as exit_info:
        cli_main("fit", "--config", SMOKE, *args)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


# Subprocesses find the test-only callbacks of tests/helpers.py by class path with this.
HELPERS_ENV = {"PYTHONPATH": str(Path(__file__).parent)}


def helper_callback(folder: Path, name: str, **init_args) -> str:
    """Write a config that adds the callback ``helpers.<name>(**init_args)``; return its path."""
    lines = ["trainer:", "  callbacks:", f"    - class_path: helpers.{name}", "      init_args:"]
    lines += [f"        {key}: {value}" for key, value in init_args.items() if value is not None]
    path = folder / f"{name}{len(list(folder.glob(f'{name}*.yaml')))}.yaml"  # a new file per call
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, for a rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_args(tmp_path: Path, run_name: str = "test") -> list[str]:
    """Arguments that keep a run's checkpoints and logs inside ``tmp_path``, and give the network the
    ImageNet stem, which trains about 16 times faster than the CIFAR stem on 32x32 images (the
    network's tests cover both; a test that needs the CIFAR stem passes ``--model.stem=cifar`` after these)."""
    return [
        f"--run_name={run_name}",
        f"--checkpoint_root={tmp_path / 'checkpoints'}",
        f"--trainer.default_root_dir={tmp_path / 'logs'}",
        "--model.stem=imagenet",
    ]


def write_cifar10_files(
    root: Path, train: np.ndarray, train_labels: list[int], test: np.ndarray, test_labels: list[int]
) -> Path:
    """Write CIFAR-10's official python layout under ``root``: uint8 images (N, 3, 32, 32), split into 5 training
    files, and the test file."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    parts = np.array_split(np.arange(len(train)), 5)
    batches = [(f"data_batch_{i}", train[part], [train_labels[j] for j in part]) for i, part in enumerate(parts, 1)]
    for name, images, labels in [*batches, ("test_batch", test, test_labels)]:
        entry = {"batch_label": name, "labels": list(labels), "data": images.reshape(len(images), 3072)}
        with open(folder / name, "wb") as file:
            pickle.dump(entry, file, protocol=4)
    with open(folder / "batches.meta", "wb") as file:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)], "num_vis": 3072}, file, protocol=4)
    return root


def write_tiny_cifar10(root: Path, per_batch: int = 20, test: int = 20) -> Path:
    """Write a CIFAR-10 in the official python layout with ``per_batch`` random images per training file."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (5 * per_batch + test, 3, 32, 32), dtype=np.uint8)
    labels = rng.integers(0, 10, len(images)).tolist()
    return write_cifar10_files(root, images[:-test], labels[:-test], images[-test:], labels[-test:])


@pytest.fixture
def tiny_cifar10(tmp_path: Path) -> Path:
    return write_tiny_cifar10(tmp_path / "cifar")
