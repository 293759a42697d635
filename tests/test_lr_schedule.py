import pytest

from multigpu.model.lr_schedule import scaled_lr, warmup_cosine


def test_lr_scales_linearly_with_the_global_batch():
    assert scaled_lr(0.2, 256) == pytest.approx(0.2)
    assert scaled_lr(0.2, 128) == pytest.approx(0.1)
    assert scaled_lr(0.2, 4 * 2 * 128) == pytest.approx(0.8)


def test_warmup_rises_linearly_then_cosine_decays_to_zero():
    factors = [warmup_cosine(step, warmup_steps=4, total_steps=14) for step in range(15)]
    assert factors[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert factors[4] == pytest.approx(1.0)
    assert factors[9] == pytest.approx(0.5)
    assert factors[14] == pytest.approx(0.0)
    assert all(a >= b for a, b in zip(factors[4:], factors[5:]))


def test_no_warmup_starts_at_the_peak():
    assert warmup_cosine(0, warmup_steps=0, total_steps=10) == pytest.approx(1.0)
