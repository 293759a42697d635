"""What was written before the renames of issue 80 still works: a run's checkpoint, a run's config file and the old
class names (``ResNet50Classifier``, ``CIFAR10DataModule``).

``tests/data/before_renames/`` holds what the code before them wrote: ``last.ckpt``, two steps of ``configs/smoke.yaml``
with ``tiny_resnet`` (stopped by ``--trainer.max_steps=2`` inside the first epoch of 4 steps), and its run's
``config.yaml`` (its folders taken out).
"""

from pathlib import Path

import pytest
import torch
from helpers import SMOKE, helper_callback, run_args, run_cli

import multigpu
from multigpu.data.datamodule import ImageDataModule
from multigpu.model.classifier import ImageClassifier

BEFORE = Path(__file__).parent / "data" / "before_renames"


@pytest.mark.slow
def test_a_checkpoint_written_before_the_renames_resumes_as_todays_and_tests(tmp_path):
    """Resumed to the epoch's end, it trains the images a checkpoint of today's code at the same step goes on with
    (the position its data module saved under its old class name), to the same weights; then ``test`` reads it."""
    old = tmp_path / "checkpoints" / "old" / "last.ckpt"
    old.parent.mkdir(parents=True)
    checkpoint = torch.load(BEFORE / "last.ckpt", weights_only=True)
    for state in checkpoint["callbacks"].values():  # in its run's folder, as it was written: moved here
        state.update(dirpath=str(old.parent), last_model_path=str(old))
    torch.save(checkpoint, old)
    as_written = ["--config", SMOKE, "--trainer.max_epochs=2"]  # and --trainer.max_steps=2, as its run was stopped
    today = run_cli("fit", *as_written, *run_args(tmp_path, "today"), "--trainer.max_steps=2")
    assert today.returncode == 0, today.stdout
    for run in ("old", "today"):
        record = helper_callback(tmp_path, "RecordSamples", out_dir=tmp_path / "samples" / run)
        resumed = run_cli(
            "fit",
            *as_written,
            *run_args(tmp_path, run),
            "--config",
            record,
            "--ckpt_path=last",
            "--trainer.max_steps=4",
        )
        assert resumed.returncode == 0, resumed.stdout
        assert "at step 2." in resumed.stdout, resumed.stdout
    samples = [(tmp_path / "samples" / run / "rank0.txt").read_text().split() for run in ("old", "today")]
    assert len(samples[0]) == 2 * 8 and samples[0] == samples[1]
    ends = [torch.load(tmp_path / "checkpoints" / run / "last.ckpt") for run in ("old", "today")]
    assert ends[0]["global_step"] == ends[1]["global_step"] == 4
    assert ends[0]["multigpu"]["order"] == ends[1]["multigpu"]["order"]
    torch.testing.assert_close(ends[0]["state_dict"], ends[1]["state_dict"])  # equal on the torch that wrote it
    tested = run_cli("test", *run_args(tmp_path, "old"), "--ckpt_path=last")
    assert tested.returncode == 0, tested.stdout
    assert "test/acc" in tested.stdout


def test_a_config_written_before_the_renames_still_trains(tmp_path):
    result = run_cli("fit", "--config", str(BEFORE / "config.yaml"), *run_args(tmp_path), "--trainer.max_steps=1")
    assert result.returncode == 0, result.stdout
    assert (tmp_path / "checkpoints" / "test" / "last.ckpt").is_file()


@pytest.mark.parametrize(
    ("module", "old", "new"),
    [
        (multigpu, "ResNet50Classifier", ImageClassifier),
        (multigpu, "CIFAR10DataModule", ImageDataModule),
        (multigpu.model.classifier, "ResNet50Classifier", ImageClassifier),
        (multigpu.data.datamodule, "CIFAR10DataModule", ImageDataModule),
    ],
)
def test_an_old_class_name_gives_the_renamed_class_with_one_deprecation_line(module, old, new):
    with pytest.warns(DeprecationWarning) as warned:
        assert getattr(module, old) is new
    assert len(warned) == 1 and str(warned[0].message).count("\n") == 0
    assert f"{module.__name__}.{old} is deprecated: use {module.__name__}.{new.__name__}" in str(warned[0].message)
    with pytest.raises(AttributeError):
        module.NoSuchClass  # noqa: B018
