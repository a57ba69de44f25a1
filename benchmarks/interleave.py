"""The order of the rows in each round of an interleaved benchmark (``bench_norm``, ``bench_small``,
``bench_lm_step``, ``bench_train_step``), and the timing loop of the two training-step benchmarks.

Rows are timed in turns within one process, so that machine noise hits them alike. What a row
leaves behind (caches filled with its buffers, large blocks freed for the next allocation) costs
the row that runs next, so the order must not give one row the same neighbour every round. A
rotation of one fixed order does: it changes which row starts a round, not who follows whom,
and in ``bench_norm`` it put the default module after the eager formula (the row that trashes
the caches) in every round. Each round here is a fresh, seeded random permutation.

Because every round times every row, the rounds pair the rows: :func:`ratio_interval` gives the
median of one row's per-round ratios to another and a bootstrap interval around it, which says
whether a ratio of x0.99 is below x1.0 or within the noise. That noise is one run's: what a
process shares across all its rounds (where its buffers landed) moves the ratio between runs
by about 1 % (docs/performance-lm.md#avx-512-row-kernels), so a claim needs several runs.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
from scipy import stats

__all__ = ["ratio_interval", "round_orders", "time_steps"]


def round_orders(names: Sequence[str], rounds: int, seed: int = 0) -> list[list[str]]:
    """One order of ``names`` per round, a random permutation each (the same for one ``seed``).

    Example:
        >>> round_orders(["a", "b", "c"], 2)
        [['b', 'c', 'a'], ['b', 'c', 'a']]
    """
    rng = random.Random(seed)
    return [rng.sample(list(names), len(names)) for _ in range(rounds)]


def time_steps(step: Callable[[str], None], names: Sequence[str], rounds: int, steps: int,
               warmup: int = 2, clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Seconds per ``step(name)`` for every name: ``warmup`` untimed calls each (allocator,
    first-call compiles), then ``rounds`` rounds in :func:`round_orders`, each the mean of
    ``steps`` calls, timed by ``clock`` (``time.process_time``: the process's CPU time, which
    other jobs on a shared machine do not inflate).

    Not ``torch.utils.benchmark.Timer``: its ``timeit`` runs untimed warm-up calls of the row right
    before timing it and sets torch's thread count (1 by default), so the row would no longer pay for
    what its neighbour left behind, which the random orders exist to spread over every row alike."""
    for name in names:
        for _ in range(warmup):
            step(name)
    times: dict[str, list[float]] = {name: [] for name in names}
    for order in round_orders(names, rounds):
        for name in order:
            t0 = clock()
            for _ in range(steps):
                step(name)
            times[name].append((clock() - t0) / steps)
    return times



def ratio_interval(times: Sequence[float], base: Sequence[float], level: float = 0.95,
                   resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """The median of the per-round ratios ``times[i] / base[i]`` and a percentile-bootstrap
    interval of that median at ``level`` (``scipy.stats.bootstrap``: ``resamples`` resamples of the
    rounds, seeded).

    The rounds of :func:`time_steps` are paired: noise that slows a whole round slows both rows,
    so the per-round ratio is steadier than the ratio of the two medians.

    Example:
        >>> ratio_interval([2.0, 2.2, 1.8], [1.0, 1.1, 0.9])
        (2.0, 2.0, 2.0)
    """
    if len(times) != len(base) or not times:
        raise ValueError(f"ratio_interval: needs as many rounds of both rows (got {len(times)} and {len(base)})")
    if not 0.0 < level < 1.0:
        raise ValueError(f"ratio_interval: level must be in (0, 1), got {level}")
    ratios = [t / b for t, b in zip(times, base)]
    median = statistics.median(ratios)
    if len(set(ratios)) < 2:  # no spread: nothing to resample (scipy needs two distinct values)
        return median, median, median
    ci = stats.bootstrap((np.asarray(ratios),), np.median, confidence_level=level, n_resamples=resamples,
                         method="percentile", rng=np.random.default_rng(seed)).confidence_interval
    return median, float(ci.low), float(ci.high)
