"""Checkpoints that survive kills: atomic files, a last.ckpt every N steps, a reported change of layout."""

import contextlib
import errno
import logging
import os
import random
import re
import signal
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
from helpers import (
    HELPERS_ENV,
    LOSE_NODE,
    REPO,
    SMOKE,
    VALIDATION_IMAGES,
    KillAt,
    assert_within_scale,
    cli_main,
    free_port,
    helper_callback,
    helper_plugin,
    run_args,
    run_cli,
    write_tiny_cifar10,
)

from multigpu.checkpointing.checkpoint_io import AtomicCheckpointIO, CheckpointWriteFailed
from multigpu.checkpointing.sharded_checkpoints import read_checkpoint, whole_checkpoint


@pytest.mark.parametrize("background", [False, True])
def test_an_interrupted_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch, background):
    """In the foreground the error is the save's own; in the background, the next call's (here the end's)."""
    path = tmp_path / "run" / "last.ckpt"
    io = AtomicCheckpointIO(background=background)
    io.save_checkpoint({"step": torch.tensor(1)}, path)
    io.wait()

    def killed_midway(obj, file, *args, **kwargs):
        file.write(b"half a checkpoint")
        raise KeyboardInterrupt  # as a kill would stop the write

    monkeypatch.setattr(torch, "save", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"step": torch.tensor(2)}, path)
        io.teardown()
    monkeypatch.undo()
    assert torch.load(path)["step"] == 1
    assert [file.name for file in path.parent.iterdir()] == ["last.ckpt"]  # no temporary file left


def test_a_background_save_returns_before_its_write_and_keeps_the_state_of_its_moment(tmp_path, monkeypatch):
    """``save_checkpoint`` returns while its file is still being written, with a copy of the state that training
    goes on changing; the next save waits for that write, so one is in flight at a time."""
    path, weight = tmp_path / "last.ckpt", torch.zeros(3)
    io, started, release = AtomicCheckpointIO(), threading.Event(), threading.Event()
    write = torch.save

    def slow_save(obj, file, *args, **kwargs):
        started.set()
        release.wait(timeout=60)
        write(obj, file, *args, **kwargs)

    monkeypatch.setattr(torch, "save", slow_save)
    io.save_checkpoint({"weight": weight, "state": {"steps": [1]}}, path)
    assert started.wait(timeout=60) and not path.exists()  # returned: the write goes on in its thread
    weight += 1  # training changes its tensors in place
    later = threading.Thread(target=io.save_checkpoint, args=({"weight": weight}, tmp_path / "next.ckpt"))
    later.start()
    later.join(timeout=0.5)
    assert later.is_alive() and not (tmp_path / "next.ckpt").exists()  # waits for the write in flight
    release.set()
    later.join(timeout=60)
    io.teardown()
    assert torch.equal(torch.load(path)["weight"], torch.zeros(3)) and torch.load(path)["state"] == {"steps": [1]}
    assert torch.equal(torch.load(tmp_path / "next.ckpt")["weight"], torch.ones(3))


@pytest.mark.parametrize("fails", [False, True])
def test_a_replaced_best_file_is_removed_only_once_the_new_one_is_on_disk(tmp_path, monkeypatch, fails):
    """Lightning removes the best-k file it replaces as soon as the save of the new one returns, which a background
    write returns before the file exists: the removal waits for that write, in the writer's thread, and a write that
    fails (a full disk) keeps the old file, and ends the run with one error that names the process and the file.
    A second Ctrl-C (``abandon``) stops a write at its next chunk, and the end waits for nothing more."""
    old, new = tmp_path / "best-old.ckpt", tmp_path / "best-new.ckpt"
    io, started, release = AtomicCheckpointIO(), threading.Event(), threading.Event()
    io.save_checkpoint({"step": torch.tensor(1)}, old)
    io.wait()
    write, failing = torch.save, [fails]

    def slow_save(obj, file, *args, **kwargs):
        started.set()
        release.wait(timeout=60)
        if failing[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write(obj, file, *args, **kwargs)

    monkeypatch.setattr(torch, "save", slow_save)
    io.save_checkpoint({"step": torch.tensor(2)}, new)
    assert started.wait(timeout=60)
    io.remove_checkpoint(old)
    assert old.exists() and not new.exists()  # nothing removed while the new file is not there
    release.set()
    if fails:
        with pytest.raises(CheckpointWriteFailed, match=f"process 0 could not write the checkpoint {new}: No space"):
            io.wait()
        assert old.exists() and not new.exists()
    else:
        io.wait()
        assert new.exists() and not old.exists()
    started.clear(), release.clear()
    failing[0] = False
    io.save_checkpoint({"step": torch.tensor(3)}, old)
    assert started.wait(timeout=60)
    io.abandon()
    release.set()
    io.teardown()  # no error: an abandoned write is not one
    assert [file.name for file in tmp_path.iterdir()] == [(old if fails else new).name]


def test_a_reader_of_a_sharded_checkpoint_finds_its_shards_while_the_run_saves_again(tmp_path):
    """A reader that read ``last.ckpt`` (the folder it names) before the run saved twice more still gets a whole
    checkpoint: the folder before the newest stays, and a file read too long ago is read again; a folder a kill left
    goes at the next first save."""
    path, io = tmp_path / "last.ckpt", AtomicCheckpointIO(background=False)
    (tmp_path / "last.ckpt.shards" / "step0-left").mkdir(parents=True)
    read = []
    for step in range(1, 4):
        io.save_sharded({"global_step": step, "state_dict": {"w": torch.full((2,), step)}}, path, 0, 1, f"t{step}")
        read.append(torch.load(path, weights_only=True))
    folders = sorted(folder.name for folder in (tmp_path / "last.ckpt.shards").iterdir())
    assert folders == ["step2-t2", "step3-t3"]
    assert torch.equal(whole_checkpoint(read[1], path)["state_dict"]["w"], torch.full((2,), 2))  # kept
    assert torch.equal(whole_checkpoint(read[0], path)["state_dict"]["w"], torch.full((2,), 3))  # read again


def test_last_checkpoint_holds_the_last_step_after_a_resumed_run_that_validates_mid_epoch(tmp_path):
    """Validation twice an epoch (4 steps), resumed at step 4 to a second epoch: Lightning writes last.ckpt after a
    validation only where it writes a best-k file, so the step-8 validation, which ranks nothing better, left last.ckpt
    at step 6; it now holds step 8, where training ended."""
    args = ["fit", "--config", SMOKE, *run_args(tmp_path), "--trainer.val_check_interval=0.5"]
    cli_main(*args, "--trainer.max_epochs=1")
    cli_main(*args, "--trainer.max_epochs=2", "--ckpt_path=last")
    assert torch.load(tmp_path / "checkpoints" / "test" / "last.ckpt", weights_only=True)["global_step"] == 8


def test_last_checkpoint_every_n_steps_and_at_each_epoch_end(tmp_path):
    args = ["fit", "--config", SMOKE, *run_args(tmp_path), "--save_every_n_steps=3"]
    folder = tmp_path / "checkpoints" / "test"
    cli_main(*args, "--trainer.max_steps=3")  # stops in the middle of the 4-step epoch
    assert (
        torch.load(
            folder / "last.ckpt",
        )["global_step"]
        == 3
    )
    cli_main(*args, "--ckpt_path=last", "--trainer.max_epochs=2")  # epoch ends at steps 4 and 8
    last = torch.load(
        folder / "last.ckpt",
    )
    assert last["global_step"] == 8 and last["epoch"] == 1
    assert sorted(path.name for path in folder.glob("last*")) == ["last.ckpt"]  # one file, rewritten


@pytest.mark.internals  # Lightning's loop counters of an epoch a limit ended: the lowest torch too
def test_a_run_cut_short_by_max_steps_resumes_inside_its_epoch(tmp_path, caplog):
    """A 16-step run (2 epochs of 8 steps) stopped at step 3 by max_steps writes last.ckpt and no best-k file (it
    validated nothing); resumed with `--ckpt_path last` it trains the rest of epoch 0, validates it, and ends at step
    16, having trained the uninterrupted run's images in its order, bit for bit."""
    base = ["fit", "--config", SMOKE, "--data.synthetic_size=64", "--trainer.max_epochs=2"]

    def args(name: str) -> list[str]:
        return [
            *base,
            *run_args(tmp_path, name),
            "--config",
            helper_callback(tmp_path, "RecordSamples", out_dir=tmp_path / name),
        ]

    cli_main(*args("uninterrupted"))
    cut = tmp_path / "checkpoints" / "cut"
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        cli_main(*args("cut"), "--trainer.max_steps=3")
    assert [path.name for path in cut.iterdir()] == ["last.ckpt"]
    assert not [warning for warning in warned if "could not find the monitored key" in str(warning.message)]
    with caplog.at_level(logging.INFO):
        cli_main(*args("cut"), "--ckpt_path=last")
    assert f"Resuming from {cut / 'last.ckpt'} at step 3." in caplog.text
    last = torch.load(cut / "last.ckpt")
    assert last["global_step"] == 16 and last["epoch"] == 1
    assert sorted(path.name.partition("-val")[0] for path in cut.glob("epoch*")) == [
        "epoch000-step8",
        "epoch001-step16",
    ]
    trained = {name: (tmp_path / name / "rank0.txt").read_text().split() for name in ("uninterrupted", "cut")}
    assert len(trained["cut"]) == 16 * 8 and trained["cut"] == trained["uninterrupted"]


@pytest.mark.slow
@pytest.mark.internals  # Lightning's loop counters of an epoch a limit ended: the lowest torch too
def test_a_ddp_run_cut_short_by_max_steps_resumes_inside_its_epoch(tmp_path, resumable):
    """The issue's case, where users stand: ddp over 2 processes with a loader worker each, on CIFAR's official files
    with their augmentation, stopped by max_steps=3 in a 5-step epoch (between two of `--save_every_n_steps=2`'s
    saves, so last.ckpt is the one written as the limit ends the epoch); resumed with `--ckpt_path last`, each process
    trains the images the uninterrupted run trains, in its order, bit for bit, and epoch 0 is validated."""

    def fit(*extra: str) -> None:
        record = helper_callback(tmp_path, "RecordSamples", out_dir=tmp_path / "cut")
        args = [*_resumable_run(resumable.cifar), *run_args(tmp_path, "cut"), *DDP, "--config", record, *extra]
        result = run_cli(*args, timeout=180)
        assert result.returncode == 0, result.stdout

    resumable(DDP)  # the uninterrupted run, and the images each process trained
    output, uninterrupted = resumable.run[tuple(DDP)]
    assert "LightningEnvironment: 2 process(es) on 1 node(s), started by Lightning." in output
    fit("--trainer.max_steps=3")
    cut = tmp_path / "checkpoints" / "cut"
    assert [path.name for path in cut.iterdir()] == ["last.ckpt"]
    stopped = torch.load(cut / "last.ckpt")
    assert stopped["global_step"] == 3 and stopped["multigpu"]["order"]["position"] == 24  # 3 steps of 8 images
    fit("--ckpt_path=last")
    assert torch.load(cut / "last.ckpt")["global_step"] == STEPS["ddp"]
    assert sorted(path.name.partition("-val")[0] for path in cut.glob("epoch*")) == [
        "epoch000-step5",
        "epoch001-step10",
    ]
    for rank in (0, 1):
        trained = [(folder / f"rank{rank}.txt").read_text().split() for folder in (uninterrupted, tmp_path / "cut")]
        assert len(trained[1]) == STEPS["ddp"] * 4 and trained[1] == trained[0], rank


def test_resuming_with_another_layout_says_what_changed(tmp_path, caplog):
    args = ["fit", "--config", SMOKE, *run_args(tmp_path)]
    cli_main(*args)
    with caplog.at_level(logging.INFO):
        cli_main(
            *args,
            "--ckpt_path=last",
            "--trainer.max_epochs=2",
            "--trainer.strategy=manual_model_parallel",
            "--trainer.devices=2",
        )
    assert (
        "Resuming with another layout (strategy SingleDeviceStrategy -> ManualModelParallelStrategy): "
        "kept the global batch 8 and images per forward pass 8, so the same steps train the same images." in caplog.text
    )
    caplog.clear()
    with caplog.at_level(logging.INFO):
        cli_main(*args, "--ckpt_path=last", "--trainer.max_epochs=3", "--data.batch_size=4")
    assert (
        "Resuming with another layout (strategy ManualModelParallelStrategy -> SingleDeviceStrategy): "
        "changed the global batch 8 -> 4 and images per forward pass 8 -> 4, the learning rate keeps the "
        "checkpoint's scaling." in caplog.text
    )
    caplog.clear()
    with caplog.at_level(logging.INFO):
        cli_main(*args, "--ckpt_path=last", "--trainer.max_epochs=4", "--data.batch_size=8")
    assert (
        "Resuming on the same strategy and devices with another batch: changed the global batch 4 -> 8 and images "
        "per forward pass 4 -> 8, the learning rate keeps the checkpoint's scaling." in caplog.text
    )


def _resumable_run(cifar: Path) -> list[str]:
    """2 epochs on the tiny CIFAR files with their random augmentations, last.ckpt every 2 steps, and
    the recipe's loader settings: 2 persistent workers (the configurations below change the count)."""
    data = [
        f"--data.data_dir={cifar}",
        "--data.synthetic=false",
        "--data.download=false",
        "--data.verify_checksums=false",
        "--data.batch_size=4",
        "--model.stem=imagenet",
        "--data.num_workers=2",
        "--data.persistent_workers=true",
    ]
    return ["fit", "--config", SMOKE, *data, "--save_every_n_steps=2", "--trainer.max_epochs=2"]


CPU2 = ["--trainer.accelerator=cpu", "--trainer.devices=2"]
DDP = ["--trainer.strategy=ddp", *CPU2, "--data.num_workers=1"]
PIPELINE = ["--trainer.strategy=pipeline", *CPU2, "--data.batch_size=8"]
# Model parallel over 2 devices of one process, with the batches and workers of one device.
MODEL_PARALLEL = ["--trainer.strategy=manual_model_parallel", *CPU2, "--trainer.strategy.balance=[2,6]"]
ON_DEVICE = ["--data.on_device=true", "--data.batch_size=8"]
FSDP = ["--trainer.strategy=fsdp", *CPU2, "--data.num_workers=1"]
STEPS = {"ddp": 10, "pipeline": 10, "on_device": 10, "fsdp": 10}
# Each configuration is killed at random moments; together they cover one process and several, 1 and
# 2 workers (model parallel with 2 workers is killed at chosen moments below).
KILLED = {"ddp": DDP, "pipeline": PIPELINE, "on_device": ON_DEVICE, "fsdp": FSDP}


def _final_state(tmp_path, run_name: str) -> dict:
    return read_checkpoint(tmp_path / "checkpoints" / run_name / "last.ckpt")  # fsdp's shards put together


def _step_on_disk(tmp_path, run_name: str) -> int | None:
    last = tmp_path / "checkpoints" / run_name / "last.ckpt"
    return torch.load(last)["global_step"] if last.is_file() else None


def _kill_config(tmp_path: Path, step: int, moment: str = "step", rank: int | None = None) -> str:
    return helper_callback(tmp_path, "KillAt", step=step, moment=moment, rank=rank)


@pytest.fixture(scope="module")
def resumable(tmp_path_factory):
    """The tiny CIFAR, and ``reference(extra)``: the final checkpoint of ``_resumable_run`` with the
    arguments ``extra``, never interrupted; each one is trained once per module. ``reference.run[extra]`` keeps its
    output and the folder of the images each of its processes trained (``helpers.RecordSamples``)."""
    root = tmp_path_factory.mktemp("resumable")
    cifar = write_tiny_cifar10(root / "cifar", per_batch=8)  # 40 training images
    finals: dict[tuple[str, ...], dict] = {}

    def reference(extra: list[str]) -> dict:
        if tuple(extra) not in finals:
            name = f"reference{len(finals)}"
            record = helper_callback(root, "RecordSamples", out_dir=root / f"{name}-samples")
            result = run_cli(*_resumable_run(cifar), *run_args(root, name), *extra, "--config", record)
            assert result.returncode == 0, result.stdout
            finals[tuple(extra)] = _final_state(root, name)
            reference.run[tuple(extra)] = (result.stdout, root / f"{name}-samples")
        return finals[tuple(extra)]

    reference.cifar = cifar
    reference.run = {}
    return reference


def _assert_equal(found, expected, where: str) -> None:
    """``torch.equal`` on every tensor of two nested checkpoint entries, ``==`` on everything else."""
    if isinstance(expected, torch.Tensor):
        assert torch.equal(found, expected), where
    elif isinstance(expected, dict):
        assert found.keys() == expected.keys(), where
        for key in expected:
            _assert_equal(found[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(found) == len(expected), where
        for index, (a, b) in enumerate(zip(found, expected)):
            _assert_equal(a, b, f"{where}[{index}]")
    else:
        assert found == expected, f"{where}: {found} != {expected}"


def _assert_same_state(final: dict, expected: dict, total_steps: int, name: str) -> None:
    """Parameters, BatchNorm buffers, optimizer and LR scheduler state, bit for bit."""
    assert final["global_step"] == expected["global_step"] == total_steps, name
    for key in ("state_dict", "optimizer_states", "lr_schedulers"):
        _assert_equal(final[key], expected[key], f"{name}: {key}")


def _assert_resumed_from(output: str, step: int | None, name: str) -> None:
    """The run says it resumes from ``step``, the checkpoint on disk (none: it starts from scratch)."""
    resumed = re.findall(r"Resuming from \S+ at step (\d+)\.", output)
    if step is None:
        assert not resumed and "starting from scratch" in output, f"{name}: {resumed}\n{output}"
    else:
        assert resumed == [str(step)], f"{name}: resumed from step {resumed}, the checkpoint holds {step}\n{output}"


def _kill_seed() -> int:
    """The seed kills are drawn with: ``MULTIGPU_KILL_SEED`` to replay a failure, else a new one."""
    return int(os.environ.get("MULTIGPU_KILL_SEED", random.randrange(2**31)))


KILL_MOMENTS = (*KillAt.MOMENTS, "write")  # "write": by wall clock, inside the checkpoint's write (KillInWrites)
WRITE_SLOWED_S = 0.4  # how much longer each write of the killed save takes: a window the wall clock's kill falls in


def _draw_kills(seed: int, steps: int, ranks: list[int], count: int = 2, first: int = 0) -> list[dict]:
    """``count`` SIGKILLs of the whole job, at distinct optimizer steps of a ``steps``-step run in order, each at a
    moment of ``KILL_MOMENTS`` (as the step starts, before its backward pass or its optimizer step, at its end, or by
    wall clock while the checkpoint after it is written, its writes slowed) on a rank of ``ranks``: the same seed
    draws the same kills, and all but the write's land at the same point on any machine's pace."""
    draw = random.Random(seed)
    kills = []
    for step in sorted(draw.sample(range(first, steps), count)):
        moment, rank = draw.choice(KILL_MOMENTS), draw.choice(ranks)
        if moment == "write":  # last.ckpt is written every 2 steps and as a run ends: the next save after the step
            delay = round(draw.uniform(0.0, 2 * WRITE_SLOWED_S), 3)  # the first process writes under every strategy
            kills.append({"step": step + 1, "moment": moment, "rank": 0, "delay_s": delay})
        else:
            kills.append({"step": step, "moment": moment, "rank": rank})
    return kills


def _killed_attempt(tmp_path: Path, args: list[str], kill: dict, attempt: int, env: dict | None = None) -> str:
    """Run ``args`` with ``kill`` (``_draw_kills``): the job must end by it, and a checkpoint on disk must be
    resumed from and never lost. Its output."""
    on_disk = _step_on_disk(tmp_path, "killed")
    if kill["moment"] == "write":
        options = {key: kill[key] for key in ("step", "rank", "delay_s")}
        config = helper_plugin(tmp_path, "KillInWrites", slow_s=WRITE_SLOWED_S, **options)
    else:
        config = helper_callback(tmp_path, "KillAt", whole_job=True, **kill)
    result = run_cli(*args, "--config", config, env=env, timeout=180)
    left = _step_on_disk(tmp_path, "killed")
    print(f"attempt {attempt}: from step {on_disk}, killed at {kill}, left step {left}")
    assert result.returncode == -signal.SIGKILL, f"attempt {attempt}, {kill}: not killed\n{result.stdout}"
    if on_disk is not None:
        _assert_resumed_from(result.stdout, on_disk, f"attempt {attempt}")
    assert (left or 0) >= (on_disk or 0), f"attempt {attempt}: a kill lost a checkpoint"
    return result.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [pytest.param(name, marks=pytest.mark.internals) if name in ("pipeline", "fsdp") else name for name in KILLED],
)  # the pipeline's and fsdp's cases run on the lowest torch too
def test_killed_at_random_moments_and_resumed_ends_bit_for_bit_like_an_uninterrupted_run(name, tmp_path, resumable):
    """SIGKILL to the whole job at a random moment (a step, a moment within it and a rank, drawn from a seed), then
    the same command with `--ckpt_path last`: it resumes from the step on disk, and the run ends with the
    parameters, BatchNorm buffers, optimizer and scheduler state of a run never killed (two kills in a row: the
    test on another device count).

    Replay a failure with the seed it prints: MULTIGPU_KILL_SEED=<seed> pytest -k <name>.
    """
    extra = KILLED[name]
    expected = resumable(extra)
    seed = _kill_seed()
    kills = _draw_kills(seed, STEPS[name], ranks=[0, 1] if name in ("ddp", "pipeline", "fsdp") else [0], count=1)
    print(f"{name}: kills drawn with seed {seed}: {kills}")
    args = [*_resumable_run(resumable.cifar), *run_args(tmp_path, "killed"), *extra, "--ckpt_path=last"]
    for attempt, kill in enumerate(kills):
        _killed_attempt(tmp_path, args, kill, attempt)
    on_disk = _step_on_disk(tmp_path, "killed")
    resumed = run_cli(*args)
    assert resumed.returncode == 0, resumed.stdout
    if on_disk == STEPS[name]:
        assert "has already finished" in resumed.stdout, resumed.stdout
    else:
        _assert_resumed_from(resumed.stdout, on_disk, f"{name}, last attempt (seed {seed})")
    _assert_same_state(_final_state(tmp_path, "killed"), expected, STEPS[name], f"{name} (seed {seed})")


# One device accumulating 2 batches of 4: the global batch and the forward passes of DDP above. One thread per
# process, as each of DDP's 2 processes has on this 2-core machine: ResNet-50 with the ImageNet stem normalises
# 4 values per channel in its last layers on these 32x32 images, and turns another order of a convolution's
# sums (another thread count) into other weights within a few steps.
ONE_DEVICE_ACCUMULATING = ["--trainer.devices=1", "--trainer.accumulate_grad_batches=2", "--data.num_workers=1"]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def _assert_close_state(final: dict, expected: dict, name: str, tolerance: float = 1e-4) -> None:
    """The same step, and every parameter and buffer within ``tolerance`` of the largest value of its tensor."""
    assert final["global_step"] == expected["global_step"], name
    worst = assert_within_scale(final["state_dict"], expected["state_dict"], tolerance, name)
    print(f"{name}: step {final['global_step']}, largest difference over each tensor's largest value {worst:.1e}")


@pytest.mark.slow
def test_killed_at_random_moments_and_resumed_on_another_device_count_ends_like_an_uninterrupted_run(
    tmp_path, resumable
):
    """SIGKILL to the whole job at 2 random moments from step 3 on (drawn from a seed), the attempts alternating
    between ddp over 2 processes and 1 device that accumulates 2 batches (the same global batch and forward passes),
    then 1 device to the end: the second attempt says what it kept of ddp's checkpoint, and the run ends with the
    uninterrupted ddp run's step, and its weights within 1e-4. Replay with MULTIGPU_KILL_SEED=<seed>."""
    expected = resumable(DDP)
    seed = _kill_seed()
    kills = _draw_kills(seed, STEPS["ddp"], ranks=[0], first=3)  # after ddp's first checkpoint (step 2)
    kills[0]["rank"] = random.Random(seed).choice([0, 1])  # the ddp attempt's: either process
    print(f"another device count: kills drawn with seed {seed}: {kills}")
    args = [*_resumable_run(resumable.cifar), *run_args(tmp_path, "killed"), "--ckpt_path=last"]
    outputs = [
        _killed_attempt(tmp_path, [*args, *layout], kill, attempt, env=ONE_THREAD)
        for attempt, (kill, layout) in enumerate(zip(kills, [DDP, ONE_DEVICE_ACCUMULATING]))
    ]
    assert (
        "Resuming with another layout (strategy DDPStrategy -> SingleDeviceStrategy, world size 2 -> 1, replicas "
        "2 -> 1, accumulated batches 1 -> 2): kept the global batch 8 and images per forward pass 4, so the same "
        "steps train the same images" in outputs[1]
    ), outputs[1]
    resumed = run_cli(*args, *ONE_DEVICE_ACCUMULATING, env=ONE_THREAD)
    assert resumed.returncode == 0, resumed.stdout
    _assert_close_state(_final_state(tmp_path, "killed"), expected, f"another device count (seed {seed})")


@pytest.mark.slow
def test_a_second_ctrl_c_during_the_stops_save_ends_at_once_and_keeps_the_checkpoint_before(tmp_path):
    """Ctrl-C (SIGINT to the process group) as step 3 starts: the run stops after it and saves last.ckpt at step 4,
    a write slowed to 20 s; a second Ctrl-C half a second into it gives the write up. The run ends without waiting for
    it, as on Lightning's own Ctrl-C (status 1, no traceback: the other callbacks, the loggers and the teardown run),
    and last.ckpt still holds step 2, whole."""
    stop = _kill_config(tmp_path, 3, "ctrl-c")
    second = helper_plugin(tmp_path, "CtrlCInWrite", step=4)
    args = ["fit", "--config", SMOKE, *run_args(tmp_path), "--data.synthetic_size=64", "--save_every_n_steps=2"]
    result = run_cli(*args, "--config", stop, "--config", second, env=HELPERS_ENV, timeout=120)
    assert result.returncode == 1 and "Ctrl-C again to stop at once" in result.stdout, result.stdout
    assert "Ctrl-C again: stopping now" in result.stdout and "Traceback" not in result.stdout, result.stdout
    assert _final_state(tmp_path, "test")["global_step"] == 2
    assert not list((tmp_path / "checkpoints" / "test").glob(".*.tmp")), "the abandoned write left its file"


@pytest.mark.slow
def test_killed_at_chosen_moments_and_resumed_ends_bit_for_bit_like_an_uninterrupted_run(tmp_path, resumable):
    """The moments a random draw rarely hits, each followed by `--ckpt_path last`, give the state of a run
    never killed: Ctrl-C (SIGINT to the process and its loader workers, as a terminal sends it: the step ends and
    last.ckpt is written), SIGKILL halfway through a background write of last.ckpt (``helpers.KillInWrite``, at step
    8, while training goes on), which leaves the one before (step 6), and SIGTERM in an epoch's last step (the process
    saves once Lightning has counted the epoch, then exits cleanly). Under model parallel: 2 devices of one process,
    their blocks split inside a bottleneck. (The random kills strike as a checkpoint is being made too.)"""
    write_kill = tmp_path / "kill-in-write.yaml"
    write_kill.write_text(
        "trainer:\n  plugins:\n    - class_path: helpers.KillInWrite\n      init_args:\n        step: 8\n"
    )
    kills = [
        (3, "ctrl-c", "Ctrl-C to the whole job (its 2 loader workers too) mid-epoch"),
        (8, "write", "halfway through a background write"),
        (9, "sigterm", "SIGTERM in the epoch's last step"),
    ]
    run = [*run_args(tmp_path, "killed"), VALIDATION_IMAGES]  # each validation's images: the stops wait for them
    args = [*_resumable_run(resumable.cifar), *run, *MODEL_PARALLEL, "--ckpt_path=last"]
    for step, moment, name in kills:
        kill = str(write_kill) if moment == "write" else _kill_config(tmp_path, step, moment)
        killed = run_cli(*args, "--config", kill, env=HELPERS_ENV)
        if moment in ("sigterm", "ctrl-c"):  # saves the step it finished, then exits: 0, or 130 after Ctrl-C
            said = "Received SIGTERM: saved" if moment == "sigterm" else "Received Ctrl-C: saved"
            code = 0 if moment == "sigterm" else 130
            assert killed.returncode == code and said in killed.stdout, f"{name}: {killed.stdout}"
            assert _final_state(tmp_path, "killed")["global_step"] == step + 1
        else:
            assert killed.returncode == -signal.SIGKILL, f"{name}: {killed.stdout}"
        if moment == "write":  # the write cut short lies beside the checkpoint before it, which stands
            assert _final_state(tmp_path, "killed")["global_step"] == step - 2
            assert list((tmp_path / "checkpoints" / "killed").glob(".last.ckpt.*.tmp")), name
    resumed = run_cli(*args)
    assert resumed.returncode == 0 and "Restored all states" in resumed.stdout, resumed.stdout
    _assert_same_state(_final_state(tmp_path, "killed"), resumable(MODEL_PARALLEL), 20, "chosen moments")


@pytest.mark.slow
def test_sigterm_to_one_ddp_process_or_ctrl_c_stops_both_after_the_same_step(tmp_path, resumable):
    """Ctrl-C to the whole ddp job (both processes and their loader workers, as a terminal sends it) in epoch 0's last
    step (step 4 of 5: Lightning then starts the validation, whose loader workers Ctrl-C reached too, and stops it
    after its first batch), then SIGTERM to rank 1 alone at step 5, logging every 50 steps: each time both processes
    stop after the same step, write last.ckpt and exit (130 after Ctrl-C, as a shell expects; 0 after SIGTERM),
    rather than one waiting for the other in a collective; the run then resumes bit for bit. The processes vote on a
    signal after every step and read the vote one step later (``StopVotes``), whatever the logging interval: SIGTERM
    in step 5 stops the run after step 6, the next."""
    run = [*run_args(tmp_path, "killed"), VALIDATION_IMAGES]  # each validation's images: the stops wait for them
    args = [*_resumable_run(resumable.cifar), *DDP, *run, "--ckpt_path=last"]
    stopped = run_cli(*args, "--config", _kill_config(tmp_path, 4, "ctrl-c", rank=0), env=HELPERS_ENV, timeout=180)
    assert stopped.returncode == 130 and "Received Ctrl-C: saved" in stopped.stdout, stopped.stdout
    assert "Ctrl-C again to stop at once" in stopped.stdout, stopped.stdout
    assert _final_state(tmp_path, "killed")["global_step"] == 5
    logged = "--trainer.log_every_n_steps=50"
    sigterm = _kill_config(tmp_path, 5, "sigterm", rank=1)
    stopped = run_cli(*args, logged, "--config", sigterm, env=HELPERS_ENV, timeout=180)
    assert stopped.returncode == 0 and "Received SIGTERM: saved" in stopped.stdout, stopped.stdout
    assert _final_state(tmp_path, "killed")["global_step"] == 7
    resumed = run_cli(*args)
    assert resumed.returncode == 0 and "Restored all states" in resumed.stdout, resumed.stdout
    _assert_same_state(_final_state(tmp_path, "killed"), resumable(DDP), 10, "SIGTERM to rank 1")


@pytest.mark.slow
def test_torchrun_restarts_resume_from_the_last_checkpoint_on_their_own(tmp_path, resumable):
    """torchrun --max-restarts=1 restarts both DDP processes after a SIGKILL at step 7; the restart,
    the same command with `--ckpt_path last`, resumes and ends bit for bit like an uninterrupted run.

    Static rendezvous on a free port, as the command in docs/fault-tolerance.md.
    """
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        str(REPO / "main.py"),
    ]
    args = [*_resumable_run(resumable.cifar), *DDP, "--ckpt_path=last", "--config", _kill_config(tmp_path, 7)]
    result = subprocess.run(
        [*torchrun, *args, *run_args(tmp_path, "restarted")],
        cwd=REPO,
        env={**os.environ, **HELPERS_ENV},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout
    assert "Restored all states" in result.stdout, result.stdout
    _assert_same_state(_final_state(tmp_path, "restarted"), resumable(DDP), 10, "torchrun restart")


@pytest.mark.slow
@pytest.mark.parametrize("rank", [1, 0])
def test_a_failing_rank_ends_the_whole_job_quickly_with_its_error(rank, tmp_path):
    fail = helper_callback(tmp_path, "FailOnRank", rank=rank, step=2)
    result = run_cli(
        "fit",
        "--config",
        SMOKE,
        "--config",
        str(fail),
        "--trainer.accelerator=cpu",
        "--trainer.devices=2",
        "--trainer.strategy=ddp",
        "--data.synthetic_size=64",
        *run_args(tmp_path),
        timeout=300,  # not the 30 minutes of a collective's timeout: the other rank is ended, not left waiting
    )
    assert result.returncode != 0
    assert f"RuntimeError: rank {rank} failed on purpose at step 2" in result.stdout


def _process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it: torchrun starts its workers in sessions of their own."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError):
            continue  # ended meanwhile
        children.setdefault(parent, []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo.extend(children.get(tree[-1], []))
    return tree


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it, as a lost machine ends them."""
    for process in _process_tree(pid):
        with contextlib.suppress(ProcessLookupError):  # ended meanwhile
            os.kill(process, signal.SIGKILL)


def _torchrun_node(
    args: list[str], port: int, hosts_rendezvous: bool, log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """One elastic torchrun agent ("node") of 1 to 2 on 127.0.0.1 with one process; short heartbeats, so that
    the other node notices a lost one within seconds (torchrun's defaults take 15 s, and 30 s to start)."""
    conf = f"is_host={int(hosts_rendezvous)},last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=5"
    torchrun = [
        *("--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=2", "--rdzv-backend=c10d"),
        *(f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic", f"--rdzv-conf={conf}"),
    ]
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", *torchrun, str(REPO / "main.py"), *args],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **HELPERS_ENV, **ONE_THREAD, "PYTHONUNBUFFERED": "1", **(env or {})},
        )


@pytest.mark.slow
@pytest.mark.internals  # torchrun's c10d rendezvous and the attempts' keys (multigpu.checkpointing.elastic)
def test_torchrun_elastic_run_that_loses_a_node_goes_on_with_the_node_left(tmp_path, resumable):
    """`torchrun --nnodes=1:2` on two loopback "nodes" of one process each, sharing a checkpoint folder, with
    `--data.global_batch_size=8`: ddp over 2 processes with batch 4. As a step drawn from a seed after the first
    checkpoint starts, the node that does not host the rendezvous is lost (its worker SIGKILLs its agent and
    itself). The other node's worker fails in its next all-reduce, torchrun restarts it on the one node left, and
    it resumes from last.ckpt accumulating 2 batches: the uninterrupted ddp run's step, and its weights within
    1e-4. Replay with MULTIGPU_KILL_SEED=<seed>."""
    expected = resumable(DDP)
    seed = _kill_seed()
    step = random.Random(seed).randrange(3, STEPS["ddp"] - 1)  # after the first checkpoint (step 2), not the last
    print(f"elastic: the node is lost as step {step} starts (seed {seed})")
    layout = ["--trainer.strategy=ddp", "--trainer.accelerator=cpu", "--trainer.devices=1", "--data.num_workers=1"]
    args = [*_resumable_run(resumable.cifar), *layout, "--data.global_batch_size=8", "--ckpt_path=last"]
    args += [*run_args(tmp_path, "elastic"), "--config", helper_callback(tmp_path, "LoseNodeAt", step=step)]
    port = free_port()
    staying = _torchrun_node(args, port, True, tmp_path / "staying.log")
    lost = _torchrun_node(args, port, False, tmp_path / "lost.log", {LOSE_NODE: "1"})
    try:
        lost.wait(timeout=300)
        staying.wait(timeout=300)
    finally:  # a failed test leaves no agent, nor a worker in its own session, running
        for node in (staying, lost):
            if node.poll() is None:
                _kill_tree(node.pid)
    assert lost.returncode == -signal.SIGKILL, (tmp_path / "lost.log").read_text()
    output = (tmp_path / "staying.log").read_text()
    assert staying.returncode == 0, output
    print(f"elastic: {re.findall(r'Resuming from .*', output)}")
    assert (
        "Resuming with another layout (world size 2 -> 1, replicas 2 -> 1, accumulated batches 1 -> 2): kept the "
        "global batch 8 and images per forward pass 4" in output
    ), output
    _assert_close_state(_final_state(tmp_path, "elastic"), expected, f"elastic (seed {seed})")


def test_shards_of_every_layout_are_put_together_into_the_whole_tensors():
    """``fsdp``'s pieces, as ``sharded_checkpoints`` writes them, make the whole tensors again: cut along dimension 0
    over 3 processes (the last one's piece empty, as ``torch.chunk`` leaves it), and under HSDP (2 replicas x 2
    shards: the first replica's pieces), with a plain tensor and a tuple beside them."""
    from multigpu.checkpointing.sharded_checkpoints import _PIECE, _joined

    whole = torch.arange(8.0).reshape(4, 2)

    def pieces(chunks: int, replicas: int) -> list[dict]:
        parts = list(torch.chunk(whole, chunks)) + [whole[:0]] * (chunks - len(torch.chunk(whole, chunks)))
        return [
            {
                "w": {
                    _PIECE: parts[shard],
                    "dims": [None, 0] if replicas > 1 else [0],
                    "shape": [4, 2],
                    "coordinate": [replica, shard] if replicas > 1 else [shard],
                },  # fmt: skip
                "betas": (0.9, 0.99) if (replica, shard) == (0, 0) else (None, None),
                "count": torch.tensor(3) if (replica, shard) == (0, 0) else None,
            }
            for replica in range(replicas)
            for shard in range(chunks)
        ]

    for chunks, replicas in ((3, 1), (2, 2), (5, 1)):
        joined = _joined(pieces(chunks, replicas))
        assert torch.equal(joined["w"], whole) and joined["betas"] == (0.9, 0.99) and joined["count"] == 3
