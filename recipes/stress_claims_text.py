"""Wording of the claims and the "Claims" section of ``results.md`` (the logic: :mod:`recipes.stress_claims`).

Every number in the section is computed; this module only phrases the definitions (from the
constants of :mod:`recipes.stress_claims`) and lays the computed outcomes out as markdown.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from recipes import stress_claims as sc
from recipes.stress_stats import MIN_SEEDS

__all__ = ["DECISION_RULE", "TEXT", "claims_section", "markdown"]

_D = f"{100 * sc.MARGIN:g} point"
_F = f"{sc.CONVERGE_FRACTION:g}"
_I = f"{100 * sc.IMMEDIATE_FRACTION:g} %"

#: key -> (title, the paper's wording, how it is tested)
TEXT: dict[str, tuple[str, str, str]] = {
    "1": ("lr 0.1: MRSNorm matches or beats LayerNorm and RMSNorm, and is steadier than RMSNorm at batch 32",
          "lr = 0.1: MRSNorm matches or beats LayerNorm and RMSNorm; at batch 32 it stays stable where RMSNorm "
          "shows high variance.",
          f"At lr 0.1 and each batch size 32, 64, 128: mean final top-1 of MRSNorm minus each baseline, Welch "
          f"interval above -{_D} ('matches' is a non-inferiority statement and needs a margin, see below). At "
          "batch 32: variance over seeds of the final top-1, RMSNorm over MRSNorm, F interval above 1 ('high "
          "variance' read as higher than MRSNorm's). With 3 seeds the F interval is wide (its 95 % bounds are the "
          "ratio divided by 39 and by 1/39), so this part only resolves a large difference."),
    "2": ("lr >= 0.3: LayerNorm and RMSNorm collapse, MRSNorm keeps training",
          "lr >= 0.3: LayerNorm and RMSNorm suffer catastrophic collapse (accuracy near zero, NaN). MRSNorm keeps "
          "a stable gradient flow.",
          "At the paper's high learning rates 0.3 and 0.4 (the wider axis of the sweep is not part of the claim) "
          "and each batch size: mean final top-1 (a diverged seed counts as chance), t interval below the "
          f"collapse line for LayerNorm and RMSNorm, above it for MRSNorm. Collapse line: chance + "
          f"{100 * sc.COLLAPSE_FRACTION:g} % of (100 % - chance), i.e. 'near zero' measured from what guessing "
          "gives, on any number of classes. 'Stable gradient flow' is read as 'keeps training' here; the "
          "gradient statistics themselves are the mechanism claim."),
    "3": ("lr 0.4: only MRSNorm avoids immediate divergence; it converges at batch 128 and struggles at batch 32",
          "lr = 0.4: MRSNorm is the only method that avoids immediate divergence, and converges at batch 128 "
          "(it struggles at batch 32).",
          f"At lr 0.4. Immediate divergence: a non-finite training loss within the first {_I} of the planned "
          "optimizer steps (a run whose loss stays finite while its accuracy falls to chance has not diverged "
          "in this sense; claim 2 covers such collapse). Per seed the share of the planned steps reached before the first non-finite loss "
          f"(1 when none), t interval above {sc.IMMEDIATE_FRACTION:g} for MRSNorm and below it for LayerNorm and "
          "RMSNorm, at each batch size ('the only method' among the paper's three; the BatchNorm reference row "
          f"is not compared). Converges at batch 128: mean final top-1 at lr 0.4 above {_F} x its mean at lr 0.1 "
          f"(Welch interval of the difference with that factor); struggles at batch 32: below {_F} x."),
    "4": ("Half the affine parameters cost no accuracy",
          "Half the affine parameters cost no accuracy.",
          "MRSNorm has one weight per phasor (C/2), RMSNorm one per channel (C), LayerNorm C weights and C biases. "
          "The sweep has no MRSNorm with C weights, so the halving cannot be isolated; the comparison it allows "
          "is MRSNorm against RMSNorm (same kind of norm, twice the weights), each at its own best swept learning "
          "rate (the robustness table's best lr), per batch size: mean final top-1 of MRSNorm minus RMSNorm, Welch "
          f"interval above -{_D}. Supported means MRSNorm as a whole loses less than {_D} against RMSNorm, not "
          "that halving the weights alone is free. Picking the best lr from the same seeds flatters both norms "
          "alike."),
    "M": ("Mechanism: gradient homogeneity (grad_cv lower under MRSNorm)",
          "Under MRSNorm every phasor receives a gradient of comparable size, so the spread of per-phasor gradient "
          "norms (grad_cv) should be lower than under RMSNorm and LayerNorm in the same training run.",
          "In each cell of the paper's grid (lr 0.1, 0.3, 0.4 x batch 32, 64, 128): the per-seed mean of "
          "`phasor/all/grad_cv` over the run's logged steps, MRSNorm minus each baseline, Welch interval below 0, "
          "over the seeds that trained: a seed that diverged or collapsed (final top-1 under claim 2's collapse "
          "line) is left out, for every norm alike, because a dead network's gradients can vanish, and its "
          "grad_cv then reads 0 ('perfectly even') by the monitor's 0/0 convention. A "
          f"comparison where a norm ran at least {MIN_SEEDS} seeds but fewer than {MIN_SEEDS} trained cannot be "
          "measured: it is listed and left out of the "
          "combination. A missing cell counts as inconclusive."),
}

#: the decision rule, shared by every sweep's claims
DECISION_RULE = [
    "**Decision rule.** Every comparison is a 95 % confidence interval over seeds: Welch's t interval for a "
    "difference of means (unequal variances), Student's t interval for one mean, the F interval for a ratio of "
    "variances. A comparison is **supported** when its interval lies entirely on the claimed side of its "
    "threshold, **contradicted** when it lies entirely on the other side, **inconclusive** otherwise, and also "
    f"when a cell is missing or an arm has fewer than {MIN_SEEDS} seeds (no spread, no interval). Seeds that "
    "agree exactly (e.g. all diverged, counted as chance) give a zero-width interval: the verdict then rests on "
    "those seeds alone.",
    "",
    "**Combining the k comparisons of a claim** (every claim is a conjunction of its parts): supported when all "
    "k are supported (an intersection-union test keeps the 5 % level without correction); contradicted when at "
    "least one is contradicted at the Bonferroni level 1 - 0.05/k (a false contradiction stays under 5 % over "
    "the k chances); inconclusive otherwise.",
    "",
]
_RULE = [
    "Computed by `recipes/stress_claims.py` from `results.csv`; nothing in this section is written by hand.",
    "",
    *DECISION_RULE,
    "**Accuracy** is the final validation top-1; a cell whose training loss turned non-finite counts as chance "
    "from that step on.",
    "",
    f"**The margin δ = {_D} of top-1** for 'matches' (claim 1) and 'costs no accuracy' (claim 4): a "
    "non-inferiority claim needs a size below which a loss is no loss. One point is a cost a user of the "
    "method would notice and care about; a margin of several points would call real costs 'no cost', and a "
    "much smaller one is below the seed-to-seed spread of a small network and could not be resolved with a "
    "few seeds (every number below shows that spread, so the margin can be checked against it). It is a "
    "constant of the code (`MARGIN`), fixed before any sweep ran and not a flag, so it cannot be tuned to a "
    "result.",
    "",
]

_MARK = {"supported": "**supported**", "contradicted": "**contradicted**", "inconclusive": "inconclusive"}


def _num(value: float, unit: str) -> str:
    if math.isinf(value):
        return "inf"
    if unit in ("pt", "%"):
        return f"{100 * value:.2f}"
    return f"{value:.3g}"


def _interval(o: "sc.Outcome") -> str:
    if o.interval is None:
        return "-"
    unit, iv = o.comparison.unit, o.interval
    suffix = {"pt": " pt", "%": " %"}.get(unit, "")
    return f"{_num(iv.estimate, unit)} [{_num(iv.low, unit)}, {_num(iv.high, unit)}]{suffix}"


def _claimed(c: "sc.Comparison") -> str:
    sign = ">" if c.side == "above" else "<"
    suffix = {"pt": " pt", "%": " %"}.get(c.unit, "")
    return f"{sign} {_num(c.threshold, c.unit)}{suffix}"


def _verdict(o: "sc.Outcome") -> str:
    if o.excluded:
        return f"not measurable, left out ({o.comparison.reason})"
    if o.comparison.reason is not None:
        return f"inconclusive ({o.comparison.reason})"
    if o.verdict == "contradicted" and o.strict_verdict != "contradicted":
        return "contradicted at 95 % (not at the Bonferroni level)"
    return _MARK[o.verdict]


def markdown(claims: list["sc.Claim"], rule: Optional[list[str]] = None) -> list[str]:
    """The "Claims" section: the rule (``None``: the norm sweep's), a summary table, then each claim's comparisons."""
    lines = ["## Claims", "", *(_RULE if rule is None else rule), "| claim | verdict | why |", "|:---|:---|:---|"]
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


def claims_section(rows: list[dict[str, Any]]) -> list[str]:
    """Evaluate every claim over typed ``results.csv`` rows and lay the section out."""
    return markdown([sc.evaluate(c) for c in sc.claims(rows)])
