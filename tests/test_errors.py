"""Each bad request ends with one ``error:`` line and exit status 2, before training."""

import pytest
import torch
from helpers import SMOKE, cli_error, cli_main, run_args


def test_wrong_config_key(capsys, tmp_path):
    assert "--model.lerning_rate" in cli_error(capsys, *["--model.lerning_rate=0.1"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  lerning_rate: 0.1\n")
    assert "lerning_rate" in cli_error(capsys, *["--config", str(bad)])
    broken = tmp_path / "broken.yaml"
    broken.write_text("trainer:\n  max_epochs: 2\n bad: [\n")
    assert cli_error(capsys, *["--config", str(broken)]).startswith(f"error: --config {broken}, line 3, column 2: ")


def test_impossible_device_count(capsys, tmp_path):
    """One GPU more than the machine has: no CUDA at all, or too few GPUs; one line either way."""
    visible = torch.cuda.device_count()
    error = cli_error(capsys, *["--trainer.accelerator=cuda", f"--trainer.devices={visible + 1}", *run_args(tmp_path)])
    if visible:
        assert error == (
            f"error: --trainer.devices={visible + 1} asks for {visible + 1} cuda devices, but this "
            f"machine has {visible}: pass at most {visible}, or auto."
        )
    else:
        assert error.startswith("error: --trainer.accelerator=cuda: CUDAAccelerator is not available")


def test_sync_batchnorm_on_the_cpu(capsys, tmp_path):
    error = cli_error(capsys, *["--trainer.sync_batchnorm=true", *run_args(tmp_path)])
    assert error == "error: --trainer.sync_batchnorm=true needs CUDA devices (SyncBatchNorm); drop it on the CPU."


def test_missing_dataset_stops_before_the_model_is_built(capsys, tmp_path, monkeypatch):
    def built(*args, **kwargs):
        raise AssertionError("the model was built before the data was checked")

    monkeypatch.setattr("multigpu.model.network_options.network_blocks", built)
    args = ["--data.synthetic=false", f"--data.data_dir={tmp_path / 'none'}", "--data.download=false"]
    error = cli_error(capsys, *[*args, *run_args(tmp_path)])
    assert error.startswith("error: CIFAR-10 is not in") and str(tmp_path / "none") in error


def test_corrupt_checkpoint(capsys, tmp_path):
    corrupt = tmp_path / "corrupt.ckpt"
    corrupt.write_bytes(b"\x00" * 100)
    error = cli_error(capsys, *[f"--ckpt_path={corrupt}", *run_args(tmp_path)])
    assert error.startswith(f"error: checkpoint {corrupt} cannot be read")


BAD_VALUES = {
    "--trainer.devices=-3": "--trainer.devices=-3 is not a number of devices",
    "--trainer.devices=0": "--trainer.devices=0 is not a number of devices",
    "--trainer.devices=[7]": "--trainer.devices=[7] lists device indices, which only GPUs have",
    "--trainer.devices=two": "--trainer.devices=two is not a device request",
    "--trainer.accelerator=tpu": "--trainer.accelerator=tpu: XLAAccelerator is not available",
    "--trainer.accelerator=abacus": "--trainer.accelerator=abacus is not an accelerator",
    "--trainer.strategy=ddp --trainer.devices=-1": "--trainer.devices=-1 is not a number of devices",
    "--model.base_lr=-0.1": "model.base_lr must be at least 0, not -0.1",
    "--model.momentum=-0.9": "model.momentum must be at least 0, not -0.9",
    "--model.weight_decay=-1e-4": "model.weight_decay must be at least 0, not -0.0001",
    "--model.warmup_epochs=-1": "model.warmup_epochs must be at least 0, not -1.0",
    "--model.label_smoothing=1.5": "model.label_smoothing must be in [0, 1), not 1.5",
    "--model.label_smoothing=1": "model.label_smoothing must be in [0, 1), not 1.0",
    "--model.label_smoothing=-0.1": "model.label_smoothing must be in [0, 1), not -0.1",
    "--model.stem=resnet": "--model.stem: Expected a typing.Literal['cifar', 'imagenet']. Got value: resnet",
    "--data.num_workers=-1": "data.num_workers must be at least 0, not -1",
    "--data.batch_size=0": "data.batch_size must be at least 1, not 0",
    "--trainer.strategy=pipe": "--trainer.strategy=pipe is not a strategy (did you mean pipeline?): use auto, ddp,",
    "--trainer.strategy=dpp": "--trainer.strategy=dpp is not a strategy (did you mean dp or ddp?)",
    "--trainer.max_stpes=2": "unrecognized arguments: --trainer.max_stpes=2; --trainer.max_stpes: did you mean "
    "--trainer.max_steps?",
    "--trainer.max_step=2": "unrecognized arguments: --trainer.max_step=2",  # a prefix is not the option
    "--data.bach_size=8": "unrecognized arguments: --data.bach_size=8; --data.bach_size: did you mean "
    "--data.batch_size?",
    "--trainer.accumulate_grad_batches=0": "--trainer.accumulate_grad_batches must be at least 1, not 0",
    "--trainer.gradient_clip_val=-1": "--trainer.gradient_clip_val must be at least 0, not -1",
    "--trainer.precision=17": "--trainer.precision=17 is not one this application trains in: use 32-true, 16-mixed",
    "--trainer.precision=fp16": "--trainer.precision=fp16 is not one this application trains in: use 32-true,",
    "--trainer.num_nodes=0": "--trainer.num_nodes must be at least 1, not 0",
    "--trainer.max_epochs=-5": "--trainer.max_epochs must be at least -1, not -5",
    "--trainer.max_epochs=-1": "the cosine learning-rate schedule needs an end",
    "--model.momentum=0": "model.nesterov=true needs model.momentum above 0",
    "--throughput.peak_flops=-1": "throughput.peak_flops must be a positive FLOP/s figure",
    "--trainer.check_val_every_n_epoch=0": "--trainer.check_val_every_n_epoch must be at least 1, not 0",
    "--trainer.strategy=pipeline --trainer.strategy.micro_batches=0": "micro_batches must be at least 1, not 0",
    "--save_every_n_steps=-1": "--save_every_n_steps must be at least 0, not -1",
    "--data.dataset=imagefolder": "data.synthetic=true (configs/smoke.yaml sets it) stands in for CIFAR: add "
    "--data.synthetic=false",
    "--checkpoint_root=/dev/null/checkpoints": "--checkpoint_root=/dev/null/checkpoints: /dev/null cannot be written",
    "--trainer.default_root_dir=/dev/null/logs": "--trainer.default_root_dir=/dev/null/logs: /dev/null cannot be",
}


def test_every_bad_value_ends_with_one_error_line_and_writes_nothing(capsys, tmp_path, monkeypatch):
    """Each invocation: exactly one `error:` line on stderr, exit status 2, and no file anywhere under its folder."""
    for arguments, expected in BAD_VALUES.items():
        folder = tmp_path / arguments.replace("=", "_").replace(" ", "").replace("/", "_")
        folder.mkdir()
        monkeypatch.chdir(folder)
        with pytest.raises(SystemExit) as exit_info:
            cli_main("fit", "--config", SMOKE, *run_args(folder), *arguments.split())
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert exit_info.value.code == 2, arguments
        assert len(errors) == 1 and errors[0].startswith(f"error: {expected}"), (arguments, errors)
        assert not [path for path in folder.rglob("*") if path.is_file()], arguments
        if arguments == "--trainer.strategy=pipe":  # our strategies are among the names to choose from
            assert errors[0].endswith(
                "dp, manual_model_parallel, pipeline, or another of Lightning's registered names."
            )


def test_a_checkpoint_that_would_run_code_is_refused_unread(capsys, tmp_path):
    """Unpickling this file would create `created`: every subcommand refuses it with one line, and the file
    is never created."""
    created = tmp_path / "created"

    class CreatesAFile:
        def __reduce__(self):
            return open, (str(created), "w")

    crafted = tmp_path / "crafted.ckpt"
    torch.save({"state_dict": {}, "epoch": 0, "global_step": 0, "payload": CreatesAFile()}, crafted)
    for subcommand in ("fit", "validate"):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(subcommand, "--config", SMOKE, f"--ckpt_path={crafted}", *run_args(tmp_path))
        assert exit_info.value.code == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert errors == [
            f"error: checkpoint {crafted} holds objects other than tensors and plain values (io.open); loading it "
            f"could run code, so it is refused. Pass a checkpoint written by this application with --ckpt_path."
        ]
        assert not created.exists()
