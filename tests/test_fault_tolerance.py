"""Checkpoints that survive kills: atomic files, a last.ckpt every N steps, a reported change of layout."""

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import HELPERS_ENV, REPO, SMOKE, cli_main, free_port, helper_callback, run_args, run_cli, write_tiny_cifar10
from multigpu.checkpoint_io import AtomicCheckpointIO


def test_an_interrupted_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "run" / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": torch.tensor(1)}, path)

    def killed_midway(obj, file, *args, **kwargs):
        file.write(b"half a checkpoint")
        raise KeyboardInterrupt  # as a kill would stop the write

    monkeypatch.setattr(torch, "save", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"step": torch.tensor(2)}, path)
    monkeypatch.undo()
    assert torch.load(path)["step"] == 1
    assert [file.name for file in path.parent.iterdir()] == ["last.ckpt"]  # no temporary file left


def test_last_checkpoint_every_n_steps_and_at_each_epoch_end(tmp_path):
    args = ["fit", "--config", SMOKE, *run_args(tmp_path), "--save_every_n_steps=3"]
    folder = tmp_path / "checkpoints" / "test"
    cli_main(*args, "--trainer.max_steps=3")  # stops in the middle of the 4-step epoch
    assert torch.load(folder / "last.ckpt", weights_only=False)["global_step"] == 3
    cli_main(*args, "--ckpt_path=last", "--trainer.max_epochs=2")  # epoch ends at steps 4 and 8
    last = torch.load(folder / "last.ckpt", weights_only=False)
    assert last["global_step"] == 8 and last["epoch"] == 1
    assert sorted(path.name for path in folder.glob("last*")) == ["last.ckpt"]  # one file, rewritten


def test_resuming_with_another_layout_says_what_changed(tmp_path, caplog):
    args = ["fit", "--config", SMOKE, *run_args(tmp_path)]
    cli_main(*args)
    with caplog.at_level(logging.INFO):
        cli_main(*args, "--ckpt_path=last", "--trainer.max_epochs=2", "--trainer.strategy=manual_model_parallel",
                 "--trainer.devices=2")
    assert (
        "Resuming with another layout (strategy SingleDeviceStrategy -> ManualModelParallelStrategy): "
        "the global batch stays 8." in caplog.text
    )
    caplog.clear()
    with caplog.at_level(logging.INFO):
        cli_main(*args, "--ckpt_path=last", "--trainer.max_epochs=3", "--data.batch_size=4")
    assert (
        "Resuming with another layout (strategy ManualModelParallelStrategy -> SingleDeviceStrategy): "
        "the global batch changes 8 -> 4, and the learning rate keeps the checkpoint's scaling." in caplog.text
    )


def _resumable_run(cifar: Path) -> list[str]:
    """2 epochs on the tiny CIFAR files with their random augmentations, last.ckpt every 2 steps."""
    data = [f"--data.data_dir={cifar}", "--data.synthetic=false", "--data.download=false",
            "--data.verify_checksums=false", "--data.batch_size=4", "--model.stem=imagenet"]
    return ["fit", "--config", SMOKE, *data, "--save_every_n_steps=2", "--trainer.max_epochs=2"]


DDP = ["--trainer.strategy=ddp", "--trainer.accelerator=cpu", "--trainer.devices=2"]
PIPELINE = ["--trainer.strategy=pipeline", "--trainer.accelerator=cpu", "--trainer.devices=2", "--data.batch_size=8"]


def _final_state(tmp_path, run_name: str) -> dict:
    return torch.load(tmp_path / "checkpoints" / run_name / "last.ckpt", weights_only=False)


def _kill_config(tmp_path: Path, step: int, moment: str = "step", rank: int | None = None) -> str:
    return helper_callback(tmp_path, "KillAt", step=step, moment=moment, rank=rank)


@pytest.fixture(scope="module")
def resumable(tmp_path_factory):
    """The tiny CIFAR, and ``reference(extra)``: the final checkpoint of ``_resumable_run`` with the
    arguments ``extra``, never interrupted; each one is trained once per module."""
    root = tmp_path_factory.mktemp("resumable")
    cifar = write_tiny_cifar10(root / "cifar", per_batch=8)  # 40 training images
    finals: dict[tuple[str, ...], dict] = {}

    def reference(extra: list[str]) -> dict:
        if tuple(extra) not in finals:
            name = f"reference{len(finals)}"
            result = run_cli(*_resumable_run(cifar), *extra, *run_args(root, name))
            assert result.returncode == 0, result.stdout
            finals[tuple(extra)] = _final_state(root, name)
        return finals[tuple(extra)]

    reference.cifar = cifar
    return reference


def _assert_same_parameters(final: dict, expected: dict, total_steps: int, name: str) -> None:
    assert final["global_step"] == expected["global_step"] == total_steps
    for key, tensor in expected["state_dict"].items():
        assert torch.equal(final["state_dict"][key], tensor), f"{name}: {key}"


def test_killed_and_resumed_run_ends_bit_for_bit_like_an_uninterrupted_one(tmp_path, resumable):
    """SIGKILLs at several points, each followed by `--ckpt_path last`, give the parameters of a run never killed.

    Real CIFAR files and augmentations (random crops and flips), shuffled, 10 steps per epoch, 2 epochs;
    last.ckpt every 2 steps. One run is killed again and again, each time resumed from what the kill left.
    """
    kills = [
        (3, "step", "mid-epoch"),
        (6, "step", "right after a save"),
        (8, "save", "during a save"),
        (13, "step", "in the second epoch"),
        (15, "sigterm", "SIGTERM"),
    ]
    _kill_resume_and_compare(tmp_path, resumable, kills, [], total_steps=20)


def test_killed_ddp_run_resumes_bit_for_bit(tmp_path, resumable):
    """The same with 2 DDP processes (5 steps per epoch each), both killed in the middle of the second epoch."""
    _kill_resume_and_compare(tmp_path, resumable, [(7, "step", "DDP mid-epoch")], DDP, total_steps=10)


def test_killed_pipeline_run_resumes_bit_for_bit(tmp_path, resumable):
    """2 pipeline stages (5 steps per epoch, 4 micro-batches of 2), both killed in the middle of the second epoch."""
    _kill_resume_and_compare(tmp_path, resumable, [(7, "step", "pipeline mid-epoch")], PIPELINE, total_steps=10)


def test_sigterm_to_one_ddp_process_stops_both_after_the_same_step(tmp_path, resumable):
    """Only rank 1 gets SIGTERM (at step 7): both processes stop after step 8 and exit cleanly,
    rather than one waiting for the other in a collective; the run then resumes bit for bit."""
    args = [*_resumable_run(resumable.cifar), *DDP, *run_args(tmp_path, "killed"), "--ckpt_path=last"]
    stopped = run_cli(*args, "--config", _kill_config(tmp_path, 7, "sigterm", rank=1), env=HELPERS_ENV, timeout=180)
    assert stopped.returncode == 0 and "Received SIGTERM: saved" in stopped.stdout, stopped.stdout
    assert _final_state(tmp_path, "killed")["global_step"] == 8
    resumed = run_cli(*args)
    assert resumed.returncode == 0 and "Restored all states" in resumed.stdout, resumed.stdout
    _assert_same_parameters(_final_state(tmp_path, "killed"), resumable(DDP), 10, "SIGTERM to rank 1")


def _kill_resume_and_compare(tmp_path, resumable, kills, extra, total_steps):
    args = [*_resumable_run(resumable.cifar), *extra]
    for step, moment, name in kills:
        kill = _kill_config(tmp_path, step, moment)
        killed = run_cli(*args, "--config", kill, *run_args(tmp_path, "killed"), "--ckpt_path=last", env=HELPERS_ENV)
        if moment == "sigterm":  # saves the step it finished, then exits cleanly
            assert killed.returncode == 0 and "Received SIGTERM: saved" in killed.stdout, killed.stdout
            assert _final_state(tmp_path, "killed")["global_step"] == step + 1
        else:
            assert killed.returncode == -signal.SIGKILL, f"{name}: {killed.stdout}"
    resumed = run_cli(*args, *run_args(tmp_path, "killed"), "--ckpt_path=last")
    assert resumed.returncode == 0 and "Restored all states" in resumed.stdout, resumed.stdout
    _assert_same_parameters(_final_state(tmp_path, "killed"), resumable(extra), total_steps, kills[-1][2])


def test_torchrun_restarts_resume_from_the_last_checkpoint_on_their_own(tmp_path, resumable):
    """torchrun --max-restarts=1 restarts both DDP processes after a SIGKILL at step 7; the restart,
    the same command with `--ckpt_path last`, resumes and ends bit for bit like an uninterrupted run.

    Static rendezvous on a free port, as the README's command (see its fault tolerance section).
    """
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=1",
                "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(REPO / "main.py")]
    args = [*_resumable_run(resumable.cifar), *DDP, "--ckpt_path=last", "--config", _kill_config(tmp_path, 7)]
    result = subprocess.run(
        [*torchrun, *args, *run_args(tmp_path, "restarted")], cwd=REPO, env={**os.environ, **HELPERS_ENV},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout
    assert "Restored all states" in result.stdout, result.stdout
    _assert_same_parameters(_final_state(tmp_path, "restarted"), resumable(DDP), 10, "torchrun restart")


@pytest.mark.parametrize("rank", [1, 0])
def test_a_failing_rank_ends_the_whole_job_quickly_with_its_error(rank, tmp_path):
    fail = helper_callback(tmp_path, "FailOnRank", rank=rank, step=2)
    start = time.monotonic()
    result = run_cli(
        "fit", "--config", SMOKE, "--config", str(fail), "--trainer.accelerator=cpu", "--trainer.devices=2",
        "--trainer.strategy=ddp", "--data.synthetic_size=64", *run_args(tmp_path),
        env=HELPERS_ENV, timeout=120,
    )
    assert result.returncode != 0
    assert time.monotonic() - start < 60
    assert f"RuntimeError: rank {rank} failed on purpose at step 2" in result.stdout
