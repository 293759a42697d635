"""fsdp (FSDP2 on gloo): the maths of ddp, 1/N of the state per process, checkpoints every strategy reads,
and its bad values refused in one line."""

import pytest
import torch
from helpers import HELPERS_ENV, SMOKE, assert_within_scale, cli_error, cli_main, helper_callback, run_args, run_cli
from lightning.pytorch.plugins import MixedPrecision

from multigpu.checkpointing.sharded_checkpoints import SHARDED, read_checkpoint
from multigpu.errors import UsageError
from multigpu.model.classifier import ImageClassifier
from multigpu.strategies import FullyShardedStrategy

pytestmark = pytest.mark.internals  # CI runs these on the lowest torch we declare too


def _assert_within(found: dict, expected: dict, relative: float) -> None:
    assert any(key.startswith("momentum.") for key in expected)  # the optimizer's state is compared too
    assert_within_scale(found, expected, relative)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sharded", "replicated", "relative"),
    [
        # 2 processes, 2 accumulated batches added up whole as DDP does: the same sums, bit for bit.
        ("bottleneck_fsdp", "bottleneck_ddp", 0),
        ("bottleneck_fsdp_bf16_recomputed_kept", "bottleneck_ddp_bf16_recomputed", 0),
        # Sums in another order than DDP's (strategy_training.py says why not ResNet-50 there).
        ("tiny_fsdp_4", "tiny_ddp_4", 1e-6),  # 4 processes
        ("tiny_fsdp_2x2", "tiny_ddp_4", 1e-6),  # HSDP: 2 replicas of 2 shards
        ("tiny_fsdp_accumulated_clipped", "tiny_ddp_accumulated_clipped", 1e-6),  # sharded while accumulating
    ],
)
def test_fsdp_trains_like_ddp_on_the_same_samples(sharded, replicated, relative, train_setup):
    """Parameters, BatchNorm buffers and momentum after 4 steps: equal, or within ``relative`` of each tensor's
    largest value."""
    _assert_within(train_setup(sharded), train_setup(replicated), relative)


def test_bad_values_are_refused_in_one_line_before_launch(capsys, tmp_path):
    run = [*run_args(tmp_path), "--trainer.accelerator=cpu"]
    fsdp = "--trainer.strategy=fsdp"
    error = cli_error(capsys, fsdp, "--trainer.strategy.shard_size=3", "--trainer.devices=4", *run)
    assert error == (
        "error: fsdp: shard_size=3 does not divide the 4 processes (--trainer.devices x --trainer.num_nodes): "
        "use a divisor of 4."
    )
    error = cli_error(capsys, fsdp, "--trainer.strategy.balance=[17,17]", "--trainer.devices=2", *run)
    assert error == (
        "error: --trainer.strategy.balance: fsdp has no option balance (an option of manual_model_parallel, "
        "pipeline); its options are reshard_after_forward, shard_size, accumulate_whole_gradients, "
        "process_group_backend, sharded_checkpoints."
    )
    error = cli_error(capsys, fsdp, "--trainer.strategy.reshard=yes", "--trainer.devices=2", *run)
    assert error == (
        "error: --trainer.strategy.reshard: fsdp has no option reshard; its options are reshard_after_forward, "
        "shard_size, accumulate_whole_gradients, process_group_backend, sharded_checkpoints."
    )
    with pytest.raises(UsageError, match="cannot run --model.compile"):
        FullyShardedStrategy().check_model(ImageClassifier(compile=True))
    outside = ImageClassifier()
    outside.scale = torch.nn.Parameter(torch.ones(1))
    with pytest.raises(UsageError, match="but scale is outside it: move it into the network"):
        FullyShardedStrategy().check_model(outside)
    # 16-mixed with its loss scaler (on the CPU, Lightning trains bf16-mixed instead, without one).
    scaled = FullyShardedStrategy()
    scaled.precision_plugin = MixedPrecision("16-mixed", "cpu")
    scaled.parallel_devices = [torch.device("cpu")] * 2
    with pytest.raises(UsageError, match="fsdp does not train in 16-mixed"):
        scaled.check_training(None)
    with pytest.raises(UsageError, match="shard_size must be at least 1, not 0"):
        FullyShardedStrategy(shard_size=0)


WRITTEN_BY = {
    "fsdp": "FullyShardedStrategy",
    "1 device": "SingleDeviceStrategy",
    "pipeline": "PipelineStrategy",
    "manual_model_parallel": "ManualModelParallelStrategy",
}


@pytest.mark.slow
def test_checkpoints_move_between_fsdp_and_every_other_strategy_mid_epoch(tmp_path, capsys):
    """One run, a step or two at a time, alternating fsdp with each other strategy: each resumes the other's
    checkpoint, and reads fsdp's, sharded (each process writes its own shard, which the others put together; ddp
    writes and reads what one device does; ddp and fsdp resume each other in test_resume_anywhere). Each part stops
    on SIGTERM, as a job's end does (a step earlier for several processes, which read their stop vote a step later),
    and so in the middle of an epoch: every layout trains the same global batch of
    8, and 32 images are 4 steps. Each strategy's checkpoint also exports, tensor for tensor, to the network's own
    names (ResNet-50's into torchvision's resnet50: test_use_model)."""
    args = ["fit", "--config", SMOKE, "--trainer.accelerator=cpu", *run_args(tmp_path), "--trainer.max_epochs=9"]
    two, four, eight, by_params = (
        "--trainer.devices=2",
        "--data.batch_size=4",
        "--data.batch_size=8",
        "--trainer.strategy.balance_by=params",
    )
    fsdp = ("fsdp", ["--trainer.strategy=fsdp", two, four])
    one_device = ("1 device", ["--trainer.strategy=auto", "--trainer.devices=1", eight])
    pipeline = ("pipeline", ["--trainer.strategy=pipeline", two, eight, by_params])
    model_parallel = ("manual_model_parallel", ["--trainer.strategy=manual_model_parallel", two, eight, by_params])
    chain = [one_device, fsdp, pipeline, fsdp, model_parallel, fsdp, one_device]
    several = ("fsdp", "pipeline")  # processes that read their stop vote a step later, but at an epoch's end
    step = 0
    for name, strategy in chain:
        start, step = step, step + (2 if name in several and (step + 1) % 4 else 1)
        stop = helper_callback(tmp_path, "KillAt", step=start, moment="sigterm")  # in the part's first step
        result = run_cli(*args, *strategy, "--config", stop, "--ckpt_path=last", env=HELPERS_ENV)
        assert result.returncode == 0, f"{name}: {result.stdout}"
        assert "returned a view tensor" not in result.stdout, name  # FSDP2's warning: our blocks do no in-place op
        if start:
            assert f"at step {start}." in result.stdout and "kept the global batch 8" in result.stdout, name
        last = tmp_path / "checkpoints" / "test" / "last.ckpt"
        written = torch.load(last)
        if name == "fsdp":  # each process wrote its own shard; the file names their folder, the one left
            assert "state_dict" not in written and written[SHARDED]["processes"] == 2, name
            # the one it names, and at most the one before (kept for a reader of the file before)
            folders = list((tmp_path / "checkpoints" / "test" / "last.ckpt.shards").iterdir())
            named = tmp_path / "checkpoints" / "test" / written[SHARDED]["folder"]
            assert named in folders and len(folders) <= 2, name
            assert sorted(file.name for file in named.iterdir()) == ["rank0.pt", "rank1.pt"], name
        else:
            assert "state_dict" in written and SHARDED not in written, name
        checkpoint = read_checkpoint(last)
        assert checkpoint["global_step"] == step, f"{name}: {result.stdout[-3000:]}"
        position = {"epoch": step // 4, "position": step % 4 * 8, "global_batch": 8, "shuffle_seed": 42}
        assert checkpoint["multigpu"]["order"] == position, name
        assert checkpoint["multigpu"]["strategy"] == WRITTEN_BY[name]
        if name != "fsdp" or start == 1:
            out = tmp_path / f"exported-{step}.pt"
            cli_main("export", "--config", SMOKE, *run_args(tmp_path), "--to=torchvision", f"--out={out}")
            assert f": wrote {out}, {out}.input.json; " in capsys.readouterr().out, name
            exported = torch.load(out, weights_only=True)  # tiny_resnet's own names: those of its blocks
            network = {key[4:]: value for key, value in checkpoint["state_dict"].items() if key.startswith("net.")}
            torch.testing.assert_close(exported, network, rtol=0, atol=0, msg=lambda message: f"{name}: {message}")
