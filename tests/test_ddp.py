"""DDP with two gloo processes on the CPU, launched by Lightning from the CLI."""

import pytest
from helpers import HELPERS_ENV, REPO, SMOKE, helper_callback, run_args, run_cli


@pytest.mark.slow
def test_ddp_two_cpu_processes_train_on_disjoint_shards(tmp_path):
    record = tmp_path / "samples"
    extra = helper_callback(tmp_path, "RecordSamples", out_dir=record)
    result = run_cli(
        "fit",
        "--config",
        SMOKE,
        "--config",
        str(REPO / "configs" / "ddp.yaml"),
        "--config",
        extra,
        "--trainer.accelerator=cpu",
        "--trainer.devices=2",
        "--data.synthetic_size=64",
        *run_args(tmp_path),
        env=HELPERS_ENV,
    )
    assert result.returncode == 0, result.stdout
    assert "LightningEnvironment: 2 process(es) on 1 node(s), started by Lightning." in result.stdout
    seen = [set((record / f"rank{rank}.txt").read_text().split()) for rank in (0, 1)]
    assert len(seen[0]) == len(seen[1]) == 32  # 64 images, 2 ranks, 4 steps of 8
    assert not seen[0] & seen[1]
    assert (tmp_path / "checkpoints" / "test" / "last.ckpt").is_file()
