"""16-mixed with loss scaling, on the CPU: the real float16 autocast and GradScaler under every strategy."""

import pytest
import torch

pytestmark = pytest.mark.internals  # CI runs these on the lowest torch we declare too


@pytest.mark.slow
@pytest.mark.parametrize("setup", ["ddp_fp16", "mmp_fp16", "pipe_fp16", "pipe_2x2_fp16"])
def test_an_overflow_on_one_process_skips_the_step_on_every_process_as_on_one_device(setup, train_setup):
    """The second step's gradients are infinite on one process, one that holds only the first block: every
    process skips that step and halves its loss scale, and the rest trains as one device does in float16."""
    reference, trained = dict(train_setup("single_fp16")), dict(train_setup(setup))  # copies: the session keeps them
    assert reference.pop("loss_scales").tolist() == [2.0**15]  # 2**16 to start with, halved once
    assert set(trained.pop("loss_scales").tolist()) == {2.0**15}  # on every process
    assert trained.keys() == reference.keys()
    # float16 sums in another order: rounding, not a skipped step (~0.1)
    torch.testing.assert_close(trained, reference, rtol=0, atol=1e-3)
