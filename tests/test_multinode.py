"""Beyond one machine: two torchrun "nodes" on this machine, and the Slurm batch script under Slurm's variables."""

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import DEFAULT_CONFIG, HELPERS_ENV, REPO, SMOKE, free_port, helper_callback, run_args

from multigpu.cli.lightning_cli import MultiGPUCLI

TESTS = Path(__file__).parent


def _record_config(tmp_path: Path) -> str:
    return helper_callback(tmp_path, "RecordSamples", out_dir=tmp_path / "seen")


def _seen(tmp_path: Path, rank: int) -> list[str]:
    return (tmp_path / "seen" / f"rank{rank}.txt").read_text().split()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "pipeline"])
def test_two_torchrun_nodes_train_together(strategy, tmp_path):
    """`torchrun --nnodes=2 --node-rank=0|1` on 127.0.0.1, one process per "node", gloo.

    Each node keeps its checkpoints on its own disk: only node 0's gets them (rank 0 writes).
    Under ddp the two ranks read different halves of the data; a 2-stage pipeline spans the
    two nodes, and its two stages read the same batches.
    """
    port = free_port()
    nodes = []
    for node in range(2):
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc-per-node=1",
            f"--node-rank={node}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            str(REPO / "main.py"),
            "fit",
            "--config",
            SMOKE,
            "--config",
            _record_config(tmp_path),
            "--trainer.accelerator=cpu",
            "--trainer.num_nodes=2",
            "--trainer.devices=1",
            f"--trainer.strategy={strategy}",
            *run_args(tmp_path / f"node{node}"),
        ]
        nodes.append(
            subprocess.Popen(
                command,
                cwd=REPO,
                env={**os.environ, **HELPERS_ENV},
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    outputs = [node.communicate(timeout=240)[0] for node in nodes]
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output
    assert "TorchElasticEnvironment: 2 process(es) on 2 node(s), started outside Lightning." in outputs[0]
    assert (tmp_path / "node0" / "checkpoints" / "test" / "last.ckpt").exists()
    assert not (tmp_path / "node1" / "checkpoints").exists()
    first, second = _seen(tmp_path, 0), _seen(tmp_path, 1)
    if strategy == "ddp":  # 32 images, 2 steps of 8 per rank
        assert len(first) == len(second) == 16 and not set(first) & set(second)
    else:  # one pipeline: 4 steps of 8 images through both stages
        assert len(first) == 32 and first == second


@pytest.mark.internals  # how Lightning detects torchrun
@pytest.mark.parametrize(("num_nodes", "processes"), [(1, 2), (2, 1), (2, 2)])
def test_under_torchrun_the_node_count_is_torchruns(num_nodes, processes, tmp_path, monkeypatch, caplog):
    """An attempt of an elastic run, on nodes of 1 process: whatever `--trainer.num_nodes` says (the default 1,
    or the node count the run started with), the Trainer takes torchrun's count, and says so when it differs."""
    attempt = {"TORCHELASTIC_RUN_ID": "run1", "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0"}
    for name, value in {**attempt, "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": str(processes)}.items():
        monkeypatch.setenv(name, value)
    args = ["--config", SMOKE, *run_args(tmp_path), "--trainer.accelerator=cpu", "--trainer.devices=1"]
    with caplog.at_level(logging.INFO):
        cli = MultiGPUCLI(
            default_config_files=[DEFAULT_CONFIG], run=False, args=[*args, f"--trainer.num_nodes={num_nodes}"]
        )
    assert cli.trainer.num_nodes == processes and cli.trainer.world_size == processes
    said = f"torchrun started {processes} node(s): --trainer.num_nodes={processes}." in caplog.text
    assert said == (num_nodes != processes)


def _sbatch(tmp_path: Path, *args: str) -> subprocess.Popen:
    """scripts/slurm/train.sbatch as Slurm would run it for 1 node x 2 tasks, with stand-ins for srun and scontrol."""
    env = {
        **os.environ,
        **HELPERS_ENV,
        "PATH": f"{TESTS / 'slurm'}{os.pathsep}{os.environ['PATH']}",
        "SHARED": str(tmp_path / "shared"),
        "SCONTROL_LOG": str(tmp_path / "scontrol.log"),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "resnet50-cifar10",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_NODELIST": "localhost",
        "SLURM_NNODES": "1",
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    command = [
        "bash",
        str(REPO / "scripts" / "slurm" / "train.sbatch"),
        "--config",
        SMOKE,
        "--trainer.accelerator=cpu",
        "--run_name=slurm",
        *args,
    ]
    return subprocess.Popen(command, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _start_and_signal(tmp_path: Path, signal_number: int, *args: str) -> str:
    """Start the batch script, send it ``signal_number`` once training runs; return its output."""
    job = _sbatch(tmp_path, *args, "--config", _record_config(tmp_path))
    seen = tmp_path / "seen" / "rank0.txt"
    deadline = time.monotonic() + 180
    while not (seen.exists() and len(seen.read_text().split()) >= 6) and job.poll() is None:
        assert time.monotonic() < deadline, "the job did not start training"
        time.sleep(0.5)
    job.send_signal(signal_number)
    output = job.communicate(timeout=120)[0]
    assert job.returncode == 0, output
    assert "SLURMEnvironment: 2 process(es) on 1 node(s), started outside Lightning." in output
    assert "Received SIGTERM: saved" in output
    return output


LONG_RUN = ["--data.synthetic_size=100000", "--model.stem=imagenet", "--data.batch_size=2"]


@pytest.mark.slow
def test_sbatch_script_trains_under_slurm_and_requeues_itself_before_the_time_limit(tmp_path):
    """The script's own command, under Slurm's variables: Lightning takes the SLURM environment.

    USR1 (what `--signal=B:USR1@300` sends before the time limit) makes the script stop the
    tasks, which save last.ckpt, and requeue the job; the requeued job resumes and finishes.
    """
    output = _start_and_signal(tmp_path, signal.SIGUSR1, *LONG_RUN)
    assert "time limit near: stopping the tasks" in output
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    last = tmp_path / "shared" / "checkpoints" / "slurm" / "last.ckpt"
    stopped_at = torch.load(last)["global_step"]
    assert stopped_at >= 3

    requeued = _sbatch(tmp_path, *LONG_RUN, f"--trainer.max_steps={stopped_at + 2}")
    output = requeued.communicate(timeout=180)[0]
    assert requeued.returncode == 0 and "Restored all states" in output, output
    assert torch.load(last)["global_step"] == stopped_at + 2
    assert [path.name for path in last.parent.glob("last*")] == ["last.ckpt"]  # one file, rewritten


@pytest.mark.slow
def test_sbatch_script_on_preemption_waits_for_the_checkpoint_and_leaves_the_requeue_to_slurm(tmp_path):
    """SIGTERM to the whole job (pre-emption): the script passes it on and waits; it does not requeue."""
    _start_and_signal(tmp_path, signal.SIGTERM, *LONG_RUN)
    assert not (tmp_path / "scontrol.log").exists()
    assert (tmp_path / "shared" / "checkpoints" / "slurm" / "last.ckpt").exists()
