"""Between log steps, a training step makes the host wait for nothing and talks to the other processes only
through the strategy's own collectives, under every strategy (``step_waits.CountWaits`` counts)."""

import pytest
from helpers import REPO, SMOKE, run_args, run_cli
from step_waits import quiet_counts

CPU2 = ["--trainer.accelerator=cpu", "--trainer.devices=2"]
REPLICAS = {"ddp": 2, "fsdp": 2, "manual_model_parallel replicas": 2, "ddp max_time": 2}  # the others: one
STRATEGIES = {
    "one device": [],
    "dp": ["--trainer.strategy=dp"],
    "manual_model_parallel": ["--trainer.strategy=manual_model_parallel", *CPU2],
    "manual_model_parallel replicas": [
        "--trainer.strategy=manual_model_parallel",
        *CPU2,
        "--trainer.strategy.devices_per_replica=1",
    ],
    "ddp": ["--trainer.strategy=ddp", *CPU2],
    "fsdp": ["--trainer.strategy=fsdp", *CPU2],
    "pipeline": ["--trainer.strategy=pipeline", *CPU2],
    # Lightning's Timer broadcast its decision every step, and the pipeline's clipping reads the norm of every stage:
    # both ride on what the steps already do (the stop vote; the norm's all-reduce, on the device, never read).
    "ddp max_time": ["--trainer.strategy=ddp", *CPU2, "--trainer.max_time=00:01:00:00"],
    "pipeline clipping": ["--trainer.strategy=pipeline", *CPU2, "--trainer.gradient_clip_val=1.0"],
}
GPU = ["--trainer.accelerator=gpu", "--trainer.devices=1"]
ON_CUDA = {
    "cuda": GPU,
    "cuda fast.yaml": ["--config", str(REPO / "configs" / "fast.yaml"), *GPU],
    "cuda 16-mixed": [*GPU, "--trainer.precision=16-mixed"],
}
# The one wait left, and where (docs/speed.md, "No wait in a step"): GradScaler reads its overflow flag every step.
LISTED = {"cuda 16-mixed": "torch/amp/grad_scaler.py"}
LOG_EVERY = 8


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy", [*STRATEGIES, *(pytest.param(name, marks=pytest.mark.min_cuda_gpus(1)) for name in ON_CUDA)]
)
def test_no_wait_and_no_collective_of_ours_between_log_steps(strategy, tmp_path):
    """24 training steps of 4 images per process, logged every 8; each process counts, in the windows
    between log steps (``step_waits``), what would wait for a GPU and every Python-level collective. On CUDA the
    steps between log steps also run under ``torch.cuda.set_sync_debug_mode("error")``."""
    counts = tmp_path / "counts"
    config = tmp_path / "count.yaml"
    sync_debug = strategy in ON_CUDA and strategy not in LISTED
    config.write_text(
        "trainer:\n  callbacks:\n    - class_path: step_waits.CountWaits\n"
        f"      init_args:\n        out_dir: {counts}\n        sync_debug: {str(sync_debug).lower()}\n"
    )
    size = f"--data.synthetic_size={96 * REPLICAS.get(strategy, 1)}"
    result = run_cli(
        "fit", "--config", SMOKE, *run_args(tmp_path), *{**STRATEGIES, **ON_CUDA}[strategy], "--data.batch_size=4",
        size, "--trainer.max_epochs=1", f"--trainer.log_every_n_steps={LOG_EVERY}", "--save_every_n_steps=0",
        "--trainer.limit_val_batches=0", "--config", str(config),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout
    found = quiet_counts(counts)
    print(strategy, found)
    assert found, result.stdout
    for rank, counted in found.items():
        assert counted["windows"] == 24 and counted["quiet"] >= 18, (rank, counted)  # 24 steps; 3 log steps, 2 ends
        waits = {site: count for site, count in counted["waits"].items() if LISTED.get(strategy, "\0") not in site}
        assert waits == {}, (strategy, rank, counted["waits"])
        assert counted["collectives"] == {}, (strategy, rank, counted["collectives"])
