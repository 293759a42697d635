"""The CLI end to end, in subprocesses, as a user runs it."""

import logging
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import SMOKE, cli_main, run_args, run_cli
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from multigpu.cli.quiet_console import quiet_console

pytestmark = pytest.mark.internals  # CI runs these on the lowest torch we declare too


def _val_acc(last: Path) -> str:
    """The validation accuracy in the name of the best checkpoint beside ``last``."""
    return next(last.parent.glob("epoch000-*.ckpt")).stem.rpartition("val_acc")[2]


def _scalars(log_dir: Path) -> dict[str, list[int]]:
    """Tag -> steps of every scalar in the TensorBoard events under ``log_dir``."""
    steps: dict[str, list[int]] = {}
    for events in sorted(log_dir.glob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            steps.setdefault(tag, []).extend(event.step for event in accumulator.Scalars(tag))
    return steps


@pytest.mark.slow
def test_fit_writes_checkpoints_tensorboard_and_config_then_resumes_the_same_run(tmp_path):
    first = run_cli("fit", "--config", SMOKE, *run_args(tmp_path))
    assert first.returncode == 0, first.stdout
    last = tmp_path / "checkpoints" / "test" / "last.ckpt"
    assert last.is_file()
    assert len(list(last.parent.glob("epoch000-step4-val_acc*.ckpt"))) == 1
    assert "epoch 0 | step 4 | train/loss" in first.stdout  # the one-line epoch summary
    log_dir = tmp_path / "logs" / "test" / "version_0"
    assert (log_dir / "config.yaml").is_file()
    scalars = _scalars(log_dir)
    for tag in ("train/loss", "train/acc", "train/lr", "val/loss", "val/acc", "perf/images_per_s", "perf/epoch_time_s"):
        assert tag in scalars, tag
    assert "hp_metric" not in scalars  # no empty card in TensorBoard
    assert sorted(scalars["train/loss"]) == [0, 1, 2, 3]
    assert scalars["epoch"] == [0]  # once per epoch: Lightning adds it to every write of 4 steps and a validation
    assert torch.load(last)["global_step"] == 4

    # The same command again, without --ckpt_path: refused before anything is built, the run's folder untouched.
    before = {path.name: path.read_bytes() for path in sorted(last.parent.iterdir())}
    again = run_cli("fit", "--config", SMOKE, *run_args(tmp_path))
    assert again.returncode == 2
    assert again.stdout.strip().splitlines()[-1] == (
        f"error: run test already has checkpoints in {last.parent} (epoch000-step4-val_acc{_val_acc(last)}.ckpt ...): "
        "resume it with --ckpt_path last, or start another run with a new --run_name."
    )
    assert "Traceback" not in again.stdout
    for noise in ("Tip:", "LeafSpec", "TPU available", "worker processes in total", "many workers", "Seed set to"):
        assert noise not in first.stdout and noise not in again.stdout, noise
    assert {path.name: path.read_bytes() for path in sorted(last.parent.iterdir())} == before
    assert not (tmp_path / "logs" / "test" / "version_1").exists()

    resumed = run_cli("fit", "--config", SMOKE, *run_args(tmp_path), "--ckpt_path=last", "--trainer.max_epochs=2")
    assert resumed.returncode == 0, resumed.stdout
    checkpoint = torch.load(last)
    assert checkpoint["global_step"] == 8 and checkpoint["epoch"] == 1
    assert checkpoint["lr_schedulers"][0]["last_epoch"] == 8
    # The same TensorBoard run goes on from step 4; the config is overwritten, not refused.
    assert not (tmp_path / "logs" / "test" / "version_1").exists()
    assert sorted(_scalars(log_dir)["train/loss"]) == list(range(8))
    assert "epoch 1 | step 8" in resumed.stdout
    # One point per epoch, none at the step it resumed from, and no warning about its own folder or val/acc.
    assert sorted(_scalars(log_dir)["perf/images_per_s"]) == [3, 7]
    for warning in ("exists and is not empty", "could not find the monitored key"):
        assert warning not in resumed.stdout, warning

    # test, without the run's data options: it reads them from the checkpoint, and logs beside the training.
    tested = run_cli("test", *run_args(tmp_path), "--ckpt_path=last")
    assert tested.returncode == 0, tested.stdout
    assert "(epoch 1, step 8)" in tested.stdout and "test/acc" in tested.stdout
    assert "Model options changed" not in tested.stdout
    assert not (tmp_path / "logs" / "test" / "version_1").exists()
    assert (log_dir / "test-config.yaml").is_file() and "test/acc" in _scalars(log_dir)


@pytest.mark.slow
def test_ckpt_path_last_without_a_checkpoint_starts_from_scratch(tmp_path):
    result = run_cli("fit", "--config", SMOKE, *run_args(tmp_path), "--ckpt_path=last")
    assert result.returncode == 0, result.stdout
    assert "yet: starting from scratch" in result.stdout
    assert (tmp_path / "checkpoints" / "test" / "last.ckpt").is_file()


def test_a_mistyped_command_is_answered_with_the_nearest_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main("exprot", "--ckpt_path", "last")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: exprot is not a command (did you mean export?): python main.py fit | validate | test | predict | "
        "plan | export; python main.py --help says what each does."
    ]


@pytest.mark.slow
def test_help_and_print_config():
    helped = run_cli("--help", fresh=True)  # the entry point, as a user starts it
    assert helped.returncode == 0
    for command in ("fit", "validate", "test", "predict", "plan", "export"):
        assert any(line.split()[:1] == [command] for line in helped.stdout.splitlines()), command
    fit_help = run_cli("fit", "--help").stdout
    described = [
        fit_help.index(f"\n  --{option} ") for option in ("model.base_lr", "data.data_dir", "trainer.strategy")
    ]
    assert described == sorted(described)  # the project's options first
    strategy_help = fit_help[described[2] :]
    assert "auto, ddp, ddp_spawn, dp, fsdp, manual_model_parallel, pipeline" in " ".join(strategy_help[:400].split())
    printed = run_cli("fit", "--print_config")
    assert printed.returncode == 0, printed.stdout
    # Values that differ from the code's defaults: configs/default.yaml was read.
    assert "nesterov: true" in printed.stdout and "max_epochs: 100" in printed.stdout


@pytest.mark.slow
def test_ddp_spawn_two_cpu_processes(tmp_path):
    result = run_cli(
        "fit", "--config", SMOKE, "--trainer.strategy=ddp_spawn", "--trainer.devices=2", *run_args(tmp_path),
        fresh=True,  # the launcher is the promise
    )  # fmt: skip
    assert result.returncode == 0, result.stdout
    assert torch.load(tmp_path / "checkpoints" / "test" / "last.ckpt")["global_step"] == 2


@pytest.mark.parametrize("spawned", [False, True])
def test_a_spawned_rank_ends_its_process_groups_as_its_trainer_tears_down(spawned, monkeypatch, tmp_path):
    """The ranks ``ddp_spawn`` starts never return to ``commands.main``, which ends every other process's groups:
    ``EndSpawnedProcessGroups`` ends theirs (without it, a rank aborted at exit 1 run in 12 on torch 2.11), and
    leaves any other process's to ``main``, whose barrier its other ranks would otherwise wait at alone."""
    from multigpu.run import spawned_ranks

    monkeypatch.setattr(spawned_ranks, "parent_process", lambda: object() if spawned else None)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        spawned_ranks.EndSpawnedProcessGroups().teardown(None, None, "fit")
        assert dist.is_initialized() is not spawned
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _in_process(subcommand: str, tmp_path: Path, *args: str) -> None:
    cli_main(subcommand, "--config", SMOKE, *run_args(tmp_path), *args)


def test_accumulation_clipping_and_16_mixed_then_validate_test_predict(tmp_path, capsys):
    _in_process(
        "fit",
        tmp_path,
        "--trainer.accumulate_grad_batches=2",
        "--trainer.gradient_clip_val=1.0",
        "--trainer.precision=16-mixed",
    )
    checkpoint = torch.load(tmp_path / "checkpoints" / "test" / "last.ckpt")
    assert checkpoint["global_step"] == 2  # 4 batches, 2 per optimizer step
    assert checkpoint["multigpu"]["global_batch_size"] == 16
    for subcommand in ("validate", "test", "predict"):
        _in_process(subcommand, tmp_path, "--ckpt_path=last")
    out = capsys.readouterr().out
    assert "val/acc" in out and "test/acc" in out


def test_resume_follows_the_command_line_and_refuses_another_network(tmp_path, capsys, caplog):
    _in_process("fit", tmp_path)
    _in_process("fit", tmp_path, "--ckpt_path=last", "--trainer.max_epochs=2", "--model.label_smoothing=0.1")
    assert "Model options changed since" in caplog.text and "label_smoothing 0.0 -> 0.1" in caplog.text
    last = tmp_path / "checkpoints" / "test" / "last.ckpt"
    assert torch.load(last)["hyper_parameters"]["label_smoothing"] == 0.1

    before = last.read_bytes()
    for other, said in (
        ("--model.stem=imagenet", "holds another network (stem cifar, not imagenet): use it with --model.stem=cifar"),
        (
            "--model.arch=resnet18",
            "holds another network (arch helpers.tiny_resnet, not resnet18): use it with "
            "--model.arch=helpers.tiny_resnet",
        ),
        (
            "--data.dataset=cifar100",
            "holds another network (num_classes 10, not 100): use it with the data it trained on",
        ),
    ):
        for subcommand, limits in (("fit", ["--trainer.max_epochs=3"]), ("test", [])):
            with pytest.raises(SystemExit) as exit_info:
                _in_process(subcommand, tmp_path, "--ckpt_path=last", *limits, other)
            assert exit_info.value.code == 2
            error = capsys.readouterr().err.strip().splitlines()
            assert len(error) == 1 and said in error[0], (other, subcommand, error)
    assert last.read_bytes() == before

    # Another run's checkpoint file: the command goes on with that run, and says so.
    caplog.clear()
    with caplog.at_level(logging.INFO):
        cli_main("test", "--config", SMOKE, *run_args(tmp_path, "mine"), f"--ckpt_path={last}")
    assert f"{last} is run test's checkpoint: test goes on with run test (its checkpoints" in caplog.text
    assert not (tmp_path / "logs" / "mine").exists() and not (tmp_path / "checkpoints" / "mine").exists()


def test_a_finished_run_stays_finished(tmp_path, caplog):
    """The same command with `--ckpt_path last` on a run that reached max_epochs (then max_steps) says so in
    one line and leaves every file of its checkpoint folder byte for byte as it was."""
    folder = tmp_path / "checkpoints" / "test"

    def files() -> dict[str, bytes]:
        return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}

    for limits, knob in (
        (["--trainer.max_epochs=1"], "max_epochs=1 epoch(s) (step 4); raise --trainer.max_epochs to"),
        (["--trainer.max_epochs=3", "--trainer.max_steps=6"], "max_steps=6 (step 6); raise --trainer.max_steps to"),
    ):
        _in_process("fit", tmp_path, *limits, "--ckpt_path=last")
        before = files()
        caplog.clear()
        with caplog.at_level(logging.INFO):
            _in_process("fit", tmp_path, *limits, "--ckpt_path=last")
        assert "Run test has already finished" in caplog.text and "Nothing to do" in caplog.text, limits
        assert knob in caplog.text and caplog.text.count("--trainer.max_") == 1, caplog.text
        assert files() == before, limits
    assert torch.load(folder / "last.ckpt")["global_step"] == 6  # max_steps=6 trained on from step 4


def test_fsdp2s_view_warning_is_kept_off_the_console_for_every_wrapped_block():
    """torchvision's blocks (``FSDPSequential``) as well as ours: every family trains under fsdp as on one device
    (test_networks.py), so no such view is written in place. Other warnings still show."""
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")  # before the console's filters, which come first
        quiet_console()
        for block in ("FSDPSequential", "FSDPBottleneckEntry", "FSDPBasicBlock"):
            warnings.warn(f"FSDP2-wrapped module ({block}) returned a view tensor, which ...", UserWarning)
        warnings.warn("another warning", UserWarning)
    assert [str(warning.message) for warning in shown] == ["another warning"]
