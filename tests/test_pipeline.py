"""pipeline: one process per stage, the maths of one device, checkpoints shared with DDP, clear errors."""

import re
import time

import pytest
import torch
from helpers import RESNET50, SMOKE, cli_error, cli_main, run_args, run_cli
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from multigpu.model.deferred_batch_norm import defer_batch_norm
from multigpu.strategies.pipeline.schedule_clock import ScheduleClock, ideal_idle_share
from multigpu.strategies.pipeline.stage_placement import StagePlacement

pytestmark = pytest.mark.internals  # CI runs these on the lowest torch we declare too


@pytest.mark.slow
@pytest.mark.parametrize("setup", ["pipe_gpipe", "pipe_1f1b", "pipe_2x2"])
def test_pipeline_trains_like_one_process(setup, train_setup):
    """2 stages (and 2 stages x 2 replicas) against one process on the same samples."""
    reference, piped = train_setup("single"), train_setup(setup)
    assert piped.keys() == reference.keys() - {"clip_grad_norm"}  # parameters, buffers, the logged gradient norms
    torch.testing.assert_close(piped, {name: reference[name] for name in piped}, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_clipping_takes_the_norm_over_all_stages_in_bf16_with_accumulation(train_setup):
    reference, piped = train_setup("single_clipped"), train_setup("pipe_clipped")
    torch.testing.assert_close(piped, {name: reference[name] for name in piped}, rtol=0, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("accumulated", "piped"),
    [("bottleneck_accumulated", "bottleneck_pipe_gpipe"), ("resnet50_accumulated", "resnet50_pipe_1f1b")],
)
def test_a_resnet_pipeline_equals_one_device_accumulating_the_micro_batches(accumulated, piped, train_setup):
    """With BatchNorm, each micro-batch is normalised on its own, as when one device accumulates them: ResNet-50's
    blocks at 4 to 8 channels under GPipe, and ResNet-50 itself under 1F1B, each split inside a bottleneck."""
    reference, piped = train_setup(accumulated), train_setup(piped)
    assert piped.keys() == reference.keys()
    for name, tensor in piped.items():  # parameters, BatchNorm statistics, batch counters
        assert torch.equal(tensor, reference[name]), name


@pytest.mark.slow
def test_cli_trains_evaluates_and_shares_checkpoints_with_ddp_and_one_device(tmp_path):
    """ResNet-50's blocks at 4 to 8 channels (``--model.arch=helpers.tiny_resnet``), on the smoke preset."""
    args = ["--config", SMOKE, "--trainer.accelerator=cpu", *run_args(tmp_path)]
    pipeline = ["--trainer.strategy=pipeline", "--trainer.devices=2"]
    last = tmp_path / "checkpoints" / "test" / "last.ckpt"
    first = run_cli("fit", *args, *pipeline)
    assert first.returncode == 0, first.stdout
    assert "pipeline: 2 stages over 2 processes, schedule 1f1b, 1 replica(s), 4 micro-batches" in first.stdout
    assert re.search(r"^stage +device +blocks +params +time$", first.stdout, re.MULTILINE)
    assert "Total params" in first.stdout and "Total FLOPs" not in first.stdout  # none counted: no "0"
    # At each log step, each process's idle share of the schedule's step and 1F1B's bubble over 2 stages and 4
    # micro-batches, 1/5; each process's memory.
    logged = EventAccumulator(str(tmp_path / "logs" / "test" / "version_0"))
    logged.Reload()
    scalars = {tag: [event.value for event in logged.Scalars(tag)] for tag in logged.Tags()["scalars"]}
    for rank in (0, 1):
        assert len(scalars[f"perf/pipeline/idle_share/rank{rank}"]) == 4  # the smoke preset's steps
        assert all(0 < share < 1 for share in scalars[f"perf/pipeline/idle_share/rank{rank}"])
        assert scalars[f"perf/pipeline/idle_share_ideal/rank{rank}"] == [pytest.approx(0.2)] * 4
        assert f"perf/step/resident_memory_gib/rank{rank}" in scalars
    # Under several processes, the slowest and the fastest process's step time and wait for the loader.
    slowest, fastest = scalars["perf/step/seconds_max"], scalars["perf/step/seconds_min"]
    assert len(slowest) == 4 and all(high >= low > 0 for high, low in zip(slowest, fastest))
    waits = zip(scalars["perf/step/data_wait_share_max"], scalars["perf/step/data_wait_share_min"])
    assert all(1 >= high >= low >= 0 for high, low in waits)
    checkpoint = torch.load(last)
    # The gathered optimizer state holds every parameter's momentum, from both stages.
    assert len(checkpoint["optimizer_states"][0]["state"]) == len(
        [k for k in checkpoint["state_dict"] if "running" not in k and "num_batches" not in k]
    )
    resumed = run_cli(
        "fit", *args, "--trainer.strategy=ddp", "--trainer.devices=2", "--ckpt_path=last", "--trainer.max_epochs=2"
    )
    assert resumed.returncode == 0 and "Restored all states" in resumed.stdout, resumed.stdout
    back = run_cli("fit", *args, *pipeline, "--ckpt_path=last", "--trainer.max_epochs=3")
    assert back.returncode == 0 and "epoch 2 | step 10" in back.stdout, back.stdout
    # Micro-batches of one image, too small to train and not to evaluate; 11 images: the last batch of 3 is
    # smaller than the 4 micro-batches.
    for subcommand in ("validate", "test", "predict"):
        result = run_cli(
            subcommand,
            *args,
            *pipeline,
            "--ckpt_path=last",
            "--data.batch_size=4",
            "--trainer.strategy.micro_batches=4",
            "--data.synthetic_size=44",
        )
        assert result.returncode == 0, result.stdout
        # Evaluation trains nothing: no training step timed, the split is by parameters.
        assert re.search(r"balance \[\d+, \d+\] \(by params\)", result.stdout), result.stdout
    cli_main("fit", *args, "--ckpt_path=last", "--trainer.max_epochs=4")  # and on one device
    assert torch.load(last)["global_step"] == 14


@pytest.mark.slow
def test_two_stages_per_process_train_and_evaluate_from_the_command_line(tmp_path):
    """The looped and the V-shaped placement, each through training and evaluation (its own forward pass),
    with the fast path's options: channels_last activations are not contiguous, sends need them so. The batch
    of 16 is larger than the 8 validation images: the sanity check's short batch comes before the first
    training batch, which fixes the schedule's shapes."""
    args = [
        "--config",
        SMOKE,
        "--trainer.accelerator=cpu",
        "--trainer.devices=2",
        "--trainer.strategy=pipeline",
        "--trainer.strategy.stages_per_process=2",
        "--model.channels_last=true",
        "--trainer.precision=bf16-mixed",
        *run_args(tmp_path),
        "--data.batch_size=16",
    ]
    fit = run_cli("fit", *args, "--trainer.strategy.schedule=Interleaved1F1B")
    assert fit.returncode == 0, fit.stdout
    assert "pipeline: 4 stages (2 per process) over 2 processes, schedule Interleaved1F1B" in fit.stdout
    assert [line.split()[1:3] for line in fit.stdout.splitlines() if re.match(r"^[0-3] +rank", line)] == [
        ["rank", "0"],
        ["rank", "1"],
        ["rank", "0"],
        ["rank", "1"],
    ]
    validate = run_cli("validate", *args, "--trainer.strategy.schedule=DualPipeV", "--ckpt_path=last")
    assert validate.returncode == 0 and "val/acc" in validate.stdout, validate.stdout


def test_errors_before_anything_is_launched(capsys, tmp_path):
    run = [*run_args(tmp_path), *RESNET50]  # its 34 blocks, and 1x1 images in layer4 under the ImageNet stem
    pipeline = ["--trainer.strategy=pipeline", "--trainer.devices=2"]
    error = cli_error(capsys, *pipeline, "--trainer.strategy.micro_batches=1", *run)
    assert error == (
        "error: schedule 1f1b needs at least as many micro-batches as stages: micro_batches=1 < 2 stages. "
        "Raise micro_batches or use schedule gpipe."
    )
    error = cli_error(capsys, *pipeline, "--trainer.strategy.micro_batches=3", *run)
    assert error == (
        "error: the batch of 8 images cannot be cut into micro_batches=3 equal parts: "
        "choose a batch size that is a multiple of micro_batches."
    )
    error = cli_error(
        capsys, "--trainer.strategy=pipeline", "--trainer.devices=3", "--trainer.strategy.num_stages=2", *run
    )
    assert error == (
        "error: the pipeline has 2 stages over 2 processes, but devices x nodes = 3 processes is not a multiple of 2: "
        "use a multiple of 2 devices, or change num_stages."
    )
    error = cli_error(
        capsys, "--trainer.strategy=pipeline", "--trainer.devices=35", "--trainer.strategy.schedule=gpipe", *run
    )
    assert error == "error: 35 stages need at least 35 blocks, but the network has 34."
    error = cli_error(capsys, *pipeline, "--trainer.strategy.schedule=PipelineScheduleMulti", *run)
    assert error.startswith("error: schedule must be one of gpipe, 1f1b, interleaved1f1b, loopedbfs, ")
    error = cli_error(
        capsys, *pipeline, "--trainer.strategy.schedule=GPipe", "--trainer.strategy.stages_per_process=2", *run
    )
    assert error.startswith(
        "error: schedule GPipe runs one stage per process, not stages_per_process=2: use Interleaved1F1B"
    )
    error = cli_error(
        capsys,
        *pipeline,
        "--trainer.strategy.schedule=DualPipeV",
        "--trainer.strategy.stages_per_process=2",
        "--trainer.strategy.micro_batches=2",
        *run,
    )
    assert error == (
        "error: schedule DualPipeV needs at least as many micro-batches as stages: micro_batches=2 < 4 stages. "
        "Raise micro_batches."
    )
    # The ImageNet stem brings layer4 to 1x1 images: BatchNorm cannot train on one value per channel (plan's check).
    error = cli_error(capsys, *pipeline, "--data.batch_size=4", "--trainer.strategy.micro_batches=4", *run)
    assert error.startswith(
        "error: a micro-batch of 1 image(s) (a batch of 4 in micro_batches=4) cannot train: Expected more than 1 value "
        "per channel when training, got input size torch.Size([1, "
    )
    assert error.endswith("]). Use fewer micro-batches or a larger --data.batch_size.")
    error = cli_error(capsys, *pipeline, "--trainer.strategy.balance=[17,16]", *run)
    assert error == "error: balance [17, 16] sums to 33, but the network has 34 blocks."


@pytest.mark.slow
@pytest.mark.min_cuda_gpus(2)
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_two_gpu_stages_over_nccl(precision, tmp_path):
    result = run_cli(
        "fit",
        "--config",
        SMOKE,
        "--trainer.accelerator=cuda",
        "--trainer.devices=2",
        "--trainer.strategy=pipeline",
        f"--trainer.precision={precision}",
        "--trainer.gradient_clip_val=1.0",
        *run_args(tmp_path),
    )
    assert result.returncode == 0, result.stdout
    validate = run_cli(
        "validate",
        "--config",
        SMOKE,
        "--trainer.accelerator=cuda",
        "--trainer.devices=2",
        "--trainer.strategy=pipeline",
        "--ckpt_path=last",
        *run_args(tmp_path),
    )
    assert validate.returncode == 0, validate.stdout


def test_deferred_batch_norm_normalises_each_micro_batch_and_keeps_the_statistics_of_the_whole_batch():
    torch.manual_seed(0)
    plain, whole = torch.nn.BatchNorm2d(8), torch.nn.BatchNorm2d(8)
    deferred = defer_batch_norm(torch.nn.Sequential(torch.nn.BatchNorm2d(8)), micro_batches=4)[0]
    for _ in range(2):  # two steps of 4 micro-batches
        x = torch.randn(16, 8, 5, 5) * 3 + 1
        for micro_batch in x.chunk(4):
            assert torch.equal(deferred(micro_batch), plain(micro_batch))  # normalised by its own statistics
        whole(x)
    assert deferred.num_batches_tracked == whole.num_batches_tracked == 2
    torch.testing.assert_close(deferred.running_mean, whole.running_mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(deferred.running_var, whole.running_var, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(plain.running_var, whole.running_var, rtol=1e-3)  # per micro-batch, they differ
    assert deferred.state_dict().keys() == whole.state_dict().keys()


@pytest.mark.slow
def test_pipeline_with_deferred_batch_norm_equals_one_device_with_whole_batch_statistics(train_setup):
    """Same parameters as without it; running statistics those of one device that defers them the same way."""
    reference, deferred = train_setup("bottleneck_accumulated_deferred"), train_setup("bottleneck_pipe_deferred")
    for name, tensor in deferred.items():
        assert torch.equal(tensor, reference[name]), name
    per_micro_batch = train_setup("bottleneck_pipe_1f1b")
    statistics = [name for name in deferred if "running" in name or "num_batches" in name]
    for name, tensor in deferred.items():
        if name not in statistics:  # the forward and backward passes are those of plain BatchNorm
            assert torch.equal(tensor, per_micro_batch[name]), name
    assert all(not torch.equal(deferred[name], per_micro_batch[name]) for name in statistics)


def test_the_schedule_clock_counts_each_computation_once_and_the_rest_as_idle():
    """A stage whose computations sleep: 0.4 s of them (a forward pass inside a backward pass counted once), 0.2 s
    between them idle; untimed steps and a second reading give nothing. The ideal is GPipe's and 1F1B's bubble."""

    class Stage:
        def forward_one_chunk(self, *args):
            time.sleep(0.1)

        def backward_one_chunk(self, *args):
            self.forward_one_chunk()
            time.sleep(0.1)

        def backward_weight_one_chunk(self, *args):
            time.sleep(0.1)

    stage = Stage()
    clock = ScheduleClock([stage], torch.device("cpu"))
    stage.forward_one_chunk()
    assert clock.idle_share() is None
    with clock.timing():
        stage.forward_one_chunk()
        time.sleep(0.2)
        stage.backward_one_chunk()
        stage.backward_weight_one_chunk()
    assert 0.25 < clock.idle_share() < 0.5  # 1/3; 1/6 were the nested forward pass counted twice
    assert clock.idle_share() is None
    assert ideal_idle_share(StagePlacement("1F1B", 2, 1), 4) == pytest.approx(1 / 5)  # (S - 1) / (M + S - 1)
    assert ideal_idle_share(StagePlacement("GPipe", 4, 1), 8) == pytest.approx(3 / 11)
