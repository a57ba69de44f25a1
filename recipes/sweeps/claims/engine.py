"""Claims as lists of computed comparisons over seeds, each with a verdict, and their combination.

A claim rests on *comparisons* (:class:`Comparison`): an interval over seeds
(:mod:`recipes.sweeps.claims.stats`) against a threshold with a claimed side. A comparison is
supported / contradicted / inconclusive (:func:`~recipes.sweeps.claims.stats.verdict`); a claim
combines its k comparisons so that a false verdict either way has at most a 5 % chance:

* supported: every comparison is supported at 95 % (an intersection-union test needs no
  correction);
* contradicted: at least one comparison is contradicted at the Bonferroni level 1 - 0.05/k;
* inconclusive: otherwise (also when a cell is missing, an arm was not swept, or has fewer
  than two seeds).

An inconclusive comparison with an interval also says how many seeds per arm would resolve it
(:attr:`Outcome.seeds`): the difference and spreads it observed taken as true, the seeds at which
its own test (the same interval, 95 %) excludes the threshold with 80 % probability
(:func:`~recipes.sweeps.claims.stats.welch_seeds` and its siblings).

The sweep kinds (:mod:`recipes.sweeps.kinds.norm`, :mod:`recipes.sweeps.kinds.qk`) build their claims from
:func:`arm_values`, :func:`welch_comparison`, :func:`single` and :func:`ratio`. Needs no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

from recipes.sweeps.claims.stats import (MIN_SEEDS, Interval, Side, Verdict, mean_interval, mean_sd, mean_seeds,
                                         ratio_seeds, variance_ratio_interval, verdict, welch_interval, welch_seeds)
from recipes.sweeps.records import Row, select

__all__ = ["LEVEL", "Claim", "Comparison", "Outcome", "Values", "arm_values", "describe", "evaluate", "missing",
           "ratio", "single", "unmeasurable", "welch_comparison"]

LEVEL = 0.95

Values = tuple[list[float], Optional[str]]  # the per-seed values that exist, and why they do not suffice


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
    seeds_needed: Callable[[float], Optional[float]] = lambda level: None  # level -> seeds per arm to resolve it
    sds: tuple[float, ...] = ()  # the per-seed spreads of its arms (sd), for the seeds-needed line
    ran: int = 0  # the fewest seeds of its arms
    value_unit: Optional[str] = None  # the per-seed values' display unit when not ``unit`` (a ratio of variances)


@dataclass
class Outcome:
    """A comparison's interval and verdicts at 95 % and at the claim's Bonferroni level."""

    comparison: Comparison
    interval: Optional[Interval]
    verdict: Verdict
    strict_verdict: Verdict  # at the Bonferroni level
    excluded: bool = False
    #: inconclusive with an interval: the seeds per arm that would resolve it at 80 % power (``inf``: more
    #: than :data:`~recipes.sweeps.claims.stats.MAX_SEEDS`), ``None`` when no number would (module docstring)
    seeds: Optional[float] = None


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
def arm_values(rows: list[Row], arm: str, lr: float, bs: int, get: Callable[[Row], Optional[float]]) -> Values:
    """The per-seed values ``get(row)`` of one arm at one lr and batch size that exist, and why they do not suffice.

    Example:
        >>> rows = [Row("mrs", 0.1, 32, 0, final_top1=0.5)]
        >>> arm_values(rows, "mrs", 0.1, 32, lambda r: r.final_top1)
        ([0.5], 'too few seeds: mrs at lr 0.1, batch 32 has n=1 (needs 2)')
        >>> arm_values(rows, "layer", 0.1, 32, lambda r: r.final_top1)
        ([], 'layer was not in this sweep')
    """
    if not any(r.arm == arm for r in rows):
        return [], f"{arm} was not in this sweep"
    cells = select(rows, lr=lr, batch_size=bs, arm=arm)
    where = f"{arm} at lr {lr:g}, batch {bs}"
    if not cells:
        return [], f"missing cells: {where}"
    values = [v for v in map(get, cells) if v is not None and math.isfinite(v)]
    if len(cells) < MIN_SEEDS:
        return values, f"too few seeds: {where} has n={len(cells)} (needs {MIN_SEEDS})"
    if len(values) < MIN_SEEDS:
        return values, f"too few usable values: {where}, {len(values)} of {len(cells)} seeds"
    return values, None


def missing(label: str, why: str) -> Comparison:
    """A comparison that cannot be made at all (e.g. no swept lr qualifies)."""
    return Comparison(label, "none", "below", 0.0, lambda level: None, why, "")


def describe(name: str, values: list[float], unit: str) -> str:
    """``name mean ± sd (n=k)`` of the values that exist (accuracies in %), ``name: none`` without any."""
    mean, sd, n = mean_sd(values)
    if n == 0:
        return f"{name}: none"
    if unit in ("pt", "%"):  # accuracies
        spread = f" ± {100 * sd:.2f}" if n > 1 else ""
        return f"{name} {100 * mean:.2f}{spread} % (n={n})"
    spread = f" ± {sd:.2g}" if n > 1 else ""
    return f"{name} {mean:.3g}{spread} (n={n})"


def _reason(*whys: Optional[str]) -> Optional[str]:
    """The reason to show of several: an arm not in the sweep, then missing cells, then too few seeds or values."""
    found = [w for w in whys if w]
    order = (lambda w: w.endswith("was not in this sweep"), lambda w: w.startswith("missing"),
             lambda w: w.startswith("too few seeds"), lambda w: True)
    return next((w for test in order for w in found if test(w)), None)


def welch_comparison(label: str, a: tuple[str, Values], b: tuple[str, Values], side: Side, threshold: float,
                     scale: float = 1.0, unit: str = "pt", optional: bool = False) -> Comparison:
    """Welch's interval of ``mean(a) - scale * mean(b)`` against ``threshold`` (``a``, ``b``: name, values)."""
    (name_a, (va, why_a)), (name_b, (vb, why_b)) = a, b
    factor = f"{scale:g} x " if scale != 1 else ""
    numbers = f"{describe(name_a, va, unit)}; {factor}{describe(name_b, vb, unit)}"
    why = _reason(why_a, why_b)
    return Comparison(label, numbers, side, threshold, lambda lv: None if why else welch_interval(va, vb, lv, scale),
                      why, unit, optional, lambda lv: welch_seeds(va, vb, threshold, lv, scale), _sds(va, vb),
                      min(len(va), len(vb)))


def _sds(*values: list[float]) -> tuple[float, ...]:
    return tuple(mean_sd(v)[1] for v in values)


def single(label: str, a: tuple[str, Values], side: Side, threshold: float, unit: str) -> Comparison:
    """Student's t interval of ``mean(a)`` against ``threshold``."""
    name, (va, why) = a
    return Comparison(label, describe(name, va, unit), side, threshold,
                      lambda lv: None if why else mean_interval(va, lv), why, unit,
                      seeds_needed=lambda lv: mean_seeds(va, threshold, lv), sds=_sds(va), ran=len(va))


def ratio(label: str, a: tuple[str, Values], b: tuple[str, Values]) -> Comparison:
    """The F interval of ``var(a) / var(b)`` above 1."""
    (name_a, (va, why_a)), (name_b, (vb, why_b)) = a, b
    numbers = f"{describe(name_a, va, 'pt')}; {describe(name_b, vb, 'pt')}"
    why = _reason(why_a, why_b)
    return Comparison(label, numbers, "above", 1.0, lambda lv: None if why else variance_ratio_interval(va, vb, lv),
                      why, "x", seeds_needed=lambda lv: ratio_seeds(va, vb, lv), sds=_sds(va, vb),
                      ran=min(len(va), len(vb)), value_unit="pt")


def _absent(why: str) -> bool:
    return why.startswith(("missing", "too few seeds")) or why.endswith("was not in this sweep")


def unmeasurable(*arms: tuple[str, Values]) -> bool:
    """Enough seeds ran but too few gave a usable value (e.g. they diverged or collapsed): leave it out."""
    whys = [why or "" for _, (_, why) in arms]
    return any(w.startswith("too few usable") for w in whys) and not any(_absent(w) for w in whys)


# ----------------------------------------------------------------------------- verdicts
def _outcome(comp: Comparison, strict_level: float) -> Outcome:
    if comp.reason is not None:
        return Outcome(comp, None, "inconclusive", "inconclusive", excluded=comp.optional)
    iv = comp.interval(LEVEL)
    strict = comp.interval(strict_level)
    assert iv is not None and strict is not None  # a comparison without a reason has an interval
    decided = verdict(iv, comp.threshold, comp.side)
    seeds = comp.seeds_needed(LEVEL) if decided == "inconclusive" else None
    return Outcome(comp, iv, decided, verdict(strict, comp.threshold, comp.side), seeds=seeds)


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
