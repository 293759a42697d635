"""Checkpoints that survive kills: atomic files, a last.ckpt every N steps, a reported change of layout."""

import logging

import pytest
import torch

from conftest import SMOKE, cli_main, run_args
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
