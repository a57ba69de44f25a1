"""The "Claims" section of ``results.md``: the shared decision rule and the layout of evaluated claims.

Every number in the section is computed; a sweep kind supplies its claims' wording and the lines that
define its terms (``rule``), this module lays the computed outcomes out. Nothing here is specific to a kind.
"""

from __future__ import annotations

import math
from typing import Sequence

from recipes.sweeps.claims.engine import Claim, Comparison, Outcome
from recipes.sweeps.claims.stats import MIN_SEEDS

__all__ = ["DECISION_RULE", "markdown"]

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


def _verdict(o: Outcome) -> str:
    if o.excluded:
        return f"not measurable, left out ({o.comparison.reason})"
    if o.comparison.reason is not None:
        return f"inconclusive ({o.comparison.reason})"
    if o.verdict == "contradicted" and o.strict_verdict != "contradicted":
        return "contradicted at 95 % (not at the Bonferroni level)"
    return _MARK[o.verdict]


def markdown(claims: Sequence[Claim], rule: Sequence[str]) -> list[str]:
    """The "Claims" section of evaluated ``claims``: ``rule`` (the kind's definitions), a summary, each claim."""
    lines = ["## Claims", "", *rule, "| claim | verdict | why |", "|:---|:---|:---|"]
    lines += [f"| {c.key}: {c.title} | {_MARK[c.verdict]} | {c.why} |" for c in claims]
    for c in claims:
        lines += ["", f"### Claim {c.key}: {c.title}", "", f"Paper: \"{c.paper}\"", "", f"Tested as: {c.tested_as}",
                  "", f"Verdict: {_MARK[c.verdict]} ({c.why}).", ""]
        for name, outcomes in c.outcomes:
            lines += [f"*{name}*", "", "| comparison | per-seed values: mean ± sd (n) | estimate [95 % interval] | "
                      "claimed | verdict |", "|:---|:---|:---|:---|:---|"]
            lines += [f"| {o.comparison.label} | {o.comparison.numbers} | {_interval(o)} | {_claimed(o.comparison)} | "
                      f"{_verdict(o)} |" for o in outcomes]
            lines.append("")
    return lines
