"""The stress report's statistics, robustness summaries and claim verdicts on hand-made tables."""

from __future__ import annotations

import math
from typing import Callable, Optional

import numpy as np
import pytest
from scipy import stats

from recipes.sweeps.cells.image import counted_top1
from recipes.sweeps.claims import engine as sc
from recipes.sweeps.claims.markdown import markdown, seeds_line, show_seeds
from recipes.sweeps.claims.stats import (POWER, Interval, mean_interval, mean_sd, mean_seeds, ratio_seeds,
                                         variance_ratio_interval, verdict, welch_interval, welch_seeds)
from recipes.sweeps.kinds.norm import NORM, claims
from recipes.sweeps.records import Row
from recipes.sweeps.robustness import robustness

LRS = (0.03, 0.1, 0.3, 0.4, 1.0, 3.0)
GOOD = (0.970, 0.971, 0.972)  # a norm that trains, three seeds (sd 0.001)
Acc = Callable[[str, float, int, int], Optional[float]]  # None: the seed diverged at step 2


def _table(acc: Acc, seeds: tuple[int, ...] = (0, 1, 2), lrs: tuple[float, ...] = LRS,
           norms: tuple[str, ...] = ("layer", "rms", "mrs", "batch")) -> list[Row]:
    rows = []
    for norm in norms:
        for lr in lrs:
            for bs in (32, 64, 128):
                for seed in seeds:
                    a = acc(norm, lr, bs, seed)
                    rows.append(Row(
                        norm, lr, bs, seed, num_classes=10,
                        final_top1=0.1 if a is None else a, best_top1=0.1 if a is None else a,
                        diverged=a is None, divergence_step=2 if a is None else None, planned_steps=400,
                        metrics={"mean_grad_cv": None if a is None else (0.30 if norm == "mrs" else 0.50) + 0.001 * seed},
                    ))
    return rows


def _paper_like(norm: str, lr: float, bs: int, seed: int) -> Optional[float]:
    """LayerNorm/RMSNorm diverge at lr >= 0.3; everything else trains to the same accuracy."""
    if norm in ("layer", "rms") and lr >= 0.3:
        return None
    return GOOD[seed]


def _verdicts(rows: list[Row]) -> dict[str, sc.Claim]:
    return {c.key: sc.evaluate(c) for c in claims(rows)}


def claims_section(rows: list[Row]) -> list[str]:
    return markdown([sc.evaluate(c) for c in claims(rows)], NORM.rule)


# ----------------------------------------------------------------------------- intervals
@pytest.mark.parametrize("a,b", [([0.90, 0.95, 0.97], [0.80, 0.86, 0.83, 0.81]), ([1.0, 2.0], [0.5, 0.7, 0.9])])
def test_welch_and_t_intervals_match_scipy(a: list[float], b: list[float]) -> None:
    ref = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    iv = welch_interval(a, b)
    assert iv.low == pytest.approx(ref.low) and iv.high == pytest.approx(ref.high)
    assert iv.estimate == pytest.approx(sum(a) / len(a) - sum(b) / len(b))
    one = stats.ttest_1samp(a, 0.0).confidence_interval(0.9)
    iv = mean_interval(a, 0.9)
    assert (iv.low, iv.high) == (pytest.approx(one.low), pytest.approx(one.high))


def test_scaled_welch_is_the_interval_of_a_minus_scaled_b() -> None:
    a, b = [0.9, 0.92, 0.95], [1.0, 1.02, 1.01]
    direct = welch_interval(a, [0.9 * v for v in b])
    scaled = welch_interval(a, b, scale=0.9)
    assert (scaled.low, scaled.high) == (pytest.approx(direct.low), pytest.approx(direct.high))


def test_variance_ratio_interval_three_seeds() -> None:
    # equal spreads, 2 and 2 degrees of freedom: F(0.975; 2, 2) = 39 exactly
    iv = variance_ratio_interval([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
    assert iv.estimate == pytest.approx(1.0)
    assert (iv.low, iv.high) == (pytest.approx(1 / 39), pytest.approx(39))
    assert math.isinf(variance_ratio_interval([1.0, 2.0], [3.0, 3.0]).low)


def test_zero_spread_is_a_point_and_one_seed_is_refused() -> None:
    iv = mean_interval([0.1, 0.1, 0.1])
    assert (iv.low, iv.high) == (pytest.approx(0.1), pytest.approx(0.1))
    with pytest.raises(ValueError, match="at least 2"):
        welch_interval([0.5], [0.4, 0.3])


@pytest.mark.parametrize("low,high,side,expected", [
    (0.1, 0.2, "above", "supported"), (-0.2, -0.1, "above", "contradicted"), (-0.1, 0.1, "above", "inconclusive"),
    (-0.2, -0.1, "below", "supported"), (0.0, 0.1, "below", "inconclusive"), (0.1, 0.2, "below", "contradicted"),
])
def test_verdict(low: float, high: float, side: str, expected: str) -> None:
    assert verdict(Interval(0.0, low, high, 0.95), 0.0, side) == expected


def test_counted_top1_is_chance_from_the_divergence_on() -> None:
    assert counted_top1([(10, 0.5), (20, 0.7), (30, 0.2)], 25, 0.1) == [(10, 0.5), (20, 0.7), (25, 0.1)]
    assert counted_top1([(10, 0.5)], 3, 0.01) == [(3, 0.01)]
    assert counted_top1([(10, 0.5)], None, 0.01) == [(10, 0.5)]


# ----------------------------------------------------------------------------- robustness
def test_robustness_sensitivity_and_breaking_point() -> None:
    curve = {0.03: 0.80, 0.1: 0.90, 0.3: 0.85, 0.4: 0.50, 1.0: None, 3.0: 0.05}  # None: diverged -> chance
    rows = _table(lambda n, lr, bs, s: curve[lr] if n == "mrs" else GOOD[s])
    mrs = next(r for r in robustness(rows) if r.arm == "mrs" and r.batch_size == 64)
    floored = [0.80, 0.90, 0.85, 0.50, 0.10, 0.10]  # 0.05 is below chance: floored
    assert mrs.lr_sensitivity == pytest.approx(sum(0.90 - a for a in floored) / 6)
    assert mrs.lr_sensitivity_sd == pytest.approx(0.0)
    assert mrs.max_lr_90 == 0.3 and mrs.best_lr == 0.1 and mrs.best_top1 == pytest.approx(0.90)
    flat = next(r for r in robustness(rows) if r.arm == "layer" and r.batch_size == 32)
    assert flat.lr_sensitivity == pytest.approx(0.0) and flat.max_lr_90 == 3.0


def test_robustness_marks_a_missing_learning_rate_incomplete() -> None:
    rows = [r for r in _table(_paper_like) if not (r.arm == "rms" and r.lr == 1.0)]
    by = {(r.arm, r.batch_size): r for r in robustness(rows)}
    assert not by[("rms", 32)].complete and by[("rms", 32)].lr_sensitivity is None
    assert by[("mrs", 32)].complete and by[("mrs", 32)].seeds == 3


# ----------------------------------------------------------------------------- claims
def test_claims_on_a_table_with_known_answers() -> None:
    claims = _verdicts(_table(_paper_like))
    # 2: every baseline cell at lr 0.3/0.4 is chance (all seeds diverged), MRSNorm at 97 %
    assert claims["2"].verdict == "supported" and claims["2"].why == "all 18 comparisons supported"
    # 3: MRSNorm at lr 0.4, batch 32 reaches its lr-0.1 accuracy, so it does not "struggle"
    assert claims["3"].verdict == "contradicted"
    assert "batch 32: mrs@0.4 - 0.9 x mrs@0.1" in claims["3"].why
    # 1: equal accuracy (difference 0, interval +-0.00227) is within the 1-point margin, but the
    # variance ratio of equal spreads, [1/39, 39], decides nothing
    assert claims["1"].verdict == "inconclusive" and "6 of 7 comparisons supported" in claims["1"].why
    # 4: MRSNorm and RMSNorm at their best lr (0.03: ties go to the smaller lr) are equal
    assert claims["4"].verdict == "supported"
    assert "mrs @ lr 0.03" in claims["4"].outcomes[0][1][0].comparison.numbers
    # M: lower grad_cv where both trained; the diverged baselines logged none: left out, listed
    assert claims["M"].verdict == "supported" and "12 not measurable" in claims["M"].why


def test_contradicted_mechanism() -> None:
    rows = _table(_paper_like)
    for r in rows:
        if r.arm == "mrs":
            r.metrics["mean_grad_cv"] = 0.9 + 0.001 * r.seed  # MRSNorm's spread is higher
    claim = _verdicts(rows)["M"]
    assert claim.verdict == "contradicted" and "lr 0.1, batch 32: mrs - layer" in claim.why


def test_mechanism_leaves_out_collapsed_runs() -> None:
    """A baseline that collapsed with a finite loss and vanished gradients (grad_cv 0) is not "more even"."""
    rows = _table(_paper_like)
    for r in rows:
        if r.diverged:
            r.diverged, r.divergence_step, r.final_top1, r.metrics["mean_grad_cv"] = False, None, 0.1, 0.0
    claim = _verdicts(rows)["M"]
    assert claim.verdict == "supported" and "12 not measurable" in claim.why


def test_too_few_seeds_and_missing_cells_are_inconclusive_with_the_reason() -> None:
    one_seed = _verdicts(_table(_paper_like, seeds=(0,)))
    for claim in one_seed.values():
        assert claim.verdict == "inconclusive" and "too few seeds" in claim.why, claim.why
    no_04 = _verdicts(_table(_paper_like, lrs=(0.03, 0.1, 0.3, 1.0, 3.0)))
    assert no_04["3"].verdict == "inconclusive" and "11 x missing cells" in no_04["3"].why


def test_a_contradiction_must_hold_at_the_bonferroni_level() -> None:
    """Two comparisons: one supported, one below its threshold at 95 % but not at 97.5 %."""
    fixed = lambda iv: (lambda level: iv)  # noqa: E731
    wide = {0.95: Interval(-0.3, -0.5, -0.1, 0.95), 0.975: Interval(-0.3, -0.6, 0.1, 0.975)}
    claim = sc.Claim("X", "t", "p", "tested", groups=[("g", [
        sc.Comparison("ok", "", "above", 0.0, fixed(Interval(1.0, 0.5, 1.5, 0.95))),
        sc.Comparison("edge", "", "above", 0.0, lambda level: wide[round(level, 4)]),
    ])])
    sc.evaluate(claim)
    assert claim.verdict == "inconclusive" and "not at the Bonferroni level 97.5 %" in claim.why
    # and, with the Bonferroni interval also below the threshold, contradicted
    wide[0.975] = Interval(-0.3, -0.6, -0.05, 0.975)
    assert sc.evaluate(claim).verdict == "contradicted"


def test_claims_section_states_the_rule_and_every_claim() -> None:
    text = "\n".join(claims_section(_table(_paper_like)))
    assert text.startswith("## Claims") and "**Decision rule.**" in text and "Welch" in text
    for key in ("1", "2", "3", "4", "M"):
        assert f"### Claim {key}:" in text
    assert "δ = 1 point" in text and "Bonferroni" in text
    assert "| lr 0.4, batch 128: rms | rms 10.00 ± 0.00 % (n=3) | 10.00 [10.00, 10.00] % | < 19.00 % |" in text


# ----------------------------------------------------------------------------- seeds needed
def _simulated_power(draw: Callable[[np.random.Generator, int], bool], n: int, runs: int = 1500) -> float:
    rng = np.random.default_rng(0)
    return sum(draw(rng, n) for _ in range(runs)) / runs


def _excludes(iv: Interval, threshold: float) -> bool:
    return iv.low > threshold or iv.high < threshold


@pytest.mark.parametrize("a,b,threshold", [([0.0, 0.11, -0.11, 0.05], [0.025, 0.136, -0.085, 0.075], 0.0),
                                           ([3.0, 3.4, 2.9], [3.5, 3.1, 3.3, 3.2], 0.03)])
def test_welch_seeds_give_the_stated_power_by_simulation(a: list[float], b: list[float], threshold: float) -> None:
    """At the seeds per arm welch_seeds names, Welch's interval of samples drawn with the observed means and sds
    excludes the threshold in about 80 % of draws (noncentral t, checked against a simulation)."""
    n = int(welch_seeds(a, b, threshold))
    (ma, sa, _), (mb, sb, _) = mean_sd(a), mean_sd(b)

    def draw(rng: np.random.Generator, k: int) -> bool:
        return _excludes(welch_interval(rng.normal(ma, sa, k).tolist(), rng.normal(mb, sb, k).tolist()), threshold)

    assert _simulated_power(draw, n) == pytest.approx(POWER, abs=0.04)
    assert _simulated_power(draw, max(2, n // 2)) < POWER - 0.1  # and half of it is clearly too few


def test_mean_and_ratio_seeds_by_simulation_and_the_normal_formula() -> None:
    values = [0.1, 0.2, 0.0, 0.15]
    n = int(mean_seeds(values, 0.0))
    mean, sd, _ = mean_sd(values)
    power = _simulated_power(lambda rng, k: _excludes(mean_interval(rng.normal(mean, sd, k).tolist()), 0.0), n)
    assert power == pytest.approx(POWER, abs=0.04)
    big = mean_seeds([0.0, 1.0, 0.5], 0.5 - 0.05)  # far from the threshold in sds: the normal formula
    normal = ((stats.norm.ppf(0.975) + stats.norm.ppf(POWER)) * 0.5 / 0.05) ** 2
    assert normal <= big <= normal + 5
    a, b = [1.0, 2.0, 3.0, 4.0], [1.0, 1.5, 2.0, 2.5]  # variance ratio 4
    n = int(ratio_seeds(a, b))
    ratio_power = _simulated_power(lambda rng, k: _excludes(variance_ratio_interval(
        rng.normal(0, 2, k).tolist(), rng.normal(0, 1, k).tolist()), 1.0), n, runs=1000)
    assert ratio_power == pytest.approx(POWER, abs=0.05)


def test_no_number_of_seeds_resolves_a_difference_on_the_threshold_or_without_spread() -> None:
    assert welch_seeds([1.0, 2.0], [1.0, 2.0], 0.0) is None  # on the threshold
    assert welch_seeds([1.0, 1.0], [0.0, 0.0], 0.0) is None  # no spread: the interval [1, 1] decides already
    assert welch_seeds([1.0], [0.0, 1.0], 0.0) is None and mean_seeds([0.3, 0.3], 0.0) is None
    assert ratio_seeds([1.0, 2.0], [3.0, 4.0]) is None  # equal variances
    assert math.isinf(welch_seeds([0.0, 1.0], [0.0, 1.0 + 1e-7], 0.0))  # beyond MAX_SEEDS


def test_seeds_needed_in_the_report() -> None:
    """Every inconclusive comparison gets a line under the verdict table and a number in its row."""
    rows = _table(lambda n, lr, bs, s: (None if n in ("layer", "rms") and lr >= 0.3 else
                                        (0.95, 0.97, 0.96)[s] if n == "mrs" else GOOD[s]))
    text = "\n".join(claims_section(rows))
    assert "**Seeds needed.**" in text and "80 % power" in text
    claim = _verdicts(rows)["1"]
    (_, matches), _ = claim.outcomes
    open_ = [o for o in matches if o.verdict == "inconclusive"]
    assert open_ and all(o.seeds is not None for o in open_)
    line = seeds_line("1", open_[0])
    assert line.startswith("1 batch 32: mrs - layer: ") and f"about {show_seeds(open_[0].seeds)} seeds per arm" in line
    assert f"- {line}" in text and f"| {show_seeds(open_[0].seeds)} |" in text
    assert "- 2: " not in text  # claim 2 is decided: nothing to plan for
    one = "\n".join(claims_section(_table(_paper_like, seeds=(0,))))
    assert "- 1: 7 comparisons without an interval, so no spread to plan from (too few seeds: " in one
    assert (show_seeds(7.0), show_seeds(216.0), show_seeds(2449.0), show_seeds(math.inf)) == (
        "7", "220", "2,400", "more than 1,000,000")
