"""The ``lm`` sweep's claims: P1 (as shipped), P1h (as the paper states it), P1m and P1t (the norms in float16 inside
16-mixed, and in 16-true with float32 master weights), P2-P5, from typed ``results.csv`` rows.

The arms they compare are named ``<norm>-<precision>`` (:func:`split_arm`); the kind itself, its
figure and what a cell measures are :mod:`recipes.sweeps.kinds.lm`. The statements and how each is
tested: :data:`TEXT` (the report prints it); the thresholds are module constants fixed before any
sweep ran. Needs no torch.
"""

from __future__ import annotations

import math
import statistics
from typing import Callable, Optional

from recipes.sweeps.claims.engine import (Claim, Comparison, Values, arm_values, single, unmeasurable,
                                          welch_comparison)
from recipes.sweeps.claims.markdown import DECISION_RULE
from recipes.sweeps.claims.stats import MIN_SEEDS
from recipes.sweeps.claims.mechanism import MECHANISM_LR
from recipes.sweeps.records import Row, distinct_lrs, select, survived
from recipes.sweeps.robustness import by_arm, robustness
from recipes.sweeps.score import BPB, DIVERGED_BPB, NEAR_FRACTION

__all__ = ["CLAIM_PRECISIONS", "HALF_NORMS", "NAIVE_HALF", "SAFE_HALF", "HIGH_LR_MIN", "LARGE_SHARE", "MARGIN_BPB", "NORMS", "PRECISIONS", "RULE", "SCALE_CONTROLS", "EXTRA_NORMS",
           "SCALE_FLOOR", "TEXT", "arm_name", "claims", "failed", "per_seed", "split_arm"]

#: the experimental norms computed in the input's dtype (lightning_mrs.swap.half): squares formed in it, and safe
NAIVE_HALF, SAFE_HALF = ("rms-half", "mrs-half"), ("rms-half-safe", "mrs-half-safe")
HALF_NORMS = (*NAIVE_HALF, *SAFE_HALF)
NORMS = ("rms", "mrs", "layer", *HALF_NORMS)
#: the output-scale controls of the safe pair (recipes/sweeps/output_scale.py: gains started at the other formula's
#: output scale) and Dynamic Tanh (Zhu et al. 2025, the swap target ``dyt``): arms of P1t's rerun (issue 56); Dynamic
#: erf (Chen et al., arXiv:2512.10938, ``derf``) beside DyT (issue 64)
SCALE_CONTROLS = ("rms-half-safe-as-mrs", "mrs-half-safe-as-rms")
EXTRA_NORMS = (*SCALE_CONTROLS, "dyt", "derf")
#: the norm-free arms of issue 64's comparison (docs/results.md), at the sweep's standard bf16 beside rms/mrs/layer
POINTWISE_NORMS = ("dyt", "derf")
#: an arm's precision -> its name in results.csv: Lightning's (fp16: with a loss scaler, also on the CPU; fp16-true:
#: the model in float16); fp16-master: 16-true with float32 master weights and AdamW state
#: (recipes/sweeps/cells/master_weights.py)
PRECISIONS = {"bf16": "bf16-mixed", "fp16": "16-mixed", "fp16-true": "16-true", "fp16-master": "16-true+fp32-master",
              "bf16-master": "bf16-true+fp32-master", "fp32": "32-true"}
#: the precisions the claims P2-P5 compare (fp32 is a reference only; fp16-true: P1h; fp16-master: P1t)
CLAIM_PRECISIONS = ("bf16", "fp16")
#: "high" learning rates: ten times the recipe's AdamW default (1e-3) and above
HIGH_LR_MIN = 0.01
#: "a large share": the largest channel takes at least this many times a uniform share (1/C) of sum x^2
LARGE_SHARE = 10.0
#: "exhausts the loss scaler": its scale fell below 1, so even the unscaled gradients overflow float16
SCALE_FLOOR = 1.0
#: "within a stated margin" (P5): MRSNorm's best bpb at most this many bits per byte above RMSNorm's
MARGIN_BPB = 0.03
_H = f"{HIGH_LR_MIN:g}"
TEXT: dict[str, tuple[str, str, str]] = {
    "P1": ("Numerical explosion as shipped: under fp16 autocast, RMSNorm runs blow up at high learning rates where "
           "MRSNorm runs do not",
           "Abstract: sum(x^2) lets a single large-magnitude channel dominate the denominator, which in mixed "
           "precision or under extreme optimisation leads to numerical explosion (NaN).",
           f"fp16 cells at the high learning rates (>= {_H}). A seed *fails* at an lr when its training loss turned "
           f"non-finite or its loss scaler was exhausted (scale below {SCALE_FLOOR:g}: even unscaled gradients "
           "overflow float16). Per seed: the share of the high lrs at which it failed, RMSNorm minus MRSNorm, Welch "
           "interval above 0; and the mean over the high lrs of the share of the planned steps reached before the "
           "first non-finite loss (1 when none), MRSNorm minus RMSNorm, Welch interval above 0. Per-lr divergence "
           "counts and first non-finite steps: the per-cell table. As shipped: every norm here computes in float32 "
           "inside, and under autocast its input is float32 too (P1h: the paper's setting)."),
    "P1h": ("Numerical explosion as the paper states it: in pure fp16, with the norms computed in float16, RMSNorm "
            "runs blow up at high learning rates where MRSNorm runs do not",
            "Abstract: sum(x^2) lets a single large-magnitude channel dominate the denominator, which in mixed "
            "precision or under extreme optimisation leads to numerical explosion (NaN).",
            f"P1's two comparisons on the `rms-half-fp16-true` and `mrs-half-fp16-true` cells: the model cast to "
            "float16 (`16-true`: the norms' inputs are float16, no loss scaler), the norms computed in float16 "
            "(`lightning_mrs/swap/half.py`: both form their squares in float16, which overflow from |x| = 256; "
            "runs made before the safe arms existed had MRSNorm's magnitudes by `hypot`, today's `mrs-half-safe`). "
            "A seed *fails* at an lr when its training loss turned non-finite. The as-shipped norms in the same "
            "precision (`rms-fp16-true`, `mrs-fp16-true`) are in the per-cell table."),
    "P1m": ("Numerical explosion with the norms computed in float16 inside real mixed precision: under 16-mixed "
            "(float32 master weights, float16 autocast, a loss scaler), RMSNorm runs blow up at high learning rates "
            "where MRSNorm runs do not, the two computed with the same arithmetic",
            "Abstract: sum(x^2) lets a single large-magnitude channel dominate the denominator, which in mixed "
            "precision or under extreme optimisation leads to numerical explosion (NaN).",
            "P1's two comparisons on the `16-mixed` cells of the half-precision norms, pair by pair: `rms-half-fp16` "
            "against `mrs-half-fp16` (both form their squares in float16: overflow from |x| = 256) and "
            "`rms-half-safe-fp16` against `mrs-half-safe-fp16` (both without intermediate overflow). Under autocast "
            "the residual stream is float32; each half norm's input is cast to float16 "
            "(`recipes/sweeps/cells/half_inputs.py`: every forward's dtype is recorded in the cell's record, "
            "`norm_input_dtypes`), its weight is float32 and cast to float16 inside. A seed fails as in P1 (non-"
            f"finite loss or its loss scaler's scale below {SCALE_FLOOR:g}). The shipped `rms-fp16`/`mrs-fp16` "
            "(float32 inside) are P1."),
    "P1t": ("Numerical explosion in pure float16 trained as mixed-precision optimizers do: with the norms computed "
            "in float16, RMSNorm runs blow up at high learning rates where MRSNorm runs do not",
            "Abstract: sum(x^2) lets a single large-magnitude channel dominate the denominator, which in mixed "
            "precision or under extreme optimisation leads to numerical explosion (NaN).",
            "P1's two comparisons, pair by pair as in P1m, on the `fp16-master` cells: the model cast to float16 "
            "(Lightning's `16-true`: every activation and the norms' inputs float16, no loss scaler) and AdamW on "
            "float32 master weights with float32 state, the float16 gradients clipped at norm 1 in float32 "
            "(`recipes/sweeps/cells/master_weights.py`; Micikevicius et al. 2018, apex's FP16_Optimizer), "
            "so AdamW's eps "
            "is not 0 as it is in P1h. A seed fails when its training loss turned non-finite."),
    "P2": ("Outlier dominance: the largest channel takes a large share of RMSNorm's denominator; MRSNorm's share of "
           "the same inputs is lower",
           "Abstract: in RMSNorm, sum(x^2) lets a single large-magnitude channel dominate the denominator; MRSNorm's "
           "mean of pair magnitudes takes it in linearly.",
           "In the RMSNorm cells of each claimed precision (bf16, fp16), on the OutlierMonitor's records of the "
           "inputs that entered the norms (worst layer, worst token, largest over the logged steps before any "
           "divergence). Per seed, averaged over the swept lrs at which it recorded (a run that diverged before its first "
           "logging step recorded nothing): the largest channel's share of sum x^2 (`rms_share`) "
           f"times C (C channels: 1 is a uniform share), t interval above {LARGE_SHARE:g}; and the largest phasor's "
           "share of MRSNorm's sum of pair magnitudes on the same inputs (`mrs_share`) minus `rms_share`, t interval "
           "below 0 (a uniform token has mrs_share 2/C, twice rms_share's 1/C: the raw shares are compared, as the "
           "claim states them)."),
    "P3": ("Gradient starvation: more starved channels and a wider per-phasor gradient spread under RMSNorm",
           "Abstract: ... gradient starvation of the low-magnitude channels (docs/method.md: under MRSNorm every "
           "phasor receives a scale-gradient of the same norm).",
           "In each cell (lr x claimed precision): the per-seed mean over the logged steps of `phasor/all/grad_cv` "
           "and of `phasor/all/starved_frac`, MRSNorm minus RMSNorm, Welch interval below 0, over the seeds that "
           f"did not diverge (a comparison where {MIN_SEEDS}+ seeds ran but fewer did not diverge is not "
           "measurable: listed, left out)."),
    "P4": ("Learning-rate robustness: MRSNorm is more robust to the learning rate than RMSNorm and LayerNorm",
           "Abstract and method: MRSNorm keeps a stable gradient flow where the baselines collapse under extreme "
           "optimisation.",
           "Per claimed precision, over every swept lr: the per-seed LR sensitivity (Wortsman et al. 2023: mean over "
           f"the lrs of the final bpb minus the seed's best, a diverged cell counted as {DIVERGED_BPB:g} bpb and "
           "every cell capped there), MRSNorm minus each baseline, Welch interval below 0; and the per-seed largest "
           f"lr whose bpb is within {100 * NEAR_FRACTION:.0f} % of that seed's best, log10 of it, MRSNorm minus each "
           "baseline, Welch interval above 0."),
    "P5": ("Half the affine parameters cost nothing: MRSNorm's best bpb is within a margin of RMSNorm's",
           "Abstract: MRSNorm needs one weight per phasor, half of RMSNorm's affine parameters, at no cost.",
           "Per claimed precision: the final bpb of MRSNorm minus RMSNorm, each at its own best swept lr (the "
           f"robustness table's), Welch interval below +{MARGIN_BPB:g} bpb. As for the image sweep, the halving cannot "
           "be isolated (no MRSNorm with C weights here): this compares the norms as a whole."),
}

RULE = (
    "Computed by `recipes/sweeps/claims/lm.py` from `results.csv` (claim M by "
    "`recipes/sweeps/claims/mechanism.py` from "
    "`mechanism.csv`); nothing in this section is written by hand.",
    "",
    *DECISION_RULE,
    f"**Bits per byte** (bpb) is the validation cross-entropy in bits per byte; a cell whose training loss turned "
    f"non-finite counts as {DIVERGED_BPB:g} bpb (a uniform guess over the 256 byte values, the loss at "
    f"initialisation) from that step on. **High learning rates** are the swept ones at or above {_H}. The "
    f"thresholds (`HIGH_LR_MIN`, `LARGE_SHARE` = {LARGE_SHARE:g}, `SCALE_FLOOR` = {SCALE_FLOOR:g}, `MARGIN_BPB` = "
    f"{MARGIN_BPB:g} bpb, about 1 % of the bpb these models reach) are constants of the code fixed before any "
    "sweep ran, not flags. The fp32 arms are a reference at the smallest and largest learning rates, and at "
    f"{MECHANISM_LR:g} the models of the mechanism stress; they enter no claim but M. The `fp16-true` arms (the model "
    "in float16) enter P1h only; the half-precision norms at `fp16` P1m only, the `fp16-master` arms P1t only.",
    "",
)


def split_arm(arm: str) -> tuple[str, str]:
    """``mrs-fp16`` -> ``("mrs", "fp16")``; ``rms-half-fp16-true`` -> ``("rms-half", "fp16-true")``."""
    for precision in sorted(PRECISIONS, key=len, reverse=True):
        if arm.endswith(f"-{precision}"):
            return arm[: -len(precision) - 1], precision
    norm, _, precision = arm.rpartition("-")
    return norm, precision


def arm_name(norm: str, precision: str) -> str:
    """``("mrs", "fp16")`` -> ``mrs-fp16``."""
    return f"{norm}-{precision}"


def _high(rows: list[Row]) -> list[float]:
    return [lr for lr in distinct_lrs(rows) if lr >= HIGH_LR_MIN * (1 - 1e-9)]


def per_seed(rows: list[Row], arm: str, lrs: list[float], bs: int, get: Callable[[Row], Optional[float]],
             every_lr: bool = True) -> Values:
    """Per seed, the mean of ``get`` over ``lrs``; why the values do not suffice.

    ``every_lr``: a seed needs a value at every lr; else the mean over the lrs where it has one (a run
    that diverged before its first logging step recorded nothing) and at least one.
    """
    if not any(r.arm == arm for r in rows):
        return [], f"{arm} was not in this sweep"
    if not lrs:
        return [], f"missing cells: no swept lr >= {_H}"
    missing = [lr for lr in lrs if not select(rows, lr=lr, batch_size=bs, arm=arm)]
    if missing:
        return [], f"missing cells: {arm} at lr {' '.join(f'{lr:g}' for lr in missing)}, batch {bs}"
    values = []
    for seed in sorted({r.seed for r in select(rows, batch_size=bs, arm=arm)}):
        got = [get(r) for lr in lrs for r in select(rows, lr=lr, batch_size=bs, arm=arm) if r.seed == seed]
        usable = [v for v in got if v is not None and math.isfinite(v)]
        if (len(usable) == len(lrs)) if every_lr else usable:
            values.append(statistics.fmean(usable))
    if len(values) < MIN_SEEDS:
        which = "with every lr" if every_lr else "with a record"
        return values, f"too few seeds: {arm} has {len(values)} {which} (needs {MIN_SEEDS})"
    return values, None


def failed(row: Row) -> float:
    """1 when the cell's loss turned non-finite or its loss scaler was exhausted, else 0."""
    scale = row.metrics.get("scaler_final_scale")
    return float(row.diverged or (scale is not None and scale < SCALE_FLOOR))


def _claim1(rows: list[Row], norms: tuple[str, str] = ("rms", "mrs"),
            precision: str = "fp16") -> list[tuple[str, list[Comparison]]]:
    high, out_rate, out_steps = _high(rows), [], []
    for bs in sorted({r.batch_size for r in rows}):
        rms, mrs = arm_name(norms[0], precision), arm_name(norms[1], precision)
        out_rate.append(welch_comparison(f"batch {bs}: {rms} - {mrs}", (rms, per_seed(rows, rms, high, bs, failed)),
                                         (mrs, per_seed(rows, mrs, high, bs, failed)), "above", 0.0, unit=""))
        out_steps.append(welch_comparison(f"batch {bs}: {mrs} - {rms}", (mrs, per_seed(rows, mrs, high, bs, survived)),
                                          (rms, per_seed(rows, rms, high, bs, survived)), "above", 0.0, unit=""))
    return [(f"share of the high lrs (>= {_H}) at which a seed failed: RMSNorm above MRSNorm", out_rate),
            ("share of the planned steps before the first non-finite loss, mean over the high lrs: MRSNorm above "
             "RMSNorm", out_steps)]


def _claim2(rows: list[Row]) -> list[tuple[str, list[Comparison]]]:
    def relative(r: Row) -> Optional[float]:
        share, c = r.metrics.get("max_rms_share"), r.metrics.get("channels")
        return None if share is None or not c else share * c

    def lower(r: Row) -> Optional[float]:
        a, b = r.metrics.get("max_mrs_share"), r.metrics.get("max_rms_share")
        return None if a is None or b is None else a - b

    lrs, large, lowers = distinct_lrs(rows), [], []
    for precision in CLAIM_PRECISIONS:
        arm = arm_name("rms", precision)
        for bs in sorted({r.batch_size for r in rows}):
            large.append(single(f"{arm}, batch {bs}: C x rms_share",
                                (arm, per_seed(rows, arm, lrs, bs, relative, every_lr=False)), "above", LARGE_SHARE, ""))
            lowers.append(single(f"{arm}, batch {bs}: mrs_share - rms_share",
                                 (arm, per_seed(rows, arm, lrs, bs, lower, every_lr=False)), "below", 0.0, ""))
    return [(f"the largest channel's share of sum x^2 in RMSNorm models, in uniform shares: above {LARGE_SHARE:g}",
             large), ("MRSNorm's share of the same inputs minus RMSNorm's: below 0", lowers)]


def _claim3(rows: list[Row]) -> list[tuple[str, list[Comparison]]]:
    groups = []
    for key, name in (("mean_grad_cv", "grad_cv"), ("mean_starved_frac", "starved_frac")):
        def get(r: Row, key: str = key) -> Optional[float]:
            return None if r.diverged else r.metrics.get(key)

        parts = []
        for precision in CLAIM_PRECISIONS:
            rms, mrs = arm_name("rms", precision), arm_name("mrs", precision)
            for lr in distinct_lrs(rows):
                for bs in sorted({r.batch_size for r in rows}):
                    a, b = (mrs, arm_values(rows, mrs, lr, bs, get)), (rms, arm_values(rows, rms, lr, bs, get))
                    parts.append(welch_comparison(f"{precision}, lr {lr:g}, batch {bs}: mrs - rms", a, b, "below", 0.0,
                                                  unit="", optional=unmeasurable(a, b)))
        groups.append((f"mean {name}: MRSNorm below RMSNorm (same cell, seeds that did not diverge)", parts))
    return groups


def _robust(rows: list[Row], arm: str, bs: int, what: str) -> Values:
    s = by_arm(robustness(rows, BPB)).get((arm, bs))
    if s is None:
        return [], f"missing cells: {arm} at batch {bs}" if any(r.arm == arm for r in rows) else \
            f"{arm} was not in this sweep"
    if not s.complete:
        return [], f"missing cells: {arm} at batch {bs} lacks some of the swept lrs"
    values = s.per_seed_sensitivity if what == "sensitivity" else [math.log10(v) for v in s.per_seed_max_lr]
    return values, None if len(values) >= MIN_SEEDS else f"too few seeds: {arm} has n={len(values)} (needs {MIN_SEEDS})"


def _claim4(rows: list[Row]) -> list[tuple[str, list[Comparison]]]:
    sens, reach = [], []
    for precision in CLAIM_PRECISIONS:
        mrs = arm_name("mrs", precision)
        for base in ("rms", "layer"):
            other = arm_name(base, precision)
            for bs in sorted({r.batch_size for r in rows}):
                sens.append(welch_comparison(f"batch {bs}: {mrs} - {other}", (mrs, _robust(rows, mrs, bs, "sensitivity")),
                                             (other, _robust(rows, other, bs, "sensitivity")), "below", 0.0, unit=""))
                reach.append(welch_comparison(f"batch {bs}: {mrs} - {other}", (mrs, _robust(rows, mrs, bs, "reach")),
                                              (other, _robust(rows, other, bs, "reach")), "above", 0.0, unit=""))
    return [("LR sensitivity (bpb): MRSNorm below the baseline", sens),
            (f"log10 of the largest lr within {100 * NEAR_FRACTION:.0f} % of the seed's best bpb: MRSNorm above the "
             "baseline", reach)]


def _claim5(rows: list[Row]) -> list[tuple[str, list[Comparison]]]:
    best = {(s.arm, s.batch_size): s.best_lr for s in robustness(rows, BPB)}
    parts = []
    for precision in CLAIM_PRECISIONS:
        for bs in sorted({r.batch_size for r in rows}):
            sides = []
            for norm in ("mrs", "rms"):
                arm = arm_name(norm, precision)
                lr = best.get((arm, bs))
                if lr is None:
                    swept = any(r.arm == arm for r in rows)
                    sides.append((arm, ([], f"missing cells: {arm} at batch {bs}" if swept else
                                        f"{arm} was not in this sweep")))
                else:
                    sides.append((f"{arm} @ lr {lr:g}", arm_values(rows, arm, lr, bs, BPB.counted)))
            parts.append(welch_comparison(f"{precision}, batch {bs}: mrs - rms, each at its best lr", *sides, "below",
                                          MARGIN_BPB, unit=""))
    return [(f"final bpb at each norm's best lr: MRSNorm at most {MARGIN_BPB:g} bpb above RMSNorm", parts)]


def claims(rows: list[Row]) -> list[Claim]:
    """P1, P1h, P1m, P1t, P2-P5 over typed ``results.csv`` rows, not yet evaluated."""
    builders = {"P1": _claim1, "P1h": lambda rows: _claim1(rows, NAIVE_HALF, "fp16-true"),
                "P1m": lambda rows: _claim1(rows, NAIVE_HALF, "fp16") + _claim1(rows, SAFE_HALF, "fp16"),
                "P1t": lambda rows: _claim1(rows, NAIVE_HALF, "fp16-master") + _claim1(rows, SAFE_HALF, "fp16-master"),
                "P2": _claim2,
                "P3": _claim3, "P4": _claim4, "P5": _claim5}
    return [Claim(key, *TEXT[key], groups=build(rows)) for key, build in builders.items()]
