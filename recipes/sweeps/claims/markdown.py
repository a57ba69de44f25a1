"""The "Claims" section of ``results.md``: the shared decision rule and the layout of evaluated claims.

Every number in the section is computed; a sweep kind supplies its claims' wording and the lines that
define its terms (``rule``), this module lays the computed outcomes out. Nothing here is specific to a kind.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Sequence

from recipes.sweeps.claims.engine import Claim, Comparison, Outcome
from recipes.sweeps.claims.stats import MAX_SEEDS, MIN_SEEDS, POWER

__all__ = ["BUDGET_FACTOR", "DECISION_RULE", "SEEDS_RULE", "markdown", "seeds_line", "show_seeds", "summary"]

#: "not resolvable on this budget": more than this many times the seeds the sweep ran
BUDGET_FACTOR = 10
SEEDS_RULE = (
    f"**Seeds needed.** For every inconclusive comparison: how many seeds per arm would resolve the difference it "
    f"observed, at the spread it observed, with {100 * POWER:.0f} % power under its own test (the same 95 % "
    "interval: the chance that it then lies entirely on one side of the threshold; noncentral t for the t "
    "intervals, the F distribution for a ratio of variances). It plans a rerun; it is not a verdict (the observed "
    f"difference is taken as the true one). \"Not resolvable on this budget\": more than {BUDGET_FACTOR} times the "
    "seeds this sweep ran."
)

#: the decision rule, shared by every sweep's claims
DECISION_RULE = (
    "**Decision rule.** Every comparison is a 95 % confidence interval over seeds: Welch's t interval for a "
    "difference of means (unequal variances), Student's t interval for one mean, the F interval for a ratio of "
    "variances. A comparison is **supported** when its interval lies entirely on the claimed side of its "
    "threshold, **contradicted** when it lies entirely on the other side, **inconclusive** otherwise, and also "
    f"when a cell is missing, an arm was not in the sweep, or an arm has fewer than {MIN_SEEDS} seeds (no spread, "
    "no interval). Seeds that agree exactly (e.g. all diverged, counted as chance) give a zero-width interval: "
    "the verdict then rests on those seeds alone.",
    "",
    "**Combining the k comparisons of a claim** (every claim is a conjunction of its parts): supported when all "
    "k are supported (an intersection-union test keeps the 5 % level without correction); contradicted when at "
    "least one is contradicted at the Bonferroni level 1 - 0.05/k (a false contradiction stays under 5 % over "
    "the k chances); inconclusive otherwise.",
    "",
)

_MARK = {"supported": "**supported**", "contradicted": "**contradicted**", "inconclusive": "inconclusive"}


def _num(value: float, unit: str) -> str:
    if math.isinf(value):
        return "inf"
    if unit in ("pt", "%"):
        return f"{100 * value:.2f}"
    return f"{value:.3g}"


def _suffix(unit: str) -> str:
    return {"pt": " pt", "%": " %"}.get(unit, "")


def _interval(o: Outcome) -> str:
    if o.interval is None:
        return "-"
    unit, iv = o.comparison.unit, o.interval
    return f"{_num(iv.estimate, unit)} [{_num(iv.low, unit)}, {_num(iv.high, unit)}]{_suffix(unit)}"


def _claimed(c: Comparison) -> str:
    sign = ">" if c.side == "above" else "<"
    return f"{sign} {_num(c.threshold, c.unit)}{_suffix(c.unit)}"


def show_seeds(n: float) -> str:
    """A seeds-needed number as the report writes it: exact up to 20, else to 2 significant digits."""
    if math.isinf(n):
        return f"more than {MAX_SEEDS:,}"
    if n <= 20:
        return f"{n:.0f}"
    digits = len(str(int(n))) - 2
    return f"{round(n, -digits):,.0f}"


def _needed(o: Outcome) -> str:
    """The per-comparison table's seeds cell."""
    if o.verdict != "inconclusive" or o.excluded:
        return "-"
    if o.interval is None:
        return "no spread to plan from"
    if o.seeds is None:
        return "none would"
    return show_seeds(o.seeds)


def seeds_line(key: str, o: Outcome) -> str:
    """One inconclusive comparison's seeds-needed line (see :data:`SEEDS_RULE`)."""
    c, iv = o.comparison, o.interval
    head = f"{key} {c.label}"
    if iv is None:
        return f"{head}: no interval ({c.reason}), so no spread to plan from."
    off = iv.estimate - c.threshold
    where = f"{_num(abs(off), c.unit)}{_suffix(c.unit)} {'above' if off > 0 else 'below'} the threshold" if off else \
        "on the threshold"
    unit = c.value_unit or c.unit
    sds = " and ".join("?" if math.isnan(s) else _num(s, unit) for s in c.sds) + _suffix(unit)
    seen = f"{_num(iv.estimate, c.unit)}{_suffix(c.unit)} ({where}), sd {sds}"
    if o.seeds is None:
        why = "the estimate sits on the threshold" if not off else "no spread to scale (the seeds agree exactly)" \
            if all(s == 0 for s in c.sds) else "the two spreads are equal or one is zero"
        return f"{head}: {seen}: no number of seeds resolves it ({why})."
    side = "supported" if (off > 0) == (c.side == "above") else "contradicted"
    budget = "; not resolvable on this budget" if o.seeds > BUDGET_FACTOR * max(1, c.ran) else ""
    return (f"{head}: {seen}: about {show_seeds(o.seeds)} seeds per arm (this sweep: {c.ran}); it would resolve as "
            f"{side}{budget}.")


def _seeds_section(claims: Sequence[Claim]) -> list[str]:
    lines = []
    for c in claims:
        open_ = [o for _, group in c.outcomes for o in group if o.verdict == "inconclusive" and not o.excluded]
        lines += [f"- {seeds_line(c.key, o)}" for o in open_ if o.interval is not None]
        reasons = Counter(o.comparison.reason for o in open_ if o.interval is None)
        if reasons:  # no interval (a missing arm or cell, one seed): one line per claim, not per comparison
            n = sum(reasons.values())
            why = "; ".join(f"{r}: {k}" if k > 1 else str(r) for r, k in reasons.items())
            lines.append(f"- {c.key}: {n} comparison{'s' if n > 1 else ''} without an interval, so no spread to plan "
                         f"from ({why}).")
    if not lines:
        return []
    return ["", SEEDS_RULE, "", *lines]


def _verdict(o: Outcome) -> str:
    if o.excluded:
        return f"not measurable, left out ({o.comparison.reason})"
    if o.comparison.reason is not None:
        return f"inconclusive ({o.comparison.reason})"
    if o.verdict == "contradicted" and o.strict_verdict != "contradicted":
        return "contradicted at 95 % (not at the Bonferroni level)"
    return _MARK[o.verdict]


def summary(claims: Sequence[Claim]) -> list[str]:
    """The verdict table of evaluated ``claims`` and, under it, the seeds-needed lines."""
    lines = ["| claim | verdict | why |", "|:---|:---|:---|"]
    lines += [f"| {c.key}: {c.title} | {_MARK[c.verdict]} | {c.why} |" for c in claims]
    return lines + _seeds_section(claims)


def markdown(claims: Sequence[Claim], rule: Sequence[str]) -> list[str]:
    """The "Claims" section of evaluated ``claims``: ``rule`` (the kind's definitions), a summary, each claim."""
    lines = ["## Claims", "", *rule, *summary(claims)]
    for c in claims:
        lines += ["", f"### Claim {c.key}: {c.title}", "", f"Paper: \"{c.paper}\"", "", f"Tested as: {c.tested_as}",
                  "", f"Verdict: {_MARK[c.verdict]} ({c.why}).", ""]
        for name, outcomes in c.outcomes:
            lines += [f"*{name}*", "", "| comparison | per-seed values: mean ± sd (n) | estimate [95 % interval] | "
                      "claimed | verdict | seeds per arm to resolve |", "|:---|:---|:---|:---|:---|---:|"]
            lines += [f"| {o.comparison.label} | {o.comparison.numbers} | {_interval(o)} | {_claimed(o.comparison)} | "
                      f"{_verdict(o)} | {_needed(o)} |" for o in outcomes]
            lines.append("")
    return lines
