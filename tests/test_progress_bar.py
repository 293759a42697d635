"""The run's progress bar reads the logged metrics (a wait for the GPU) about once a second, not after every step."""

import pytest
from helpers import SMOKE, cli_main, run_args
from lightning.pytorch.callbacks import RichProgressBar

from multigpu.run import progress_bar
from multigpu.run.progress_bar import PacedProgressBar

pytestmark = pytest.mark.internals  # Lightning's bar and when it asks for metrics: the lowest torch too

STEPS = 16  # 128 synthetic images, batch 8, one epoch


def _fit_counting_reads(tmp_path, monkeypatch, *args: str) -> tuple[list, object]:
    """A smoke fit of ``STEPS`` steps, the bar's clock stopped; the bar at each read of the metrics, and the
    trainer."""
    reads, trainers = [], []
    read = RichProgressBar.get_metrics

    def counted(self, trainer, pl_module):
        reads.append(trainer.progress_bar_callback)
        trainers.append(trainer)
        return read(self, trainer, pl_module)

    monkeypatch.setattr(RichProgressBar, "get_metrics", counted)
    monkeypatch.setattr(progress_bar, "monotonic", lambda: 1000.0)
    cli_main("fit", "--config", SMOKE, *run_args(tmp_path), "--data.synthetic_size=128", *args)
    return reads, trainers[-1]


@pytest.mark.parametrize("callbacks", [[], ["--trainer.callbacks+=lightning.pytorch.callbacks.LearningRateMonitor"]])
def test_the_default_bar_reads_the_metrics_once_a_second_and_at_each_end(tmp_path, monkeypatch, callbacks):
    reads, trainer = _fit_counting_reads(tmp_path, monkeypatch, *callbacks)
    assert {type(bar) for bar in reads} == {PacedProgressBar}
    # The sanity check's end, the validation's and the epoch's: not after each of the 16 steps.
    assert len(reads) == 3
    shown, final = reads[-1].get_metrics(trainer, trainer.lightning_module), trainer.progress_bar_metrics
    assert shown["train/loss"] == final["train/loss"] and shown["val/acc"] == final["val/acc"]
    assert "v_num" not in shown  # the log's version, which the bar showed as "v_num: 0.000"


def test_a_bar_the_user_chose_is_kept_as_it_is(tmp_path, monkeypatch):
    reads, _ = _fit_counting_reads(
        tmp_path, monkeypatch, "--trainer.callbacks+=lightning.pytorch.callbacks.RichProgressBar"
    )
    assert {type(bar) for bar in reads} == {RichProgressBar}
    assert len(reads) >= STEPS  # Lightning's own bar reads them after every step


def test_the_metrics_are_read_again_once_a_second_has_passed(monkeypatch):
    reads, clock = [], iter([0.0, 0.5, 0.99, 1.0, 1.5, 2.1])
    monkeypatch.setattr(RichProgressBar, "get_metrics", lambda self, trainer, pl_module: {"read": len(reads)})
    monkeypatch.setattr(progress_bar, "monotonic", lambda: next(clock))
    bar = PacedProgressBar(metrics_every_s=1.0)
    for _ in range(6):
        reads.append(bar.get_metrics(None, None)["read"])
    assert reads == [0, 0, 0, 3, 3, 5]  # read at 0, 1.0 and 2.1 s; the figures of the last read in between
