"""Confidence intervals over seeds and the three-valued verdict every sweep's claims rest on.

Every interval is two-sided at ``level`` and computed from per-seed values:

* :func:`mean_interval`: Student's t interval of one mean (``scipy.stats.ttest_1samp``);
* :func:`welch_interval`: Welch's t interval of ``mean(a) - scale * mean(b)`` (unequal
  variances, Welch-Satterthwaite degrees of freedom: ``scipy.stats.ttest_ind(equal_var=False)``);
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
import warnings
from dataclasses import dataclass
from typing import Callable, Literal, Optional, Sequence

from scipy import stats as _scipy_stats

__all__ = ["MAX_SEEDS", "MIN_SEEDS", "POWER", "Interval", "Side", "Verdict", "mean_interval", "mean_sd", "mean_seeds",
           "ratio_seeds", "variance_ratio_interval", "verdict", "welch_interval", "welch_seeds"]

#: the fewest seeds per arm that give a spread, hence an interval
MIN_SEEDS = 2
#: the power a seeds-needed estimate plans for: the chance that the interval then excludes the threshold
POWER = 0.8
#: seeds-needed estimates stop here (``math.inf``: more than this many per arm)
MAX_SEEDS = 1_000_000

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
    """Student's t interval of the mean of ``values`` (at least two): scipy's ``ttest_1samp`` interval."""
    _check(values, "mean_interval")
    mean, sd, _ = mean_sd(values)
    if sd == 0:  # scipy gives NaN; the seeds agree, so the interval is the point
        return Interval(mean, mean, mean, level)
    with warnings.catch_warnings():  # its statistic's precision warning on near-equal seeds: not the interval's
        warnings.simplefilter("ignore", RuntimeWarning)
        ci = _scipy_stats.ttest_1samp(values, 0.0).confidence_interval(level)
    return Interval(mean, float(ci.low), float(ci.high), level)


def welch_interval(a: Sequence[float], b: Sequence[float], level: float = 0.95, scale: float = 1.0) -> Interval:
    """Welch's t interval of ``mean(a) - scale * mean(b)`` (each side at least two values): scipy's
    ``ttest_ind(equal_var=False)`` interval of ``a`` against ``scale * b``."""
    _check(a, "welch_interval a")
    _check(b, "welch_interval b")
    scaled = [scale * v for v in b]
    (mean_a, sd_a, _), (mean_b, sd_b, _) = mean_sd(a), mean_sd(scaled)
    estimate = mean_a - mean_b
    if sd_a == 0 and sd_b == 0:  # scipy gives NaN; the seeds agree, so the interval is the point
        return Interval(estimate, estimate, estimate, level)
    with warnings.catch_warnings():  # as in mean_interval
        warnings.simplefilter("ignore", RuntimeWarning)
        ci = _scipy_stats.ttest_ind(a, scaled, equal_var=False).confidence_interval(level)
    return Interval(estimate, float(ci.low), float(ci.high), level)


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


# ----------------------------------------------------------------------------- seeds to resolve
def _smallest(power_at: Callable[[int], float], power: float) -> float:
    """The smallest n >= 2 with ``power_at(n) >= power`` (power grows with n), ``inf`` past :data:`MAX_SEEDS`."""
    high = MIN_SEEDS
    while power_at(high) < power:
        if high >= MAX_SEEDS:
            return math.inf
        high = min(2 * high, MAX_SEEDS)
    low = max(MIN_SEEDS, high // 2)
    while low < high:
        mid = (low + high) // 2
        low, high = (mid + 1, high) if power_at(mid) < power else (low, mid)
    return float(high)


def _t_power(distance: float, sd: float, df: float, level: float) -> float:
    """P(a t interval of half-width t * sd excludes a threshold ``distance`` away from the mean), ``sd``: its SE."""
    ncp = distance / sd
    crit = _t(level, df)
    return float(_scipy_stats.nct.sf(crit, df, ncp) + _scipy_stats.nct.cdf(-crit, df, ncp))


def welch_seeds(a: Sequence[float], b: Sequence[float], threshold: float, level: float = 0.95, scale: float = 1.0,
                power: float = POWER) -> Optional[float]:
    """Seeds per arm for Welch's interval of ``mean(a) - scale * mean(b)`` to exclude ``threshold`` with
    probability ``power``, if the true difference and spreads were the observed ones (noncentral t).

    ``None`` when no number of seeds would: the estimate sits on the threshold, or there is no spread
    (a zero-width interval decides at once) or fewer than two values on a side.
    """
    if len(a) < MIN_SEEDS or len(b) < MIN_SEEDS:
        return None
    (mean_a, sd_a, _), (mean_b, sd_b, _) = mean_sd(a), mean_sd(b)
    var = sd_a**2 + (scale * sd_b) ** 2  # n x the squared SE with n seeds per arm
    distance = abs(mean_a - scale * mean_b - threshold)
    if distance == 0 or var == 0:
        return None
    quartic = sd_a**4 + (scale * sd_b) ** 4

    def power_at(n: int) -> float:
        return _t_power(distance, math.sqrt(var / n), (n - 1) * var**2 / quartic, level)

    return _smallest(power_at, power)


def mean_seeds(values: Sequence[float], threshold: float, level: float = 0.95, power: float = POWER) -> Optional[float]:
    """Seeds for Student's t interval of the mean to exclude ``threshold`` with probability ``power``
    (the observed mean and spread taken as true); ``None`` as :func:`welch_seeds`."""
    if len(values) < MIN_SEEDS:
        return None
    mean, sd, _ = mean_sd(values)
    distance = abs(mean - threshold)
    if distance == 0 or sd == 0:
        return None
    return _smallest(lambda n: _t_power(distance, sd / math.sqrt(n), n - 1, level), power)


def ratio_seeds(a: Sequence[float], b: Sequence[float], level: float = 0.95, power: float = POWER) -> Optional[float]:
    """Seeds per arm for the F interval of ``var(a) / var(b)`` to exclude 1 with probability ``power``
    (the observed ratio taken as true); ``None`` when the ratio is 1, 0, infinite or undefined."""
    if len(a) < MIN_SEEDS or len(b) < MIN_SEEDS:
        return None
    (_, sd_a, _), (_, sd_b, _) = mean_sd(a), mean_sd(b)
    if sd_a == 0 or sd_b == 0 or sd_a == sd_b:
        return None
    ratio, alpha = sd_a**2 / sd_b**2, 1 - level

    def power_at(n: int) -> float:
        f = _scipy_stats.f(n - 1, n - 1)  # the observed ratio / the true one
        # excluded above 1: ratio * F / f(1 - alpha/2) > 1; below: ratio * F / f(alpha/2) < 1
        return float(f.sf(f.ppf(1 - alpha / 2) / ratio) + f.cdf(f.ppf(alpha / 2) / ratio))

    return _smallest(power_at, power)
