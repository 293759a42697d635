"""The median of repeated measurements and its distribution-free interval (``multigpu.timing.intervals``)."""

import random

import pytest

from multigpu.timing.intervals import median_interval


@pytest.mark.parametrize(("n", "k", "coverage"), [(1, 1, 0.0), (5, 1, 30 / 32), (6, 1, 62 / 64), (9, 2, 1 - 20 / 512)])
def test_the_interval_is_the_narrowest_pair_of_order_statistics_that_reaches_95_percent(n, k, coverage):
    values = [float(value) for value in random.Random(n).sample(range(100), n)]
    interval = median_interval(values)
    ordered = sorted(values)
    assert (interval.low, interval.high) == (ordered[k - 1], ordered[n - k])
    assert interval.coverage == pytest.approx(coverage)
    assert interval.low <= interval.median <= interval.high


def test_the_interval_holds_the_true_median_as_often_as_it_says():
    """Skewed noise (exponential), 9 measurements a time: the interval holds the true median (ln 2) about 96% of
    the time."""
    draw, trials = random.Random(0), 4000
    inside = 0
    for _ in range(trials):
        interval = median_interval([draw.expovariate(1.0) for _ in range(9)])
        inside += interval.low <= 0.6931 <= interval.high
    assert inside / trials == pytest.approx(interval.coverage, abs=0.015)


def test_no_measurement_is_refused():
    with pytest.raises(ValueError, match="at least one value"):
        median_interval([])
