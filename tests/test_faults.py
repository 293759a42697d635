"""Faults that must end a job of several processes, quickly and by name, and never cost the checkpoint before: a
checkpoint write that fails (a quota, a full disk), on the first process or another, and a process that stalls."""

import contextlib
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import SMOKE, helper_callback, helper_plugin, run_args, run_cli

from multigpu.checkpointing.sharded_checkpoints import read_checkpoint

pytestmark = pytest.mark.slow

TWO_PROCESSES = ["--trainer.accelerator=cpu", "--trainer.devices=2", "--data.synthetic_size=96"]  # 6 steps an epoch


def _fit(tmp_path: Path, *args: str, checkpoint_root: Path | None = None, timeout: int = 180):
    root = ["--checkpoint_root", str(checkpoint_root)] if checkpoint_root else []
    return run_cli("fit", "--config", SMOKE, *TWO_PROCESSES, *run_args(tmp_path), *root, *args, timeout=timeout)


@pytest.mark.parametrize(("strategy", "rank"), [("fsdp", 1), ("ddp", 0)])
def test_a_failed_checkpoint_write_ends_the_job_in_one_line_and_keeps_the_checkpoint_before(strategy, rank, tmp_path):
    """A background write that fails (a full quota) at step 3, under fsdp on the second process (whose shard the first
    would otherwise wait for, for up to 30 minutes) and under ddp on the first: the job ends with status 1 at the next
    step, one line names the process, the file and the error, and last.ckpt still holds step 2, whole."""
    fail = helper_plugin(tmp_path, "FailWrite", rank=rank, step=3)
    result = _fit(tmp_path, f"--trainer.strategy={strategy}", "--save_every_n_steps=1", "--config", fail)
    assert result.returncode == 1, result.stdout
    said = [line for line in result.stdout.splitlines() if line.startswith(f"error: process {rank} could not write")]
    assert said and "Disk quota exceeded" in said[0], result.stdout
    last = tmp_path / "checkpoints" / "test" / "last.ckpt"
    assert read_checkpoint(last)["global_step"] == 2


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MB tmpfs mounted in ``tmp_path`` (CI runs as root); skipped where mounting is not allowed."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield disk
    with contextlib.suppress(Exception):
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_during_fsdp_saves_ends_the_job_naming_the_error_and_the_checkpoint_before_loads(
    tmp_path, small_disk
):
    """fsdp on 2 processes, a sharded save every step, on a disk that fills up as step 3 starts: the job ends with
    status 1, saying the disk is full (not only torch's ``unexpected pos``), and the last checkpoint before loads whole,
    on one process."""
    fill = helper_callback(tmp_path, "FillDiskAt", disk=small_disk, step=3)
    result = _fit(
        tmp_path, "--trainer.strategy=fsdp", "--save_every_n_steps=1", "--config", fill, checkpoint_root=small_disk
    )
    assert result.returncode == 1, result.stdout
    said = [line for line in result.stdout.splitlines() if line.startswith("error: process ")]
    assert said and "No space left on device" in said[0], result.stdout
    (small_disk / "ballast").unlink()
    last = read_checkpoint(small_disk / "test" / "last.ckpt")
    assert 1 <= last["global_step"] <= 3 and all(torch.is_tensor(value) for value in last["state_dict"].values())


def test_a_long_first_step_and_a_long_validation_that_progresses_do_not_trip_the_stall_watch(tmp_path):
    """With --stall_timeout_s=4: a first step of 9 s (as a compiled network's; the watch starts after it), and a
    validation of 2.5 s a batch (each batch is progress) whose last, shorter batch takes 6 s more (as a compiled
    network compiles a shape the one-batch sanity check did not show: such a batch counts as progress until it ends),
    on both processes: the run ends as usual."""
    slow = helper_callback(tmp_path, "SlowSteps", first_s=9, validation_s=2.5, new_shape_s=6)
    sanity = "--trainer.num_sanity_val_steps=1"  # 12 validation images a process: batches of 8 and 4
    result = _fit(tmp_path, "--trainer.strategy=ddp", "--stall_timeout_s=4", sanity, "--config", slow)
    assert result.returncode == 0 and "no process of the job made progress" not in result.stdout, result.stdout


def test_a_stopped_process_ends_the_job_within_the_stall_timeout_and_is_named(tmp_path):
    """The second process of a ddp run is stopped (SIGSTOP, as the system or a hung device would hold it) as step 3
    starts; the first waits for it in the gradients' all-reduce. With --stall_timeout_s=6 the job ends, rather than
    after torch's 30 minutes, with status 1, naming that process and where each stood; no process is left behind
    (``run_cli`` waits for the job's whole process group)."""
    stop = helper_callback(tmp_path, "StopAt", rank=1, step=3)
    result = _fit(tmp_path, "--trainer.strategy=ddp", "--stall_timeout_s=6", "--config", stop, timeout=120)
    assert result.returncode != 0, result.stdout
    assert "process 1 stopped answering" in result.stdout, result.stdout
    assert "Where each process stood" in result.stdout and "process 0 (host" in result.stdout, result.stdout


def test_max_time_stops_every_process_after_the_same_step_without_a_broadcast_per_step(tmp_path):
    """``--trainer.max_time`` under ddp, with steps of a second: Lightning's Timer, which broadcast its decision every
    step, checks at epochs' ends only, and the stop vote carries the time limit: both processes stop after the same
    step, well inside the 12-step epoch, and last.ckpt holds it (the counting test checks no broadcast is left)."""
    slow = helper_callback(tmp_path, "SlowSteps", seconds=1)
    result = _fit(tmp_path, "--trainer.strategy=ddp", "--trainer.max_time=00:00:00:03", "--data.synthetic_size=192",
                  "--config", slow)  # fmt: skip
    assert result.returncode == 0 and "Time limit reached" in result.stdout, result.stdout
    step = torch.load(tmp_path / "checkpoints" / "test" / "last.ckpt", weights_only=True)["global_step"]
    assert 1 <= step < 12, step
