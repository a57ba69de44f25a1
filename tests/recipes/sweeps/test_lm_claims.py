"""The ``lm`` and ``lm-qk`` sweeps' claims on hand-made tables with known answers.

Each table is a small world built from formulas (bits per byte, divergences, shares, gradient spreads
per norm, precision, lr and seed); each claim is checked supported, contradicted and inconclusive,
and a few intervals against a direct computation.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Callable, Optional

import pytest

from recipes.sweeps.claims import engine as sc
from recipes.sweeps.claims.markdown import seeds_line
from recipes.sweeps.kinds.lm import HIGH_LR_MIN, LARGE_SHARE, LM, MARGIN_BPB, SCALE_FLOOR, claims, factors, split_arm
from recipes.sweeps.kinds.lm_qk import claims as qk_claims
from recipes.sweeps.records import Row
from recipes.sweeps.robustness import robustness
from recipes.sweeps.score import BPB, DIVERGED_BPB

LRS = (0.001, 0.01, 0.1, 1.0)
HALF = ("rms-half", "mrs-half")
C = 32
# the final bpb of a norm that breaks at high lrs, and of one that stays near its best
STEEP = {0.001: 3.0, 0.01: 2.5, 0.1: 4.0, 1.0: 6.0}
FLAT = {0.001: 3.0, 0.01: 2.5, 0.1: 2.7, 1.0: 3.2}
MID = {0.001: 3.0, 0.01: 2.5, 0.1: 3.0, 1.0: 4.0}
Fn = Callable[[str, str, float, int], Any]


def _world(bpb: Optional[Fn] = None, diverges: Optional[Fn] = None, shares: Optional[Fn] = None,
           grad: Optional[Fn] = None, scale: Optional[Fn] = None, seeds: tuple[int, ...] = (0, 1, 2)) -> list[Row]:
    """The default world supports P1-P5 and P1h: RMSNorm diverges in fp16 at lr >= 0.1 (and so does the
    half-internal RMSNorm in pure fp16), has large shares, uneven gradients and a steep bpb curve; MRSNorm
    matches its best bpb and stays flat."""
    bpb = bpb or (lambda n, p, lr, s: (FLAT if n.startswith("mrs") else STEEP)[lr] + 0.01 * s)
    diverges = diverges or (lambda n, p, lr, s: n.startswith("rms") and p.startswith("fp16") and lr >= 0.1)
    shares = shares or (lambda n, p, lr, s: (0.5 + 0.01 * s, 0.2 + 0.01 * s))  # rms_share, mrs_share
    grad = grad or (lambda n, p, lr, s: (0.2 + 0.01 * s, 0.01 * s) if n == "mrs" else (0.5 + 0.02 * s, 0.1 + 0.01 * s))
    scale = scale or (lambda n, p, lr, s: 65536.0 if p == "fp16" else None)
    rows = []
    arms = [(n, p) for n in ("rms", "mrs", "layer") for p in ("bf16", "fp16")] + [(n, "fp16-true") for n in HALF]
    arms += [(n, p) for n in (*HALF, "rms-half-safe", "mrs-half-safe") for p in ("fp16", "fp16-master")]  # P1m, P1t
    for norm, precision in arms:
        for lr in LRS:
            for seed in seeds:
                dead = bool(diverges(norm, precision, lr, seed))
                rms_share, mrs_share = shares(norm, precision, lr, seed)
                cv, starved = grad(norm, precision, lr, seed)
                rows.append(Row(f"{norm}-{precision}", lr, 16, seed, planned_steps=100, diverged=dead,
                                divergence_step=int(5 / lr) if dead else None, metrics={
                                    "final_bpb": DIVERGED_BPB if dead else bpb(norm, precision, lr, seed),
                                    "max_rms_share": rms_share, "max_mrs_share": mrs_share, "channels": C,
                                    "mean_grad_cv": cv, "mean_starved_frac": starved,
                                    "scaler_final_scale": scale(norm, precision, lr, seed)}))
    return rows


def _verdicts(rows: list[Row]) -> dict[str, str]:
    return {c.key: sc.evaluate(c).verdict for c in claims(rows)}


def _claim(rows: list[Row], key: str) -> sc.Claim:
    return next(sc.evaluate(c) for c in claims(rows) if c.key == key)


def test_the_default_world_supports_every_claim() -> None:
    assert _verdicts(_world()) == {k: "supported" for k in ("P1", "P1h", "P1m", "P1t", "P2", "P3", "P4", "P5")}
    assert (HIGH_LR_MIN, LARGE_SHARE, SCALE_FLOOR) == (0.01, 10.0, 1.0)  # the definitions the report states


def test_p1_numbers_by_hand() -> None:
    """fp16 rms fails at 0.1 and 1 of the high lrs 0.01, 0.1, 1: a failure share of 2/3 per seed; mrs 0."""
    claim = _claim(_world(), "P1")
    (_, rate), (_, steps) = claim.outcomes
    assert rate[0].comparison.label == "batch 16: rms-fp16 - mrs-fp16"
    assert rate[0].interval.estimate == pytest.approx(2 / 3) and rate[0].interval.low == pytest.approx(2 / 3)
    # survived share: mrs 1 everywhere; rms 1, 50/100, 5/100 -> mean 0.5167
    assert steps[0].interval.estimate == pytest.approx(1 - statistics.fmean([1.0, 0.5, 0.05]))


@pytest.mark.parametrize("world,verdict", [
    (dict(diverges=lambda n, p, lr, s: n == "mrs" and p == "fp16" and lr >= 0.1), "contradicted"),
    (dict(diverges=lambda n, p, lr, s: False), "inconclusive"),  # nobody fails: 0 - 0 is not above 0
    (dict(diverges=lambda n, p, lr, s: False, scale=lambda n, p, lr, s: 0.5 if n == "rms" and p == "fp16" and lr >= 0.1
          else 65536.0), "inconclusive"),  # the scaler is exhausted (a failure) but no step was lost: group 2 open
    (dict(seeds=(0,)), "inconclusive"),
])
def test_p1_verdicts(world: dict, verdict: str) -> None:
    assert _claim(_world(**world), "P1").verdict == verdict


def test_p1_counts_an_exhausted_scaler_as_a_failure() -> None:
    rows = _world(diverges=lambda n, p, lr, s: False,
                  scale=lambda n, p, lr, s: SCALE_FLOOR / 2 if n == "rms" and p == "fp16" and lr >= 0.1 else 65536.0)
    (_, rate), _ = _claim(rows, "P1").outcomes
    assert rate[0].verdict == "supported" and rate[0].interval.estimate == pytest.approx(2 / 3)


@pytest.mark.parametrize("shares,verdict", [
    (lambda n, p, lr, s: (0.5 + 0.01 * s, 0.8 + 0.01 * s), "contradicted"),  # MRSNorm's share higher
    (lambda n, p, lr, s: (0.5, 0.5 + (-0.1, 0.1, 0.0)[s]), "inconclusive"),  # spread across 0
    (lambda n, p, lr, s: (2.0 / C + 0.001 * s, 0.01), "contradicted"),  # a small share: 2 uniform shares, not 10
])
def test_p2_verdicts(shares: Fn, verdict: str) -> None:
    assert _claim(_world(shares=shares), "P2").verdict == verdict


def test_p2_numbers_by_hand() -> None:
    (_, large), (_, lower) = _claim(_world(), "P2").outcomes
    assert [o.comparison.label for o in large] == ["rms-bf16, batch 16: C x rms_share", "rms-fp16, batch 16: C x rms_share"]
    assert large[0].interval.estimate == pytest.approx(C * statistics.fmean([0.5, 0.51, 0.52]))
    assert lower[1].interval.estimate == pytest.approx(-0.3)


@pytest.mark.parametrize("grad,verdict", [
    (lambda n, p, lr, s: (0.8 + 0.01 * s, 0.3) if n == "mrs" else (0.5 + 0.02 * s, 0.1 + 0.01 * s), "contradicted"),
    (lambda n, p, lr, s: (0.5 + (-0.1, 0.1, 0.0)[s] if n == "mrs" else 0.5 + 0.01 * s, 0.1 + 0.01 * s),
     "inconclusive"),
])
def test_p3_verdicts(grad: Fn, verdict: str) -> None:
    assert _claim(_world(grad=grad), "P3").verdict == verdict


def test_p3_leaves_diverged_cells_out() -> None:
    """rms-fp16 diverged at lr 0.1 and 1 in every seed: those cells cannot be compared (2 per figure)."""
    claim = _claim(_world(), "P3")
    excluded = [o.comparison.label for _, group in claim.outcomes for o in group if o.excluded]
    assert sorted(excluded) == sorted(["fp16, lr 0.1, batch 16: mrs - rms", "fp16, lr 1, batch 16: mrs - rms"] * 2)
    assert "4 not measurable, left out" in claim.why


def test_p4_sensitivity_by_hand() -> None:
    """LR sensitivity on bpb: mean over the lrs of (bpb - the seed's best), a diverged cell at 8 bpb."""
    by = {s.arm: s for s in robustness(_world(), BPB)}
    assert by["mrs-bf16"].per_seed_sensitivity[0] == pytest.approx(statistics.fmean([0.5, 0.0, 0.2, 0.7]))
    assert by["rms-fp16"].per_seed_sensitivity[0] == pytest.approx(statistics.fmean([0.5, 0.0, 5.5, 5.5]))
    assert by["mrs-bf16"].per_seed_max_lr == [0.1, 0.1, 0.1]  # 2.7 <= 1.1 x 2.5, 3.2 is not
    assert by["rms-bf16"].per_seed_max_lr == [0.01, 0.01, 0.01] and by["rms-bf16"].best_lr == 0.01


@pytest.mark.parametrize("bpb,verdict", [
    (lambda n, p, lr, s: (STEEP if n == "mrs" else FLAT)[lr] + 0.01 * s, "contradicted"),
    (lambda n, p, lr, s: STEEP[lr] + 0.01 * s, "inconclusive"),  # the same curve: differences of exactly 0
])
def test_p4_verdicts(bpb: Fn, verdict: str) -> None:
    rows = _world(bpb=bpb, diverges=lambda n, p, lr, s: False)
    assert _claim(rows, "P4").verdict == verdict


@pytest.mark.parametrize("offset,verdict", [
    (lambda s: 0.0, "supported"),
    (lambda s: 0.3 + 0.01 * s, "contradicted"),  # MRSNorm 0.3 bpb worse at its best lr
    (lambda s: (-0.2, 0.25, 0.05)[s], "inconclusive"),
])
def test_p5_verdicts(offset: Callable[[int], float], verdict: str) -> None:
    rows = _world(bpb=lambda n, p, lr, s: (FLAT if n == "mrs" else STEEP)[lr] + 0.01 * s + (offset(s) if n == "mrs" else 0))
    claim = _claim(rows, "P5")
    assert claim.verdict == verdict
    first = claim.outcomes[0][1][0]
    assert first.comparison.threshold == MARGIN_BPB and first.comparison.label == "bf16, batch 16: mrs - rms, each at its best lr"


def test_a_missing_arm_leaves_its_claims_inconclusive() -> None:
    rows = [r for r in _world() if not split_arm(r.arm)[0].startswith("mrs")]
    # P2 rests on the RMSNorm runs alone (both shares of their inputs)
    assert _verdicts(rows) == {"P1": "inconclusive", "P1h": "inconclusive", "P1m": "inconclusive",
                               "P1t": "inconclusive", "P2": "supported", "P3": "inconclusive", "P4": "inconclusive",
                               "P5": "inconclusive"}
    assert "mrs-fp16 was not in this sweep" in str([o.comparison.reason for _, g in _claim(rows, "P1").outcomes
                                                    for o in g])


def test_p1h_compares_the_half_internal_norms_in_pure_fp16() -> None:
    claim = _claim(_world(), "P1h")
    (_, rate), (_, steps) = claim.outcomes
    assert rate[0].comparison.label == "batch 16: rms-half-fp16-true - mrs-half-fp16-true"
    assert rate[0].interval.estimate == pytest.approx(2 / 3) and claim.verdict == "supported"
    # P1 (as shipped) does not look at them: the same world with only the pure-fp16 cells changed
    quiet = _world(diverges=lambda n, p, lr, s: n == "rms" and p == "fp16" and lr >= 0.1)
    assert _claim(quiet, "P1").verdict == "supported" and _claim(quiet, "P1h").verdict == "inconclusive"


def test_p1h_when_pure_fp16_fails_for_every_norm() -> None:
    """AdamW in float16 (eps rounds to 0) breaks every pure-fp16 run at step 1, whatever the norm: the same failure
    share for both, an interval [0, 0] on the threshold, and no number of seeds that would resolve it."""
    rows = _world(diverges=lambda n, p, lr, s: p == "fp16-true" or (n == "rms" and p == "fp16" and lr >= 0.1))
    claim = _claim(rows, "P1h")
    (_, rate), (_, steps) = claim.outcomes
    assert claim.verdict == "inconclusive" and rate[0].interval.estimate == 0 and rate[0].seeds is None
    assert seeds_line("P1h", rate[0]).endswith("no number of seeds resolves it (the estimate sits on the threshold).")
    assert _claim(rows, "P1").verdict == "supported"


def test_arms_split_into_tidy_columns() -> None:
    assert split_arm("rms-half-fp16-true") == ("rms-half", "fp16-true") and split_arm("mrs-fp16") == ("mrs", "fp16")
    assert factors({"arm": "mrs-half-fp16-true"}) == {"norm": "mrs-half", "precision": "16-true"}
    assert {factors({"arm": a})["precision"] for a in LM.arms} == {"16-mixed", "bf16-mixed", "16-true", "16-true+fp32-master",
                                                                           "bf16-true+fp32-master", "32-true"}
    assert factors({"arm": "rms-half-safe-as-mrs-bf16-master"}) == {"norm": "rms-half-safe-as-mrs",
                                                                    "precision": "bf16-true+fp32-master"}
    row = LM.row({"arm": "rms-bf16", "lr": "0.1", "batch_size": "16", "seed": "0", "max_fp16_overflow_frac": "0.25"})
    assert row.factors == {"norm": "rms", "precision": "bf16-mixed"}
    assert row.metrics["max_x2_over_fp16_frac"] == 0.25  # a record written before the rename


# ----------------------------------------------------------------------------- lm-qk
def _qk_world(mrs_logit: Callable[[float], float] = lambda lr: 5.0, mrs_bpb: Optional[Callable[[float, int], float]] = None
              ) -> list[Row]:
    """none: logits grow 10x per decade and bpb breaks at high lrs; layer and mrs stay bounded, mrs the flattest."""
    rows = []
    for lr in LRS:
        decade = round(math.log10(lr / 0.001))
        for seed in range(3):
            jitter = 1 + 0.05 * seed
            values = {"none": (3 * 10**decade * jitter, STEEP[lr] + 0.01 * seed),
                      "layer": (4 * jitter, MID[lr] + 0.1 + 0.01 * seed),
                      "mrs": (mrs_logit(lr) * jitter, mrs_bpb(lr, seed) if mrs_bpb else FLAT[lr] + 0.01 * seed)}
            for arm, (logit, bpb) in values.items():
                rows.append(Row(arm, lr, 16, seed, planned_steps=100,
                                metrics={"max_logit": logit, "final_bpb": bpb}))
    return rows


def _qk_verdicts(rows: list[Row]) -> dict[str, str]:
    return {c.key: sc.evaluate(c).verdict for c in qk_claims(rows)}


def test_lm_qk_claims_supported_when_only_none_grows() -> None:
    assert _qk_verdicts(_qk_world()) == {k: "supported" for k in ("0", "W1", "W2", "Q1", "Q2", "Q3")}


def test_lm_qk_claims_contradicted_and_inconclusive() -> None:
    grows = _qk_verdicts(_qk_world(mrs_logit=lambda lr: 3 * (lr / 0.001) * 2))  # twice none's logits
    assert grows["Q1"] == "contradicted" and grows["W1"] == "supported"
    worse = _qk_verdicts(_qk_world(mrs_bpb=lambda lr, s: STEEP[lr] + 0.01 * s + 0.3))  # as steep as none, worse
    assert worse["Q3"] == "contradicted" and worse["Q2"] == "inconclusive"  # same curve as none: a difference of 0
    one_seed = [r for r in _qk_world() if r.seed == 0]
    assert set(_qk_verdicts(one_seed).values()) == {"inconclusive"}


def test_p2_uses_the_lrs_a_run_recorded_at() -> None:
    """A run that diverged before its first logging step recorded no shares: P2 averages over the others."""
    def shares(n: str, p: str, lr: float, s: int) -> tuple:
        return (None, None) if n == "rms" and p == "fp16" and lr == 1.0 else (0.5 + 0.01 * s, 0.2 + 0.01 * s)

    (_, large), _ = _claim(_world(shares=shares), "P2").outcomes
    assert large[1].comparison.label == "rms-fp16, batch 16: C x rms_share" and large[1].verdict == "supported"
    assert large[1].interval.estimate == pytest.approx(C * 0.51)
    nothing = _claim(_world(shares=lambda n, p, lr, s: (None, None)), "P2")
    assert nothing.verdict == "inconclusive" and "has 0 with a record" in str(
        [o.comparison.reason for _, g in nothing.outcomes for o in g])
