"""The run's progress bar reads the logged metrics (a wait for the GPU) about once a second, not after every step."""

import pytest
from helpers import SMOKE, cli_main, run_args
from lightning.pytorch.callbacks import RichProgressBar

from multigpu.run import progress_bar
from multigpu.run.progress_bar import PacedProgressBar

pytestmark = pytest.mark.internals  # Lightning's bar and when it asks for metrics: the lowest torch too

STEPS = 16  # 128 synthetic images, batch 8, one epoch


def _fit_counting_reads(tmp_path, monkeypatch, *args: str) -> list[type]:
    """A smoke fit of ``STEPS`` steps with a clock that never moves; the bar's class at each read of the metrics."""
    reads: list[type] = []
    read = RichProgressBar.get_metrics

    def counted(self, trainer, pl_module):
        reads.append(type(trainer.progress_bar_callback))
        return read(self, trainer, pl_module)

    monkeypatch.setattr(RichProgressBar, "get_metrics", counted)
    monkeypatch.setattr(progress_bar.time, "monotonic", lambda: 1000.0)
    cli_main("fit", "--config", SMOKE, *run_args(tmp_path), "--data.synthetic_size=128", *args)
    return reads


def test_the_default_bar_reads_the_metrics_once_a_second_and_at_each_end(tmp_path, monkeypatch):
    reads = _fit_counting_reads(tmp_path, monkeypatch)
    assert set(reads) == {PacedProgressBar}
    # The first step, the validation's end and the epoch's end: not after each of the 16 steps.
    assert 2 <= len(reads) <= 4, reads


def test_a_bar_the_user_chose_is_kept_as_it_is(tmp_path, monkeypatch):
    reads = _fit_counting_reads(
        tmp_path, monkeypatch, "--trainer.callbacks+=lightning.pytorch.callbacks.RichProgressBar"
    )
    assert set(reads) == {RichProgressBar}
    assert len(reads) >= STEPS  # Lightning's own bar reads them after every step
