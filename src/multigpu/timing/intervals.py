"""The median of repeated measurements and a distribution-free interval around it.

Whatever the noise, each measurement is as likely to fall above the true median as below it, so the number
below it is binomial(n, 1/2): the k-th smallest and the k-th largest of n measurements enclose the median with
probability ``1 - 2 * P(binomial(n, 1/2) < k)``. ``median_interval`` takes the narrowest such pair that reaches
the confidence asked for (the smallest and the largest where n is too small for it, with the coverage they
reach: 5 measurements, 93.75%; 6, 96.9%).
"""

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MedianInterval", "median_interval"]


@dataclass(frozen=True)
class MedianInterval:
    """The median of measurements, and the interval that holds the true median with probability ``coverage``."""

    median: float
    low: float
    high: float
    coverage: float


def _below(n: int, k: int) -> float:
    """P(binomial(n, 1/2) < k)."""
    return sum(math.comb(n, i) for i in range(k)) / 2**n


def median_interval(values: Sequence[float], confidence: float = 0.95) -> MedianInterval:
    """The median of ``values`` and its order-statistic interval (see the module's docstring)."""
    if not values:
        raise ValueError("median_interval needs at least one value")
    ordered, n = sorted(values), len(values)
    k = 1
    while k + 1 <= (n + 1) // 2 and 1 - 2 * _below(n, k + 1) >= confidence:
        k += 1
    return MedianInterval(statistics.median(ordered), ordered[k - 1], ordered[n - k], 1 - 2 * _below(n, k))
