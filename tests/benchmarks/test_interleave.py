"""The benchmarks' round orders (``benchmarks/interleave.py``): every row follows every other about
equally often, which a rotation of one fixed order does not give."""

from __future__ import annotations

import math
import random
import statistics
import sys
from collections import Counter
from itertools import pairwise

import pytest
from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from interleave import ratio_interval, round_orders, time_steps  # noqa: E402


def _followers(orders: list[list[str]]) -> Counter:
    """(row, the row that ran just before it) over all rounds, the rounds run back to back."""
    flat = [name for order in orders for name in order]
    return Counter((b, a) for a, b in pairwise(flat))


def test_each_round_is_a_permutation_and_the_seed_fixes_them() -> None:
    names = ["default", "native", "inductor", "eager"]
    orders = round_orders(names, 50)
    assert len(orders) == 50 and all(sorted(o) == sorted(names) for o in orders)
    assert round_orders(names, 50) == orders and round_orders(names, 50, seed=1) != orders


def test_every_row_follows_every_other_about_equally_often() -> None:
    names = ["default", "native", "inductor", "eager"]
    rounds = 400
    counts = _followers(round_orders(names, rounds))
    # 4 rows, 400 rounds: each of the 12 (row, predecessor) pairs is expected 100 times inside
    # the rounds and 25 times across their seams (399 seams over 16 pairs): 125, binomial
    # spread about +-11
    for row in names:
        for before in names:
            if row != before:
                assert 90 <= counts[(row, before)] <= 160, (row, before, counts[(row, before)])
    # what a rotation gives instead: "default" always after "eager", never after "native"
    rotated = [names[i % 4:] + names[: i % 4] for i in range(rounds)]
    assert _followers(rotated)[("default", "native")] == 0


def test_time_steps_warms_up_then_times_every_name_once_a_round() -> None:
    calls: list[str] = []
    times = time_steps(calls.append, ["a", "b", "c"], rounds=4, steps=3, warmup=2)
    assert calls[:6] == ["a", "a", "b", "b", "c", "c"]  # the untimed warm-up
    timed = calls[6:]
    assert len(timed) == 4 * 3 * 3 and Counter(timed) == {"a": 12, "b": 12, "c": 12}
    rounds = [timed[i:i + 9] for i in range(0, len(timed), 9)]
    assert [[r[j] for j in range(0, 9, 3)] for r in rounds] == round_orders(["a", "b", "c"], 4)
    assert {k: len(v) for k, v in times.items()} == {"a": 4, "b": 4, "c": 4}
    assert all(t >= 0 for v in times.values() for t in v)



def test_time_steps_reads_the_given_clock() -> None:
    # a clock that advances 6 s per reading: each round of 3 steps spans one reading pair
    ticks = iter(range(0, 1000, 6))
    times = time_steps(lambda name: None, ["a", "b"], rounds=2, steps=3, warmup=0, clock=lambda: next(ticks))
    assert times == {"a": [2.0, 2.0], "b": [2.0, 2.0]}


def test_ratio_interval_is_the_median_of_the_paired_ratios() -> None:
    base = [1.0, 2.0, 4.0, 1.5, 3.0]
    ratios = [0.9, 1.3, 1.0, 1.1, 0.95]
    med, lo, hi = ratio_interval([r * b for r, b in zip(ratios, base)], base)
    assert med == pytest.approx(statistics.median(ratios))  # not median(times) / median(base) = 1.1
    assert min(ratios) <= lo <= med <= hi <= max(ratios)
    assert ratio_interval([3.0] * 7, [1.5] * 7) == (2.0, 2.0, 2.0)  # no spread, no interval


def test_ratio_interval_covers_the_true_ratio_about_as_often_as_it_says() -> None:
    # 200 simulated benchmarks of 31 rounds: a round-wide slowdown hits both rows (so the
    # paired ratio cancels it) and each row has its own noise around a true ratio of 0.98
    rng = random.Random(1)
    covered = 0
    for _ in range(200):
        round_noise = [math.exp(rng.gauss(0, 0.2)) for _ in range(31)]
        base = [75.0 * n * math.exp(rng.gauss(0, 0.01)) for n in round_noise]
        ours = [0.98 * 75.0 * n * math.exp(rng.gauss(0, 0.01)) for n in round_noise]
        _, lo, hi = ratio_interval(ours, base, resamples=400)
        covered += lo <= 0.98 <= hi
        assert hi - lo < 0.04  # the round-wide 20 % noise is cancelled (per-row noise alone: about 0.013)
    assert 170 <= covered <= 200  # 95 % nominal: about 190 (percentile bootstrap runs a bit low)


def test_ratio_interval_rejects_unpaired_rounds_and_bad_levels() -> None:
    with pytest.raises(ValueError, match="as many rounds"):
        ratio_interval([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="level"):
        ratio_interval([1.0], [1.0], level=1.5)
