"""dp: plain state dicts, checkpoints that every strategy loads, one device without CUDA, a real scatter on GPUs."""

import pytest
import torch
from helpers import SMOKE, cli_error, cli_main, run_args
from lightning.pytorch import Trainer, seed_everything
from strategy_training import TinyBlocks
from torch.utils.data import DataLoader, TensorDataset

from multigpu.model.classifier import ImageClassifier
from multigpu.strategies import DataParallelStrategy
from multigpu.strategies.data_parallel.strategy import TransparentDataParallel


def test_wrapped_network_saves_and_loads_plain_state_dicts():
    model = ImageClassifier(stem="imagenet")
    model.configure_model()
    plain = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    # DataParallel takes no device list without CUDA, and needs one with it; nothing runs forward here.
    model.net = TransparentDataParallel(
        model.net, device_ids=[0] if torch.cuda.is_available() else [], output_device=None
    )
    assert model.state_dict().keys() == plain.keys()
    with torch.no_grad():
        model.net.module[0][0].weight.zero_()
    model.load_state_dict(plain)  # keys without the `module.` prefix load into the wrapped network
    assert torch.equal(model.net.module[0][0].weight.cpu(), plain["net.0.0.weight"])


def test_dp_without_cuda_warns_trains_on_one_device_and_shares_checkpoints(tmp_path):
    args = ["fit", "--config", SMOKE, *run_args(tmp_path)]
    last = tmp_path / "checkpoints" / "test" / "last.ckpt"
    with pytest.warns(UserWarning, match="strategy dp needs CUDA devices; it trains on one cpu device instead"):
        cli_main(
            *args,
            "--trainer.strategy=dp",
            "--trainer.devices=2",
            "--trainer.precision=bf16-mixed",
            "--trainer.gradient_clip_val=1.0",
        )
    checkpoint = torch.load(last)
    assert checkpoint["global_step"] == 4 and checkpoint["multigpu"]["strategy"] == "DataParallelStrategy"
    assert not [name for name in checkpoint["state_dict"] if "module." in name]
    cli_main(*args, "--ckpt_path=last", "--trainer.max_epochs=2")  # dp -> one device
    dp = ["--trainer.strategy=dp", "--trainer.accumulate_grad_batches=2"]
    cli_main(*args, *dp, "--ckpt_path=last", "--trainer.max_epochs=3")  # and back
    assert torch.load(last)["global_step"] == 10


def _train_tiny_on_cuda(strategy, devices: int, dtypes: list) -> TinyBlocks:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=generator), torch.randint(0, 4, (64,), generator=generator))
    seed_everything(0)
    model = TinyBlocks()
    model.net[1].register_forward_hook(lambda module, args, output: dtypes.append(output.dtype))
    trainer = Trainer(
        accelerator="cuda",
        devices=devices,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=16))
    return model.cpu()


@pytest.mark.min_cuda_gpus(2)
def test_dp_scatters_over_two_gpus_in_bf16_like_one_gpu():
    single_dtypes, dp_dtypes = [], []
    single = _train_tiny_on_cuda("auto", 1, single_dtypes)
    scattered = _train_tiny_on_cuda(DataParallelStrategy(), 2, dp_dtypes)
    assert set(dp_dtypes) == set(single_dtypes) == {torch.bfloat16}  # the replicas' threads too
    assert len(dp_dtypes) == 2 * len(single_dtypes)  # one call per replica
    torch.testing.assert_close(scattered.state_dict(), single.state_dict(), rtol=0.02, atol=1e-3)


@pytest.mark.min_cuda_gpus(1)
@pytest.mark.parametrize("strategy", ["dp", "manual_model_parallel"])
def test_one_gpu_trains_in_bf16(strategy, tmp_path):
    cli_main(
        "fit",
        "--config",
        SMOKE,
        "--trainer.accelerator=cuda",
        "--trainer.devices=1",
        "--trainer.precision=bf16-mixed",
        f"--trainer.strategy={strategy}",
        *run_args(tmp_path),
    )
    assert torch.load(tmp_path / "checkpoints" / "test" / "last.ckpt")["global_step"] == 4


def test_dp_refuses_several_processes_or_machines(capsys, tmp_path, monkeypatch):
    args = ["--trainer.strategy=dp", *run_args(tmp_path)]
    error = cli_error(capsys, *args, "--trainer.num_nodes=2")
    assert error == "error: dp runs in one process on one machine, not 2: use ddp across machines."
    torchrun = {
        "WORLD_SIZE": "2",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "GROUP_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "TORCHELASTIC_RUN_ID": "test",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29555",
    }
    for name, value in torchrun.items():
        monkeypatch.setenv(name, value)
    error = cli_error(capsys, *args)
    assert error == (
        "error: dp runs in one process, but TorchElasticEnvironment started 2: start one process per machine, "
        "or use ddp."
    )
