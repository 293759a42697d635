"""DDP with two gloo processes on the CPU, launched by Lightning from the CLI."""

from pathlib import Path

from conftest import REPO, SMOKE, run_cli, run_args


def test_ddp_two_cpu_processes_train_on_disjoint_shards(tmp_path):
    record = tmp_path / "samples"
    extra = tmp_path / "record.yaml"
    extra.write_text(
        "trainer:\n  callbacks:\n    - class_path: helpers.RecordSamples\n"
        f"      init_args:\n        out_dir: {record}\n"
    )
    result = run_cli(
        "fit", "--config", SMOKE, "--config", str(REPO / "configs" / "ddp.yaml"), "--config", str(extra),
        "--trainer.accelerator=cpu", "--trainer.devices=2", "--data.synthetic_size=64", *run_args(tmp_path),
        env={"PYTHONPATH": str(Path(__file__).parent)},
    )
    assert result.returncode == 0, result.stdout
    seen = [set((record / f"rank{rank}.txt").read_text().split()) for rank in (0, 1)]
    assert len(seen[0]) == len(seen[1]) == 32  # 64 images, 2 ranks, 4 steps of 8
    assert not seen[0] & seen[1]
    assert (tmp_path / "checkpoints" / "test" / "last.ckpt").is_file()
