"""manual_model_parallel: the same parameters as one device, a printed split, portable checkpoints, clear errors."""

import logging
import re
import time

import pytest
import torch
from helpers import RESNET50, SMOKE, bare_trainer, cli_error, cli_main, run_args, run_cli
from lightning.pytorch import Callback, LightningModule, seed_everything
from torch import nn
from torch.utils.data import DataLoader
from typing_extensions import override

from multigpu.data.synthetic import SyntheticCIFAR10
from multigpu.errors import UsageError
from multigpu.model.classifier import ImageClassifier
from multigpu.strategies import ManualModelParallelStrategy

pytestmark = pytest.mark.internals  # CI runs these on the lowest torch we declare too

SPLIT_TABLE_HEADER = re.compile(r"^stage +device +blocks +params +time$", re.MULTILINE)


def _hooked_blocks(net: nn.Sequential) -> list[int]:
    return [index for index, block in enumerate(net) if block._forward_pre_hooks]


class _CheckStageHooks(Callback):
    """During training, the first block of each later stage moves its input to the stage's device."""

    def __init__(self, first_blocks: list[int]) -> None:
        self.first_blocks = first_blocks

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        assert _hooked_blocks(pl_module.net) == self.first_blocks


def _train_resnet(strategy, devices: int, precision: str, accumulate: int, clip: float | None, callbacks=()):
    seed_everything(0)
    model = ImageClassifier(batch_size=4, stem="imagenet", warmup_epochs=0)
    trainer = bare_trainer(
        strategy,
        devices,
        3,
        precision=precision,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        callbacks=list(callbacks),
    )
    trainer.fit(model, DataLoader(SyntheticCIFAR10(24, seed=1), batch_size=4))
    return model


@pytest.mark.parametrize(("precision", "accumulate", "clip"), [("32-true", 1, None), ("bf16-mixed", 2, 0.5)])
def test_split_over_two_devices_trains_exactly_like_one_device(precision, accumulate, clip, caplog):
    reference = _train_resnet("auto", 1, precision, accumulate, clip)
    strategy = ManualModelParallelStrategy(balance=[10, 24])
    # Two CPU devices that compare unequal, so the activations' moves between stages are in place.
    strategy.parallel_devices = [torch.device("cpu", 0), torch.device("cpu", 1)]
    with caplog.at_level(logging.INFO):
        split = _train_resnet(strategy, 2, precision, accumulate, clip, [_CheckStageHooks([10])])
    assert "balance [10, 24]" in caplog.text and SPLIT_TABLE_HEADER.search(caplog.text)
    assert re.search(r"^1 +cpu:1 +10-33 ", caplog.text, re.MULTILINE)
    assert _hooked_blocks(split.net) == []  # removed at the end
    expected = reference.state_dict()
    for name, tensor in split.state_dict().items():  # parameters and BatchNorm statistics
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.slow
def test_two_processes_of_two_stages_equal_one_process_on_both_shards(train_setup):
    reference, split = train_setup("single"), train_setup("mmp_2x2")
    assert split.keys() == reference.keys() - {"clip_grad_norm"}  # parameters, buffers, the logged gradient norms
    torch.testing.assert_close(split, {name: reference[name] for name in split}, rtol=0, atol=1e-6)


class _Slow(nn.Module):
    """A block with no parameters that takes most of the time, and records the dtype of what it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.dtypes.add(x.dtype)
        time.sleep(0.02)
        return x


def test_balance_by_parameters_and_by_time_differ_on_blocks_of_unequal_cost(caplog):
    def fit(precision: str = "32-true", **options) -> tuple[str, _Slow, LightningModule]:
        slow = _Slow()
        module = _Unsplittable(nn.Sequential(slow, nn.Linear(4, 64), nn.Linear(64, 64), nn.Linear(64, 2)))
        module.example_input_array = torch.zeros(2, 4)
        caplog.clear()
        with caplog.at_level(logging.INFO):
            _fit_tiny(ManualModelParallelStrategy(**options), devices=2, module=module, precision=precision)
        return next(line for line in caplog.text.splitlines() if "balance" in line), slow, module

    # Parameters 0, 320, 4160, 130: by parameters [2, 2] holds at most 4290 per stage. The first block holds
    # none but takes most of the time, so by time it is a stage of its own.
    assert fit(balance_by="params")[0].endswith("balance [2, 2] (by params)")
    assert fit(balance_by="time")[0].endswith("balance [1, 3] (by time)")
    line, slow, module = fit(precision="bf16-true")
    assert line.endswith("balance [1, 3] (by time)")
    # Timed and trained in the precision asked for: the example input follows the parameters' dtype.
    assert slow.dtypes == {torch.bfloat16}
    assert {parameter.dtype for parameter in module.parameters()} == {torch.bfloat16}


@pytest.mark.slow
def test_cli_trains_prints_its_split_and_resumes_under_ddp(tmp_path):
    """ConvNeXt-Tiny (``--model.arch``), on the smoke preset."""
    args = ["fit", "--config", SMOKE, "--trainer.accelerator=cpu", "--trainer.devices=2", *run_args(tmp_path)]
    args.append("--model.arch=convnext_tiny")
    first = run_cli(*args, "--trainer.strategy=manual_model_parallel", "--trainer.strategy.balance_by=params")
    assert first.returncode == 0, first.stdout
    assert "manual_model_parallel: 2 stages per replica, 1 replica(s)" in first.stdout
    # One process: no distributed start-up lines, nor who started the processes.
    assert "MEMBER: 1/1" not in first.stdout and "Starting with 1 processes" not in first.stdout, first.stdout
    assert "process(es) on" not in first.stdout, first.stdout
    assert SPLIT_TABLE_HEADER.search(first.stdout)
    resumed = run_cli(*args, "--trainer.strategy=ddp", "--ckpt_path=last", "--trainer.max_epochs=2")
    assert resumed.returncode == 0, resumed.stdout
    assert "Restored all states" in resumed.stdout and "epoch 1 | step 6" in resumed.stdout
    assert (
        "Resuming with another layout (strategy ManualModelParallelStrategy -> DDPStrategy, world size 1 -> 2, "
        "replicas 1 -> 2): kept images per forward pass 8, changed the global batch 8 -> 16, the learning rate keeps "
        "the checkpoint's scaling." in resumed.stdout
    )


def test_checkpoints_round_trip_with_single_device(tmp_path):
    """ResNet-50 itself, split in two halves of its 34 blocks: model parallel at the real layout."""
    args = ["fit", "--config", SMOKE, *run_args(tmp_path), *RESNET50]
    last = tmp_path / "checkpoints" / "test" / "last.ckpt"
    cli_main(*args)
    single_keys = torch.load(last)["state_dict"].keys()
    split = ["--trainer.strategy=manual_model_parallel", "--trainer.devices=2", "--trainer.strategy.balance=[17,17]"]
    cli_main(*args, *split, "--ckpt_path=last", "--trainer.max_epochs=2")
    checkpoint = torch.load(last)
    assert checkpoint["global_step"] == 8 and checkpoint["state_dict"].keys() == single_keys
    assert checkpoint["multigpu"]["strategy"] == "ManualModelParallelStrategy"
    cli_main(*args, "--ckpt_path=last", "--trainer.max_epochs=3")
    assert torch.load(last)["global_step"] == 12


class _Unsplittable(LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_tiny(strategy, devices: int, module: LightningModule | None = None, precision: str = "32-true") -> None:
    if module is None:
        module = _Unsplittable(nn.Sequential(nn.Linear(4, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 2)))
        module.example_input_array = torch.zeros(2, 4)
    trainer = bare_trainer(strategy, devices, 1, precision=precision, use_distributed_sampler=True)
    trainer.fit(module, DataLoader([(torch.zeros(4),)] * 4, batch_size=2))


def test_errors_in_the_request(capsys, tmp_path):
    run = [*run_args(tmp_path), *RESNET50]  # its 34 blocks
    strategy = "--trainer.strategy=manual_model_parallel"
    error = cli_error(capsys, strategy, "--trainer.strategy.devices_per_replica=2", "--trainer.devices=3", *run)
    assert error == (
        "error: --trainer.devices=3 is not a multiple of the 2 devices per replica of manual_model_parallel: "
        "use a multiple of 2, or change devices_per_replica (or balance)."
    )
    error = cli_error(capsys, strategy, "--trainer.strategy.balance=[5,5]", "--trainer.devices=2", *run)
    assert error == "error: balance [5, 5] sums to 10, but the network has 34 blocks."
    error = cli_error(capsys, strategy, "--trainer.devices=35", *run)
    assert error == "error: 35 stages need at least 35 blocks, but the network has 34."
    with pytest.raises(UsageError, match=r"balance \[17, 17\] has 2 stages, but devices_per_replica=3 asks for 3"):
        ManualModelParallelStrategy(balance=[17, 17], devices_per_replica=3)


def test_errors_in_the_network():
    with pytest.raises(UsageError, match="_Unsplittable.net must be an nn.Sequential of blocks, not Linear"):
        _fit_tiny(ManualModelParallelStrategy(), 2, _Unsplittable(nn.Linear(4, 2)))
    unsized = _Unsplittable(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    with pytest.raises(UsageError, match="balance_by=time needs the LightningModule's example_input_array"):
        _fit_tiny(ManualModelParallelStrategy(), 2, unsized)


@pytest.mark.slow
@pytest.mark.min_cuda_gpus(2)
@pytest.mark.parametrize("devices_per_replica", [2, 1])
def test_stages_on_two_gpus_fit_then_validate(devices_per_replica, tmp_path):
    args = ["--config", SMOKE, "--trainer.accelerator=cuda", "--trainer.devices=2", *run_args(tmp_path)]
    strategy = [
        "--trainer.strategy=manual_model_parallel",
        f"--trainer.strategy.devices_per_replica={devices_per_replica}",
    ]
    fit = run_cli("fit", *args, *strategy, "--trainer.precision=16-mixed", "--trainer.gradient_clip_val=1.0")
    assert fit.returncode == 0, fit.stdout
    stages, replicas = (2, 1) if devices_per_replica == 2 else (1, 2)
    assert f"manual_model_parallel: {stages} stages per replica, {replicas} replica(s)" in fit.stdout
    # The last stage of each replica is on the replica's last GPU.
    assert re.search(rf"^{stages - 1} +cuda:{2 // replicas - 1} ", fit.stdout, re.MULTILINE)
    validate = run_cli("validate", *args, *strategy, "--ckpt_path=last")
    assert validate.returncode == 0, validate.stdout


@pytest.mark.slow
@pytest.mark.min_cuda_gpus(4)
def test_two_replicas_of_two_gpus(tmp_path):
    result = run_cli(
        "fit",
        "--config",
        SMOKE,
        "--trainer.accelerator=cuda",
        "--trainer.devices=4",
        *run_args(tmp_path),
        "--trainer.strategy=manual_model_parallel",
        "--trainer.strategy.devices_per_replica=2",
        "--data.synthetic_size=64",
    )
    assert result.returncode == 0, result.stdout
    assert "2 stages per replica, 2 replica(s)" in result.stdout


def test_the_network_taken_out_and_put_back_keeps_every_parameters_place():
    """The split strategies move the rest of the module without its network (``_without_child``): put back, every
    parameter and buffer keeps its name and place, which the optimizer's state and the checkpoints follow; a child
    held under two names included."""
    from multigpu.strategies.split_network import _without_child

    module = nn.Module()
    module.head, module.net, module.norm = nn.Linear(2, 2), nn.Linear(3, 3), nn.BatchNorm1d(2)
    module.alias = module.head
    network, before = module.net, list(module.state_dict(keep_vars=True).items())
    with _without_child(module, "net") as net:
        assert net is network and "net" not in dict(module.named_children())
    after = list(module.state_dict(keep_vars=True).items())
    assert [name for name, _ in after] == [name for name, _ in before]
    assert all(tensor is other for (_, tensor), (_, other) in zip(after, before, strict=True))
