"""Confidence intervals over seeds and the three-valued verdict every sweep's claims rest on.

Every interval is two-sided at ``level`` and computed from per-seed values:

* :func:`mean_interval`: Student's t interval of one mean;
* :func:`welch_interval`: Welch's t interval of ``mean(a) - scale * mean(b)`` (unequal
  variances, Welch-Satterthwaite degrees of freedom);
* :func:`variance_ratio_interval`: the F interval of ``var(a) / var(b)`` (normal samples).

When the seeds agree exactly (spread 0, e.g. every seed diverged and counts as chance) the
interval is the point itself: the verdict then rests on those seeds alone. Fewer than
:data:`MIN_SEEDS` values on a side give no interval; the caller says why.

Example:
    >>> iv = welch_interval([0.97, 0.96, 0.98], [0.10, 0.10, 0.10])
    >>> round(iv.estimate, 3), round(iv.low, 3), round(iv.high, 3)
    (0.87, 0.845, 0.895)
    >>> verdict(iv, threshold=0.0, side="above")
    'supported'
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Literal, Sequence

from scipy import stats as _scipy_stats

__all__ = ["MIN_SEEDS", "Interval", "Side", "Verdict", "mean_interval", "mean_sd", "variance_ratio_interval",
           "verdict", "welch_interval"]

#: the fewest seeds per arm that give a spread, hence an interval
MIN_SEEDS = 2

Side = Literal["above", "below"]
Verdict = Literal["supported", "contradicted", "inconclusive"]


@dataclass(frozen=True)
class Interval:
    """An estimate and its two-sided confidence interval ``[low, high]`` at ``level``."""

    estimate: float
    low: float
    high: float
    level: float


def mean_sd(values: Sequence[float]) -> tuple[float, float, int]:
    """``(mean, sample standard deviation, n)``; sd is NaN for a single value."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan, 0
    return statistics.fmean(values), statistics.stdev(values) if n > 1 else math.nan, n


def _check(values: Sequence[float], what: str) -> None:
    if len(values) < MIN_SEEDS:
        raise ValueError(f"{what}: {len(values)} value(s), an interval needs at least {MIN_SEEDS}")


def _t(level: float, df: float) -> float:
    return float(_scipy_stats.t.ppf(0.5 + level / 2, df))


def mean_interval(values: Sequence[float], level: float = 0.95) -> Interval:
    """Student's t interval of the mean of ``values`` (at least two)."""
    _check(values, "mean_interval")
    mean, sd, n = mean_sd(values)
    half = _t(level, n - 1) * sd / math.sqrt(n) if sd > 0 else 0.0
    return Interval(mean, mean - half, mean + half, level)


def welch_interval(a: Sequence[float], b: Sequence[float], level: float = 0.95, scale: float = 1.0) -> Interval:
    """Welch's t interval of ``mean(a) - scale * mean(b)`` (each side at least two values)."""
    _check(a, "welch_interval a")
    _check(b, "welch_interval b")
    mean_a, sd_a, n_a = mean_sd(a)
    mean_b, sd_b, n_b = mean_sd(b)
    va, vb = sd_a**2 / n_a, (scale * sd_b) ** 2 / n_b  # squared standard errors of the two terms
    estimate = mean_a - scale * mean_b
    se2 = va + vb
    if se2 == 0:
        return Interval(estimate, estimate, estimate, level)
    df = se2**2 / (va**2 / (n_a - 1) + vb**2 / (n_b - 1))  # Welch-Satterthwaite
    half = _t(level, df) * math.sqrt(se2)
    return Interval(estimate, estimate - half, estimate + half, level)


def variance_ratio_interval(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> Interval:
    """The F interval of ``var(a) / var(b)``; ``inf`` when only ``b`` has no spread, NaN when neither has."""
    _check(a, "variance_ratio_interval a")
    _check(b, "variance_ratio_interval b")
    _, sd_a, n_a = mean_sd(a)
    _, sd_b, n_b = mean_sd(b)
    if sd_b == 0:
        value = math.inf if sd_a > 0 else math.nan
        return Interval(value, value, value, level)
    ratio = sd_a**2 / sd_b**2
    alpha = 1 - level
    f_high = float(_scipy_stats.f.ppf(1 - alpha / 2, n_a - 1, n_b - 1))
    f_low = float(_scipy_stats.f.ppf(alpha / 2, n_a - 1, n_b - 1))
    return Interval(ratio, ratio / f_high, ratio / f_low, level)


def verdict(interval: Interval, threshold: float, side: Side) -> Verdict:
    """``supported`` when the whole interval lies strictly on ``side`` of ``threshold``,
    ``contradicted`` when it lies strictly on the other side, else ``inconclusive``."""
    if side not in ("above", "below"):
        raise ValueError(f"side must be 'above' or 'below', got {side!r}")
    low, high = interval.low, interval.high
    if math.isnan(low) or math.isnan(high):
        return "inconclusive"
    above, below = low > threshold, high < threshold
    if (side == "above" and above) or (side == "below" and below):
        return "supported"
    if (side == "above" and below) or (side == "below" and above):
        return "contradicted"
    return "inconclusive"
