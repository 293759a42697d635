"""Each bad request ends with one ``error:`` line and exit status 2, before training."""

import torch

from conftest import cli_error, run_args


def test_wrong_config_key(capsys, tmp_path):
    assert "--model.lerning_rate" in cli_error(capsys, *["--model.lerning_rate=0.1"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  lerning_rate: 0.1\n")
    assert "lerning_rate" in cli_error(capsys, *["--config", str(bad)])


def test_impossible_device_count(capsys, tmp_path):
    """One GPU more than the machine has: no CUDA at all, or too few GPUs; one line either way."""
    visible = torch.cuda.device_count()
    error = cli_error(capsys, *["--trainer.accelerator=cuda", f"--trainer.devices={visible + 1}", *run_args(tmp_path)])
    if visible:
        assert error == (f"error: --trainer.devices={visible + 1} asks for {visible + 1} cuda devices, but this "
                         f"machine has {visible}: pass at most {visible}, or auto.")
    else:
        assert error.startswith("error: --trainer.accelerator=cuda: CUDAAccelerator is not available")


def test_sync_batchnorm_on_the_cpu(capsys, tmp_path):
    error = cli_error(capsys, *["--trainer.sync_batchnorm=true", *run_args(tmp_path)])
    assert error == "error: --trainer.sync_batchnorm=true needs CUDA devices (SyncBatchNorm); drop it on the CPU."


def test_missing_dataset_stops_before_the_model_is_built(capsys, tmp_path, monkeypatch):
    def built(*args, **kwargs):
        raise AssertionError("the model was built before the data was checked")

    monkeypatch.setattr("multigpu.model.resnet50_blocks", built)
    args = ["--data.synthetic=false", f"--data.data_dir={tmp_path / 'none'}", "--data.download=false"]
    error = cli_error(capsys, *[*args, *run_args(tmp_path)])
    assert error.startswith("error: CIFAR-10 is not in") and str(tmp_path / "none") in error


def test_corrupt_checkpoint(capsys, tmp_path):
    corrupt = tmp_path / "corrupt.ckpt"
    corrupt.write_bytes(b"\x00" * 100)
    error = cli_error(capsys, *[f"--ckpt_path={corrupt}", *run_args(tmp_path)])
    assert error.startswith(f"error: checkpoint {corrupt} cannot be read")
