"""Loader workers start from a fork server, never forked from a training process, and end with that process
however it ends (multigpu.data.loader_workers)."""

import os
import subprocess
import sys

import pytest
from helpers import REPO

from multigpu.data.loader_workers import worker_start

TRAINING = """
import os, signal
from torch.utils.data import DataLoader, Dataset
from multigpu.data.loader_workers import worker_start

class Parents(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        return os.getppid()

if __name__ == "__main__":
    loader = DataLoader(Parents(), batch_size=2, num_workers=1, persistent_workers=True, **worker_start(1))
    parent = int(next(iter(loader))[0])
    print(os.getpid(), parent, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer or a lost node would: no clean-up runs
"""


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="Linux: elsewhere the workers are spawned")
def test_a_training_process_killed_leaves_no_loader_worker_and_no_fork_server(tmp_path):
    script = tmp_path / "training.py"
    script.write_text(TRAINING)
    with subprocess.Popen([sys.executable, str(script)], cwd=REPO, stdout=subprocess.PIPE, text=True) as process:
        # The pipe ends only when every process holding it has ended: the training process, its fork server and
        # the worker. A worker outliving its training process would hold it open past the timeout.
        output, _ = process.communicate(timeout=60)
    assert process.returncode == -9
    training, parent = map(int, output.split())
    assert parent != training  # the worker's parent is the fork server


def test_workers_are_spawned_where_pidfds_are_refused(monkeypatch):
    """A kernel before 5.3 or a container's seccomp profile refuses pidfd_open: the workers are then spawned,
    children of the training process that torch's own check watches, not started from a fork server."""

    def refused(pid, flags=0):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", refused, raising=False)
    assert worker_start(2)["multiprocessing_context"] == "spawn"
    assert worker_start(0) == {}
