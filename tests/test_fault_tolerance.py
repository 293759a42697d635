"""Checkpoints that survive kills: atomic files, a last.ckpt every N steps, a reported change of layout."""

import logging
import signal
import time
from pathlib import Path

import pytest
import torch

from conftest import SMOKE, cli_main, run_args, run_cli
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


def _final_state(tmp_path, run_name: str) -> dict:
    return torch.load(tmp_path / "checkpoints" / run_name / "last.ckpt", weights_only=False)


@pytest.mark.parametrize(
    ("kills", "name"),
    [
        ([(7, "step")], "mid-epoch"),
        ([(6, "step"), (31, "step")], "right after a save, twice"),
        ([(8, "save")], "during a save"),
        ([(9, "sigterm")], "SIGTERM"),
    ],
)
def test_killed_and_resumed_run_ends_bit_for_bit_like_an_uninterrupted_one(kills, name, tmp_path, tiny_cifar10):
    """A SIGKILL at any point, then `--ckpt_path last`, gives the parameters of a run never killed.

    Real CIFAR files and augmentations (random crops and flips), shuffled, 25 steps per epoch, 2 epochs;
    last.ckpt every 2 steps.
    """
    _kill_resume_and_compare(tmp_path, tiny_cifar10, kills, name, [], total_steps=50)


def test_killed_ddp_run_resumes_bit_for_bit(tmp_path, tiny_cifar10):
    """The same with 2 DDP processes (12 steps per epoch each), both killed in the middle of an epoch."""
    ddp = ["--trainer.strategy=ddp", "--trainer.accelerator=cpu", "--trainer.devices=2"]
    _kill_resume_and_compare(tmp_path, tiny_cifar10, [(17, "step")], "DDP mid-epoch", ddp, total_steps=24)


def test_killed_pipeline_run_resumes_bit_for_bit(tmp_path, tiny_cifar10):
    """2 pipeline stages (12 steps per epoch, 4 micro-batches of 2), both killed in the middle of an epoch."""
    pipeline = ["--trainer.strategy=pipeline", "--trainer.accelerator=cpu", "--trainer.devices=2", "--data.batch_size=8"]
    _kill_resume_and_compare(tmp_path, tiny_cifar10, [(17, "step")], "pipeline mid-epoch", pipeline, total_steps=24)


def _kill_resume_and_compare(tmp_path, cifar, kills, name, extra, total_steps):
    args = [*_resumable_run(cifar), *extra]
    reference = run_cli(*args, *run_args(tmp_path, "reference"))
    assert reference.returncode == 0, reference.stdout
    env = {"PYTHONPATH": str(Path(__file__).parent)}
    for step, moment in kills:
        kill = tmp_path / f"kill{step}.yaml"
        kill.write_text(
            "trainer:\n  callbacks:\n    - class_path: helpers.KillAt\n"
            f"      init_args:\n        step: {step}\n        moment: {moment}\n"
        )
        killed = run_cli(*args, "--config", str(kill), *run_args(tmp_path, "killed"), "--ckpt_path=last", env=env)
        if moment == "sigterm":  # saves the step it finished, then exits cleanly
            assert killed.returncode == 0 and "Received SIGTERM: saved" in killed.stdout, killed.stdout
            assert _final_state(tmp_path, "killed")["global_step"] == step + 1
        else:
            assert killed.returncode == -signal.SIGKILL, killed.stdout
    resumed = run_cli(*args, *run_args(tmp_path, "killed"), "--ckpt_path=last")
    assert resumed.returncode == 0 and "Restored all states" in resumed.stdout, resumed.stdout
    expected, final = _final_state(tmp_path, "reference"), _final_state(tmp_path, "killed")
    assert final["global_step"] == expected["global_step"] == total_steps
    for key, tensor in expected["state_dict"].items():
        assert torch.equal(final["state_dict"][key], tensor), f"{name}: {key}"


@pytest.mark.parametrize("rank", [1, 0])
def test_a_failing_rank_ends_the_whole_job_quickly_with_its_error(rank, tmp_path):
    fail = tmp_path / "fail.yaml"
    fail.write_text(
        f"trainer:\n  callbacks:\n    - class_path: helpers.FailOnRank\n      init_args:\n        rank: {rank}\n        step: 2\n"
    )
    start = time.monotonic()
    result = run_cli(
        "fit", "--config", SMOKE, "--config", str(fail), "--trainer.accelerator=cpu", "--trainer.devices=2",
        "--trainer.strategy=ddp", "--data.synthetic_size=64", *run_args(tmp_path),
        env={"PYTHONPATH": str(Path(__file__).parent)}, timeout=120,
    )
    assert result.returncode != 0
    assert time.monotonic() - start < 60
    assert f"RuntimeError: rank {rank} failed on purpose at step 2" in result.stdout
