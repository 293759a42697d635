"""Resume anywhere: a run resumed on another device count, batch split or strategy trains the same images in
the same steps, and, when each forward pass keeps its images, the same maths."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers import ABORTED_AT_EXIT, HELPERS_ENV, REPO, assert_within_scale, cli_error, trained_steps
from torch import nn

from multigpu.checkpointing.loop_position import count_steps_as_done
from multigpu.checkpointing.position import TrainingPosition
from multigpu.data.datamodule import ImageDataModule
from multigpu.data.sampling import EpochOrder, ResumableSampler
from multigpu.model.step_batch_norm import commit_step_statistics, record_step_statistics
from multigpu.run.replicas import accumulation_for

SAMPLES = list(range(40))


def _steps(replicas: int, accumulation: int, batch_size: int, epoch: int = 1, start: int = 0) -> list[list[set]]:
    """For each optimizer step of an epoch, its loader batches (as sets of indices) over all replicas."""
    steps: dict[int, list[set]] = {}
    for rank in range(replicas):
        sampler = ResumableSampler(SAMPLES, replicas, rank, batch_size, accumulation, seed=7)
        sampler.set_epoch(epoch)
        if start:
            sampler.resume_at(epoch, start)
        keys = [index for index, _ in sampler]
        assert len(keys) % batch_size == 0
        for number in range(len(keys) // batch_size):
            steps.setdefault(number // accumulation, []).append(
                set(keys[number * batch_size : (number + 1) * batch_size])
            )
    return [sorted(steps[step], key=min) for step in sorted(steps)]


def test_every_layout_of_a_global_batch_trains_the_same_forward_groups_in_the_same_steps():
    """1 device x 4 accumulated = 2 replicas x 2 = 4 replicas x 1: the same images meet in each forward pass."""
    layouts = [_steps(replicas, 4 // replicas, 2) for replicas in (1, 2, 4)]
    assert layouts[0] == layouts[1] == layouts[2]
    assert len(layouts[0]) == 40 // 8
    trained = [index for step in layouts[0] for batch in step for index in batch]
    assert sorted(trained) == SAMPLES  # each image once
    assert _steps(1, 4, 2, epoch=2) != layouts[0]  # another epoch, another order


@pytest.mark.parametrize(
    ("before", "after"),
    [((2, 1, 4), (1, 2, 4)), ((1, 2, 4), (2, 1, 4)), ((2, 1, 4), (1, 3, 4)), ((1, 3, 4), (4, 1, 1))],
    ids=["2 to 1 accumulating", "1 to 2", "global batch 8 to 12", "12 to 4"],
)
def test_an_epoch_resumed_on_another_layout_trains_every_image_once(before, after):
    """A run stopped after 2 steps of a layout and resumed on another trains each image of the epoch at most once,
    and all but fewer than one global batch of the new layout; Lightning counts the resumed steps as the rest of
    a whole epoch."""
    first = _steps(*before)[:2]
    trained = {index for step in first for batch in step for index in batch}
    position = sum(len(batch) for step in first for batch in step)
    resumed = _steps(*after, start=position)
    rest = [index for step in resumed for batch in step for index in batch]
    assert not trained & set(rest) and len(rest) == len(set(rest))
    global_batch = after[0] * after[1] * after[2]
    assert len(SAMPLES) - len(trained) - len(rest) < global_batch
    epoch_order = EpochOrder(len(SAMPLES), global_batch, position)
    assert (
        epoch_order.steps == len(resumed)
        and epoch_order.skipped_steps + epoch_order.steps == len(SAMPLES) // global_batch
    )
    assert epoch_order.position(epoch_order.skipped_steps + 1) == position + global_batch


def test_a_checkpoint_written_between_epochs_sets_the_next_epoch_before_the_loader_starts(tiny_cifar10):
    """Lightning builds the resumed epoch's loader iterator (and its workers draw their first indices) before it
    sets the sampler's epoch: the data module sets it from the checkpoint, between epochs as within one."""
    data = ImageDataModule(
        data_dir=str(tiny_cifar10), download=False, verify_checksums=False, batch_size=4, num_workers=0
    )
    data.setup("fit")
    position = TrainingPosition.of({"multigpu": {"order": {"epoch": 1, "position": 0, "global_batch": 4}}})
    assert position.give_to(data, accumulation=1) is None  # nothing of epoch 1 is trained yet
    assert data.train_dataloader().sampler.epoch == 1


def test_lightnings_batch_counters_are_rebased_on_the_new_accumulation():
    fit_loop = {"epoch_loop.batch_progress": {"current": {}, "total": {}}}
    for part, base in (("current", 3), ("total", 13)):
        fit_loop["epoch_loop.batch_progress"][part] = {"ready": base, "started": base, "processed": base}
        fit_loop["epoch_loop.batch_progress"][part]["completed"] = base - 1  # saved in on_train_batch_end
    count_steps_as_done(fit_loop, steps=3, accumulation=2)
    assert fit_loop["epoch_loop.batch_progress"]["current"] == {
        "ready": 6,
        "started": 6,
        "processed": 6,
        "completed": 5,
    }
    assert fit_loop["epoch_loop.batch_progress"]["total"]["processed"] == 16


@pytest.mark.parametrize("momentum", [0.1, None])
def test_step_statistics_of_one_replica_are_those_of_batch_norm_run_micro_batch_after_micro_batch(momentum):
    """The committed running statistics of a step of 2 loader batches cut into 3 micro-batches each equal plain
    BatchNorm's after the same 6 forward passes (the one-replica case of the replicas' all-reduce)."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=momentum))
    recorded = record_step_statistics(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=momentum)), 6)
    recorded.load_state_dict(plain.state_dict())
    for step in range(2):
        for _ in range(6):
            images = torch.randn(5, 3, 6, 6) * (step + 1) + step
            plain(images)
            recorded(images)
        commit_step_statistics(recorded, 6, replicas=1, replica=0, per_batch=3)
    torch.testing.assert_close(recorded.state_dict(), plain.state_dict(), rtol=1e-6, atol=1e-7)
    assert int(recorded[1].num_batches_tracked) == 12


def test_a_global_batch_the_layout_cannot_split_is_refused_in_one_line(capsys):
    assert accumulation_for(16, 4, 2) == 2
    with pytest.raises(Exception, match="leaves each of 2 replica"):
        accumulation_for(12, 4, 2)
    line = cli_error(capsys, "--trainer.devices=2", "--trainer.strategy=ddp", "--data.global_batch_size=12")
    assert line == (
        "error: --data.global_batch_size=12 leaves each of 2 replica(s) 6 images a step, not whole batches of "
        "--data.batch_size=8: pass a --data.batch_size that divides 6, or a global batch that is a multiple of 16."
    )
    line = cli_error(capsys, "--trainer.devices=3", "--trainer.strategy=ddp", "--data.global_batch_size=16")
    assert line.startswith("error: --data.global_batch_size=16 does not split over this layout's 3 replicas")
    line = cli_error(capsys, "--data.global_batch_size=16", "--trainer.accumulate_grad_batches=4")
    assert "disagree on this layout, which needs 2 accumulated batches" in line


def _train(layout: str, folder, attempt: str, steps: int, kill_at: int | None = None) -> int:
    """``tests/layout_training.py`` in a subprocess; its exit status."""
    args = [sys.executable, str(REPO / "tests" / "layout_training.py"), layout, str(folder), attempt, str(steps)]
    result = subprocess.run(
        args + ([str(kill_at)] if kill_at is not None else []),
        env={**os.environ, **HELPERS_ENV},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ABORTED_AT_EXIT not in result.stderr
    assert kill_at is not None or result.returncode == 0, result.stdout + result.stderr
    return result.returncode


@pytest.mark.slow
@pytest.mark.internals  # fsdp, and the step statistics' all-reduce, on the lowest torch too
def test_one_device_ddp_and_fsdp_on_the_same_forward_groups_train_the_same_weights(tmp_path):
    """A global batch of 16 in forward passes of 4: 1 device x 4 accumulated, ddp 2 x 2, ddp 4 x 1 and fsdp 4 train
    the same images per step and, after 4 steps in float32, every parameter and BatchNorm buffer within 1e-5."""
    finals, steps = {}, {}
    for launch in ("one_device_x4", "ddp_2_x2", "ddp_4,fsdp_4"):  # the 4-process layouts in one launch
        _train(launch, tmp_path if "," in launch else tmp_path / launch, "a0", 4)
    for layout in ("one_device_x4", "ddp_2_x2", "ddp_4", "fsdp_4"):
        finals[layout] = torch.load(tmp_path / layout / "final.pt")
        steps[layout] = {
            step: sorted(images) for step, images in trained_steps([tmp_path / layout / "records" / "a0"]).items()
        }
    reference = finals.pop("one_device_x4")
    assert sorted(steps["one_device_x4"]) == [0, 1, 2, 3]
    for layout, final in finals.items():
        assert steps[layout] == steps["one_device_x4"], layout
        worst = assert_within_scale(final, reference, 1e-5, layout, rtol=1e-5)
        print(f"{layout}: largest difference from one device {worst:.1e}")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """``ddp_2`` for 8 steps, never killed: ``.steps`` (the images of each step) and ``.final`` (its state)."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    _train("ddp_2", folder, "a0", 8)
    return SimpleNamespace(steps=trained_steps([folder / "records" / "a0"]), final=torch.load(folder / "final.pt"))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("killed", "resumed"),
    [
        ("ddp_2", "one_device_x2"),
        ("one_device_x2", "ddp_2"),
        ("ddp_2", "fsdp_2"),
        ("pipeline_2_replicas", "ddp_2"),
    ],
    ids=["2 to 1 accumulating", "1 to 2", "ddp to fsdp", "pipeline replicas to ddp"],
)
@pytest.mark.internals  # Lightning's batch counters rebased, the pipeline and fsdp: on the lowest torch too
def test_a_run_killed_mid_epoch_and_resumed_on_another_layout_trains_the_same_images_in_each_step(
    killed, resumed, tmp_path, uninterrupted
):
    """48 images, global batch 8, 8 steps (into the second epoch); SIGKILL as step 3 starts, then the other layout
    resumes from last.ckpt: each step trains the images of the uninterrupted run's step, and where the forward
    passes keep their images, the weights are the uninterrupted run's within 1e-5."""
    expected = uninterrupted.steps
    assert _train(killed, tmp_path / "run", "a0", 8, kill_at=3) != 0
    _train(resumed, tmp_path / "run", "a1", 8)
    found = trained_steps([tmp_path / "run" / "records" / attempt for attempt in ("a0", "a1")])
    assert sorted(found) == list(range(8))
    for step in range(8):
        assert sorted(found[step]) == sorted(expected[step]), f"step {step}"
    if killed != "pipeline_2_replicas":  # the pipeline's forward passes take 2 images, not 4
        final = torch.load(tmp_path / "run" / "final.pt")
        floats = [name for name, value in uninterrupted.final.items() if value.is_floating_point()]
        found, expected = ({name: state[name] for name in floats} for state in (final, uninterrupted.final))
        worst = assert_within_scale(found, expected, 1e-5, f"{killed} -> {resumed}", rtol=1e-5)
        print(f"{killed} -> {resumed}: largest difference from uninterrupted {worst:.1e}")
