"""Each strategy's plain PyTorch counterpart (``benchmarks/plain_peers.py``, ``throughput.py``'s ``plain-*`` rows)
trains as the strategy does: from the same weights on the same samples, the same loss at every step, within the
tolerance of the strategy's own equivalence tests. A counterpart that computed something else would measure
nothing."""

import importlib
import json
import os
import subprocess
import sys

import pytest
from helpers import ABORTED_AT_EXIT, HELPERS_ENV, REPO

# The largest difference of a step's loss, relative to it: what each strategy's own tests allow against the layout
# it must equal. ddp and the split over devices run the same sums as their counterparts (test_learning_parity's
# plain DDP loop, test_manual_model_parallel); fsdp and the pipeline sum in another order (test_fsdp, test_pipeline).
TOLERANCE = {"ddp": 0.0, "fsdp": 1e-6, "pipeline": 1e-6, "mmp": 0.0}


@pytest.fixture
def peer_training(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    return importlib.import_module("peer_training")


def assert_same_losses(app: list[float], peer: list[float], name: str) -> None:
    assert len(app) == len(peer) == 4, name
    assert len(set(app)) == 4, f"{name}: its loss moves from step to step: {app}"
    assert peer == pytest.approx(app, rel=TOLERANCE[name], abs=0), name


def test_plain_model_parallel_loses_what_manual_model_parallel_loses_at_every_step(peer_training):
    """The tiny ResNet (``helpers.tiny_resnet``) split over two CPU devices in this process, both ways."""
    seen = peer_training.mmp_losses()
    assert_same_losses(seen["app"], seen["peer"], "mmp")


@pytest.mark.slow
def test_plain_ddp_fsdp_and_pipeline_lose_what_their_strategies_lose_at_every_step(tmp_path):
    """The tiny ResNet (``helpers.tiny_resnet``) over two processes, ``ddp``, ``fsdp`` and ``pipeline`` each followed
    by its counterpart in one launch: every process's losses where it has them (each replica its own under ddp and
    fsdp; the last stage under the counterpart's pipeline)."""
    path = os.pathsep.join([HELPERS_ENV["PYTHONPATH"], str(REPO / "benchmarks")])
    command = [sys.executable, str(REPO / "tests" / "peer_training.py"), str(tmp_path / "losses")]
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0 and ABORTED_AT_EXIT not in result.stderr, result.stdout + result.stderr
    ranks = [json.loads((tmp_path / f"losses.rank{rank}.json").read_text()) for rank in (0, 1)]
    for name in ("ddp", "fsdp", "pipeline"):
        compared = 0
        for seen in ranks:
            if None not in seen[name]["peer"]:
                assert_same_losses(seen[name]["app"], seen[name]["peer"], name)
                compared += 1
        assert compared == (1 if name == "pipeline" else 2), name
