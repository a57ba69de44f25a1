"""The paper's claims as computed comparisons over seeds, each with a verdict (``results.md``'s "Claims").

Each claim of ``shared/PAPER.md`` ("The paper's experiments") and the mechanism claim rests on
a list of *comparisons* (:class:`Comparison`), each an interval over seeds
(:mod:`recipes.stress_stats`) against a threshold with a claimed side. A comparison is
supported / contradicted / inconclusive (:func:`recipes.stress_stats.verdict`); a claim
combines its k comparisons so that a false verdict either way has at most a 5 % chance:

* supported: every comparison is supported at 95 % (an intersection-union test needs no
  correction);
* contradicted: at least one comparison is contradicted at the Bonferroni level 1 - 0.05/k;
* inconclusive: otherwise (also when a cell is missing or has fewer than two seeds).

The operational definitions (thresholds, the cells each claim rests on) are module constants,
fixed before any sweep ran, and written into the report with their reasons
(:mod:`recipes.stress_claims_text`). Needs no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from recipes.stress_rows import accuracy, select, survived
from recipes.stress_stats import (MIN_SEEDS, Interval, Side, Verdict, mean_interval, mean_sd,
                                  variance_ratio_interval, verdict, welch_interval)

__all__ = ["BASELINES", "COLLAPSE_FRACTION", "CONVERGE_FRACTION", "Claim", "Comparison", "IMMEDIATE_FRACTION",
           "LEVEL", "MARGIN", "Outcome", "PAPER_BATCH_SIZES", "PAPER_LRS", "arm_values", "claims", "evaluate",
           "unmeasurable", "welch_comparison"]

LEVEL = 0.95
PAPER_LRS = (0.1, 0.3, 0.4)
PAPER_BATCH_SIZES = (32, 64, 128)
BASELINES = ("layer", "rms")
#: "matches" / "costs no accuracy": MRSNorm at most this much top-1 (absolute) below
MARGIN = 0.01
#: "collapse": final top-1 below chance + this fraction of the way from chance to 100 %
COLLAPSE_FRACTION = 0.10
#: "immediate divergence": a non-finite loss within this fraction of the planned steps
IMMEDIATE_FRACTION = 0.10
#: "converges" at lr 0.4: at least this fraction of the same norm's top-1 at lr 0.1
CONVERGE_FRACTION = 0.90

Values = tuple[list[float], Optional[str]]  # per-seed values, or why there are none


@dataclass
class Comparison:
    """One interval against a threshold: what is compared, on which side the claim puts it."""

    label: str
    numbers: str
    side: Side
    threshold: float
    interval: Callable[[float], Optional[Interval]]  # level -> interval (None: not computable)
    reason: Optional[str] = None  # why not computable
    unit: str = "pt"  # display: "pt"/"%" (x100), "" (as is), "x" (a ratio)
    optional: bool = False  # not measurable (not missing): left out of the combination


@dataclass
class Outcome:
    """A comparison's interval and verdicts at 95 % and at the claim's Bonferroni level."""

    comparison: Comparison
    interval: Optional[Interval]
    verdict: Verdict
    strict_verdict: Verdict  # at the Bonferroni level
    excluded: bool = False


@dataclass
class Claim:
    """A claim: its wording, how it is tested, and its comparisons in named groups."""

    key: str
    title: str
    paper: str
    tested_as: str
    groups: list[tuple[str, list[Comparison]]]
    outcomes: list[tuple[str, list[Outcome]]] = field(default_factory=list)
    verdict: Verdict = "inconclusive"
    why: str = ""


# ----------------------------------------------------------------------------- values of one arm
def arm_values(rows: list[dict[str, Any]], norm: str, lr: float, bs: int, get: Callable[[dict], Optional[float]],
               by: str = "norm") -> Values:
    """The per-seed values ``get(row)`` of one arm (``by`` = ``norm``) at one lr and batch size, or why none."""
    cells = select(rows, lr=lr, batch_size=bs, **{by: norm})
    where = f"{norm} at lr {lr:g}, batch {bs}"
    if not cells:
        return [], f"missing cells: {where}"
    if len(cells) < MIN_SEEDS:
        return [], f"too few seeds: {where} has n={len(cells)} (needs {MIN_SEEDS})"
    values = [v for v in map(get, cells) if v is not None and math.isfinite(v)]
    if len(values) < MIN_SEEDS:
        return values, f"too few usable values: {where}, {len(values)} of {len(cells)} seeds"
    return values, None


def _describe(name: str, values: list[float], unit: str) -> str:
    mean, sd, n = mean_sd(values)
    if n == 0:
        return f"{name}: none"
    if unit in ("pt", "%"):  # accuracies
        spread = f" ± {100 * sd:.2f}" if n > 1 else ""
        return f"{name} {100 * mean:.2f}{spread} % (n={n})"
    spread = f" ± {sd:.2g}" if n > 1 else ""
    return f"{name} {mean:.3g}{spread} (n={n})"


def welch_comparison(label: str, a: tuple[str, Values], b: tuple[str, Values], side: Side, threshold: float,
                     scale: float = 1.0, unit: str = "pt", optional: bool = False) -> Comparison:
    """Welch's interval of ``mean(a) - scale * mean(b)`` against ``threshold`` (``a``, ``b``: name, values)."""
    (name_a, (va, why_a)), (name_b, (vb, why_b)) = a, b
    factor = f"{scale:g} x " if scale != 1 else ""
    numbers = f"{_describe(name_a, va, unit)}; {factor}{_describe(name_b, vb, unit)}"
    why = why_a or why_b
    return Comparison(label, numbers, side, threshold, lambda lv: None if why else welch_interval(va, vb, lv, scale),
                      why, unit, optional)


def unmeasurable(*arms: tuple[str, Values]) -> bool:
    """Enough seeds ran but too few gave a usable value (e.g. they diverged or collapsed): leave it out."""
    whys = [why or "" for _, (_, why) in arms]
    return any(w.startswith("too few usable") for w in whys) and not any(
        w.startswith(("missing", "too few seeds")) for w in whys)


def _single(label: str, a: tuple[str, Values], side: Side, threshold: float, unit: str) -> Comparison:
    name, (va, why) = a
    return Comparison(label, _describe(name, va, unit), side, threshold,
                      lambda lv: None if why else mean_interval(va, lv), why, unit)


def _ratio(label: str, a: tuple[str, Values], b: tuple[str, Values]) -> Comparison:
    (name_a, (va, why_a)), (name_b, (vb, why_b)) = a, b
    numbers = f"{_describe(name_a, va, 'pt')}; {_describe(name_b, vb, 'pt')}"
    why = why_a or why_b
    return Comparison(label, numbers, "above", 1.0, lambda lv: None if why else variance_ratio_interval(va, vb, lv),
                      why, "x")


# ----------------------------------------------------------------------------- the claims
def _chance(rows: list[dict[str, Any]]) -> float:
    ks = {r.get("num_classes") for r in rows if r.get("num_classes")}
    return 1.0 / ks.pop() if len(ks) == 1 else math.nan


def _claim1(rows: list[dict[str, Any]]) -> list[tuple[str, list[Comparison]]]:
    acc = lambda n, bs: (n, arm_values(rows, n, 0.1, bs, accuracy))  # noqa: E731
    matches = [welch_comparison(f"batch {bs}: mrs - {b}", acc("mrs", bs), acc(b, bs), "above", -MARGIN)
               for bs in PAPER_BATCH_SIZES for b in BASELINES]
    stable = [_ratio("batch 32: var(rms) / var(mrs)", acc("rms", 32), acc("mrs", 32))]
    return [("matches or beats (final top-1 at lr 0.1)", matches),
            ("steadier than RMSNorm at batch 32 (variance of final top-1 over seeds)", stable)]


def _claim2(rows: list[dict[str, Any]]) -> list[tuple[str, list[Comparison]]]:
    line = _collapse_line(rows)
    acc = lambda n, lr, bs: (n, arm_values(rows, n, lr, bs, accuracy))  # noqa: E731
    high = [(lr, bs) for lr in PAPER_LRS if lr >= 0.3 for bs in PAPER_BATCH_SIZES]
    collapse = [_single(f"lr {lr:g}, batch {bs}: {b}", acc(b, lr, bs), "below", line, "%")
                for lr, bs in high for b in BASELINES]
    trains = [_single(f"lr {lr:g}, batch {bs}: mrs", acc("mrs", lr, bs), "above", line, "%") for lr, bs in high]
    return [(f"LayerNorm and RMSNorm collapse (final top-1 below {100 * line:.1f} %)", collapse),
            (f"MRSNorm keeps training (final top-1 above {100 * line:.1f} %)", trains)]


def _claim3(rows: list[dict[str, Any]]) -> list[tuple[str, list[Comparison]]]:
    surv = lambda n, bs: (n, arm_values(rows, n, 0.4, bs, survived))  # noqa: E731
    acc = lambda n, lr, bs: (f"{n} @ lr {lr:g}", arm_values(rows, n, lr, bs, accuracy))  # noqa: E731
    avoids = [_single(f"batch {bs}: mrs", surv("mrs", bs), "above", IMMEDIATE_FRACTION, "")
              for bs in PAPER_BATCH_SIZES]
    others = [_single(f"batch {bs}: {b}", surv(b, bs), "below", IMMEDIATE_FRACTION, "")
              for bs in PAPER_BATCH_SIZES for b in BASELINES]
    f = CONVERGE_FRACTION
    converges = [welch_comparison("batch 128: mrs@0.4 - 0.9 x mrs@0.1", acc("mrs", 0.4, 128), acc("mrs", 0.1, 128),
                        "above", 0.0, scale=f)]
    struggles = [welch_comparison("batch 32: mrs@0.4 - 0.9 x mrs@0.1", acc("mrs", 0.4, 32), acc("mrs", 0.1, 32),
                        "below", 0.0, scale=f)]
    share = f"{100 * IMMEDIATE_FRACTION:.0f} %"
    return [(f"MRSNorm avoids immediate divergence (share of the planned steps before a non-finite loss > {share})",
             avoids),
            (f"LayerNorm and RMSNorm diverge immediately (that share < {share})", others),
            (f"MRSNorm converges at batch 128 (final top-1 >= {f:g} x its top-1 at lr 0.1)", converges),
            (f"MRSNorm struggles at batch 32 (final top-1 < {f:g} x its top-1 at lr 0.1)", struggles)]


def _best_lrs(rows: list[dict[str, Any]]) -> dict[tuple[str, int], Optional[float]]:
    """(norm, batch size) -> the learning rate of the robustness table's best seed-mean top-1
    (one definition for the report)."""
    from recipes.stress_summary import robustness

    return {(s["norm"], s["batch_size"]): s["best_lr"] for s in robustness(rows)}


def _claim4(rows: list[dict[str, Any]]) -> list[tuple[str, list[Comparison]]]:
    best_lrs = _best_lrs(rows)
    parts = []
    for bs in PAPER_BATCH_SIZES:
        arms = []
        for n in ("mrs", "rms"):
            lr = best_lrs.get((n, bs))
            arms.append((f"{n} @ lr {lr:g}", arm_values(rows, n, lr, bs, accuracy)) if lr is not None
                        else (n, ([], f"missing cells: {n} at batch {bs}")))
        parts.append(welch_comparison(f"batch {bs}: mrs - rms, each at its best lr", arms[0], arms[1], "above",
                                      -MARGIN))
    return [("no accuracy cost against RMSNorm (final top-1 at each norm's best swept lr)", parts)]


def _collapse_line(rows: list[dict[str, Any]]) -> float:
    c = _chance(rows)
    return c + COLLAPSE_FRACTION * (1 - c)


def _mechanism(rows: list[dict[str, Any]]) -> list[tuple[str, list[Comparison]]]:
    line = _collapse_line(rows)

    def grad_cv(r: dict[str, Any]) -> Optional[float]:
        # a diverged or collapsed run's gradients can vanish: its grad_cv (0 for all-zero
        # gradients, by the monitor's 0/0 convention) says nothing about a norm in training
        return r.get("mean_grad_cv") if accuracy(r) > line else None

    parts = []
    for lr in PAPER_LRS:
        for bs in PAPER_BATCH_SIZES:
            for b in BASELINES:
                a, base = ("mrs", arm_values(rows, "mrs", lr, bs, grad_cv)), (b, arm_values(rows, b, lr, bs, grad_cv))
                parts.append(welch_comparison(f"lr {lr:g}, batch {bs}: mrs - {b}", a, base, "below", 0.0, unit="",
                                              optional=unmeasurable(a, base)))
    return [("mean grad_cv lower under MRSNorm (same lr and batch size, seeds that trained)", parts)]


def claims(rows: list[dict[str, Any]]) -> list[Claim]:
    """The five claims over ``rows`` (typed ``results.csv`` rows), not yet evaluated."""
    from recipes.stress_claims_text import TEXT  # wording lives apart from the logic

    builders = {"1": _claim1, "2": _claim2, "3": _claim3, "4": _claim4, "M": _mechanism}
    return [Claim(key, *TEXT[key], groups=build(rows)) for key, build in builders.items()]


# ----------------------------------------------------------------------------- verdicts
def _outcome(comp: Comparison, strict_level: float) -> Outcome:
    if comp.reason is not None:
        return Outcome(comp, None, "inconclusive", "inconclusive", excluded=comp.optional)
    iv = comp.interval(LEVEL)
    strict = comp.interval(strict_level)
    return Outcome(comp, iv, verdict(iv, comp.threshold, comp.side), verdict(strict, comp.threshold, comp.side))


def evaluate(claim: Claim) -> Claim:
    """Fill ``claim.outcomes``, ``claim.verdict`` and ``claim.why`` (the rule: module docstring)."""
    comps = [c for _, group in claim.groups for c in group]
    measurable = [c for c in comps if not (c.optional and c.reason is not None)]
    k = max(1, len(measurable))
    strict = 1 - (1 - LEVEL) / k
    claim.outcomes = [(name, [_outcome(c, strict) for c in group]) for name, group in claim.groups]
    counted = [o for _, group in claim.outcomes for o in group if not o.excluded]
    left_out = len(comps) - len(counted)
    note = f"; {left_out} not measurable, left out" if left_out else ""
    if not counted:
        claim.verdict, claim.why = "inconclusive", f"no measurable comparison ({left_out} left out)"
        return claim
    against = [o for o in counted if o.strict_verdict == "contradicted"]
    if against:
        claim.verdict = "contradicted"
        names = ", ".join(o.comparison.label for o in against)
        claim.why = f"contradicted at the Bonferroni level {100 * strict:.4g} % by: {names}{note}"
        return claim
    ok = sum(o.verdict == "supported" for o in counted)
    if ok == len(counted):
        claim.verdict, claim.why = "supported", f"all {len(counted)} comparisons supported{note}"
        return claim
    open_ = [o for o in counted if o.verdict != "supported"]
    reasons: dict[str, int] = {}
    for o in open_:
        if o.comparison.reason is not None:
            r = o.comparison.reason.split(":")[0]
        elif o.verdict == "contradicted":
            r = f"contradicted at 95 % but not at the Bonferroni level {100 * strict:.4g} %"
        else:
            r = "interval on both sides of the threshold"
        reasons[r] = reasons.get(r, 0) + 1
    detail = "; ".join(f"{n} x {r}" for r, n in reasons.items())
    claim.verdict = "inconclusive"
    claim.why = f"{ok} of {len(counted)} comparisons supported, {len(open_)} not ({detail}){note}"
    return claim
