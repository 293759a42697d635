"""The run's progress bar reads the logged metrics (a wait for the GPU) after log steps, not after every step."""

import pytest
from helpers import SMOKE, cli_main, run_args
from lightning.pytorch.callbacks import RichProgressBar

from multigpu.run.progress_bar import PacedProgressBar

pytestmark = pytest.mark.internals  # Lightning's bar and when it asks for metrics: the lowest torch too

STEPS = 16  # 128 synthetic images, batch 8, one epoch


def _fit_counting_reads(tmp_path, monkeypatch, *args: str) -> tuple[list, object]:
    """A smoke fit of ``STEPS`` steps, logged every 8; the bar at each read of the metrics, and the trainer."""
    reads, trainers = [], []
    read = RichProgressBar.get_metrics

    def counted(self, trainer, pl_module):
        reads.append(trainer.progress_bar_callback)
        trainers.append(trainer)
        return read(self, trainer, pl_module)

    monkeypatch.setattr(RichProgressBar, "get_metrics", counted)
    logged = ["--data.synthetic_size=128", "--trainer.log_every_n_steps=8"]
    cli_main("fit", "--config", SMOKE, *run_args(tmp_path), *logged, *args)
    return reads, trainers[-1]


@pytest.mark.parametrize("callbacks", [[], ["--trainer.callbacks+=lightning.pytorch.callbacks.LearningRateMonitor"]])
def test_the_default_bar_reads_the_metrics_after_log_steps_and_at_each_end(tmp_path, monkeypatch, callbacks):
    reads, trainer = _fit_counting_reads(tmp_path, monkeypatch, *callbacks)
    assert {type(bar) for bar in reads} == {PacedProgressBar}
    # The sanity check's end, the log steps 8 and 16, the epoch's end and the validation's: not after each of the 16
    # steps.
    assert len(reads) == 5
    shown, final = reads[-1].get_metrics(trainer, trainer.lightning_module), trainer.progress_bar_metrics
    assert shown["val/acc"] == final["val/acc"]
    # The training loss, logged without prog_bar (Lightning would read it after every step), shown all the same.
    assert "train/loss" not in final and shown["train/loss"] == float(trainer.callback_metrics["train/loss"])
    assert "v_num" not in shown  # the log's version, which the bar showed as "v_num: 0.000"


def test_a_bar_the_user_chose_is_kept_as_it_is(tmp_path, monkeypatch):
    reads, _ = _fit_counting_reads(
        tmp_path, monkeypatch, "--trainer.callbacks+=lightning.pytorch.callbacks.RichProgressBar"
    )
    assert {type(bar) for bar in reads} == {RichProgressBar}
    assert len(reads) >= STEPS  # Lightning's own bar reads them after every step
