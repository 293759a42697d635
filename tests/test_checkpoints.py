"""Checkpoints load back under each precision, and bad ones are refused with one line."""

import gc
import logging
import os
from pathlib import Path
from unittest.mock import MagicMock

import pytest
import torch
from helpers import SMOKE, cli_main, run_args
from lightning.pytorch import Trainer

from multigpu.checkpointing.checkpoint_io import AtomicCheckpointIO
from multigpu.checkpointing.files import check_checkpoint, check_model_options, resolve_ckpt_path
from multigpu.data.datamodule import ImageDataModule
from multigpu.errors import UsageError
from multigpu.model.architectures import shaped_by_image_size
from multigpu.model.classifier import ImageClassifier
from multigpu.run.throughput import ThroughputSummary

pytestmark = pytest.mark.internals  # CI runs these on the lowest torch we declare too


def _fit(tmp_path, precision: str, ckpt_path=None, max_steps: int = 2) -> Trainer:
    data = ImageDataModule(synthetic=True, synthetic_size=16, batch_size=4, num_workers=0)
    model = ImageClassifier(batch_size=4, warmup_epochs=0)
    trainer = Trainer(
        accelerator="cpu",
        precision=precision,
        max_steps=max_steps,
        limit_val_batches=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_checkpoint_loads_back_and_resumes(precision, tmp_path):
    trainer = _fit(tmp_path, precision)
    path = tmp_path / "saved.ckpt"
    trainer.save_checkpoint(path)
    loaded = ImageClassifier.load_from_checkpoint(path)
    torch.testing.assert_close(loaded.state_dict(), trainer.lightning_module.state_dict())
    assert check_checkpoint(path)["global_step"] == 2
    resumed = _fit(tmp_path, precision, ckpt_path=str(path), max_steps=3)
    assert resumed.global_step == 3


def test_unreadable_and_foreign_checkpoints_are_refused(tmp_path):
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(UsageError, match="cannot be read .*truncated or not a PyTorch checkpoint"):
        check_checkpoint(garbage)
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"weights": torch.zeros(1)}, foreign)
    with pytest.raises(UsageError, match="not a Lightning training checkpoint"):
        check_checkpoint(foreign)
    with pytest.raises(UsageError, match="does not exist"):
        check_checkpoint(tmp_path / "missing.ckpt")


def test_last_is_the_runs_own_last_checkpoint_never_a_newer_sibling(tmp_path):
    trainer = _fit(tmp_path, "32-true", max_steps=1)
    own, sibling = tmp_path / "last.ckpt", tmp_path / "last-v1.ckpt"
    trainer.save_checkpoint(own)
    trainer.save_checkpoint(sibling)
    os.utime(own, (1, 1))
    assert resolve_ckpt_path("last", tmp_path)[0] == str(own)
    assert resolve_ckpt_path("last", tmp_path / "empty") == (None, {})
    own.unlink()
    assert resolve_ckpt_path("last", tmp_path) == (None, {})  # a sibling alone is not the run's


def test_a_checkpoint_older_than_a_rename_reads_its_options_under_the_new_names(caplog):
    """A checkpoint saved ``activation_checkpointing``, the old name of ``recompute_activations``."""
    old = {"hyper_parameters": {"activation_checkpointing": True, "stem": "cifar"}}
    with caplog.at_level(logging.INFO):
        check_model_options("old.ckpt", old, {"recompute_activations": True, "stem": "cifar"})
        assert "changed" not in caplog.text
        check_model_options("old.ckpt", old, {"recompute_activations": False, "stem": "cifar"})
    assert "Model options changed since old.ckpt: recompute_activations True -> False." in caplog.text


def test_an_image_size_that_shapes_the_network_is_checked_on_resume_and_one_that_does_not_is_free():
    """A ViT's position embedding is built for its image size: another one is refused in one line that says what to
    give; a ResNet takes any size, and so another ``--data.image_size`` goes on (the CLI leaves it out of the
    network's options: ``saved_options._network_options``)."""
    vit = {"hyper_parameters": {"arch": "vit_b_16", "image_size": 64}}
    with pytest.raises(
        UsageError, match=r"another network \(image_size 64, not 32\): use it with --data.image_size=64"
    ):
        check_model_options("vit.ckpt", vit, {"arch": "vit_b_16", "image_size": 32})
    assert shaped_by_image_size("vit_b_16") and not shaped_by_image_size("resnet50")


def test_checkpointing_off_trains_without_writing_any_and_says_it_cannot_resume(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        cli_main("fit", "--config", SMOKE, *run_args(tmp_path), "--trainer.enable_checkpointing=false")
    assert "Checkpoints are off (--trainer.enable_checkpointing=false): this run cannot be resumed." in caplog.text
    assert not (tmp_path / "checkpoints").exists()


def test_a_resumed_run_reads_its_checkpoint_once(tmp_path, monkeypatch):
    """The CLI reads ``--ckpt_path`` before anything is built; Lightning's restore gets that read, not a second one:
    with the run's own checkpoint plugin, and with the user's plugin of its class (``--trainer.plugins``)."""
    cli_main("fit", "--config", SMOKE, *run_args(tmp_path), "--trainer.max_steps=2")
    last = tmp_path / "checkpoints" / "test" / "last.ckpt"
    reads, load = [], torch.load

    def counted(source, *args, **kwargs):
        opened = getattr(source, "path", getattr(source, "name", None))  # the file Lightning opened
        reads.append(Path(source if isinstance(source, str | os.PathLike) else opened).resolve() == last.resolve())
        return load(source, *args, **kwargs)

    monkeypatch.setattr(torch, "load", counted)
    own_plugin = tmp_path / "plugin.yaml"
    own_plugin.write_text(
        "trainer:\n  plugins:\n    - class_path: multigpu.checkpointing.checkpoint_io.AtomicCheckpointIO\n"
        "      init_args:\n        background: false\n"
    )
    for steps, plugins in ((3, []), (4, ["--config", str(own_plugin)])):
        reads.clear()
        cli_main(
            "fit", "--config", SMOKE, *run_args(tmp_path), f"--trainer.max_steps={steps}", "--ckpt_path=last", *plugins
        )
        assert sum(reads) == 1, plugins
        assert check_checkpoint(last)["global_step"] == steps


def test_the_checkpoint_handed_over_leaves_its_file_unmapped_once_restored(tmp_path):
    """The CLI's read maps the file; what the restore gets is the run's own memory, so that a CPU optimizer's state
    does not keep the file (and its disk space, once the next save replaces it) for the whole run."""
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"w": torch.ones(4)}, "global_step": 1, "epoch": 0}, path)
    checkpoint_io = AtomicCheckpointIO(background=False)
    checkpoint_io.hand_over(path, check_checkpoint(path))
    restored = checkpoint_io.load_checkpoint(path)
    gc.collect()
    assert str(path) not in Path("/proc/self/maps").read_text()
    torch.testing.assert_close(restored["state_dict"], {"w": torch.ones(4)})


def test_an_epoch_resumed_after_its_last_batch_logs_no_throughput_point():
    """Lightning ends such an epoch without a batch: no 0 img/s point, no epoch line."""
    summary, module = ThroughputSummary(), MagicMock()
    summary.on_train_start(MagicMock(), module)
    summary.on_train_epoch_end(MagicMock(), module)
    assert not module.log.called and not module.print.called
