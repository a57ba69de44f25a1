"""The ``qk`` sweep's claims: attention-logit growth, softmax collapse and LR sensitivity, with verdicts.

The statements tested (each a list of comparisons over seeds, decided and combined by the same
code as the norm sweep's claims: :func:`recipes.stress_claims.evaluate`, intervals from
:mod:`recipes.stress_stats`):

* **0** (the premise, Wortsman et al. 2023): without a QK-norm the attention logits grow with
  the learning rate;
* **W1** (Wortsman et al. 2023, arXiv 2309.14322): QK-layernorm removes the attention-logit
  growth; **W2**: it lowers the LR sensitivity;
* **P1** (PAPER.md, "Phasor attention"): the MRS QK-norm prevents the logit growth; **P2**: and
  softmax collapse;
* **P3** (asked of MRS by extension, not stated by the paper): the MRS QK-norm lowers the LR
  sensitivity.

"High learning rates" are the swept ones at or above :data:`HIGH_LR_MIN`. Needs no torch.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from recipes.stress_claims import Claim, Comparison, Values, arm_values, evaluate, unmeasurable, welch_comparison
from recipes.stress_claims_text import DECISION_RULE, markdown
from recipes.stress_rows import distinct_lrs
from recipes.stress_stats import MIN_SEEDS

__all__ = ["HIGH_LR_MIN", "TEXT", "claims", "claims_section"]

#: "high" learning rates: ten times the recipe's AdamW default (1e-3) and above
HIGH_LR_MIN = 0.01
_BY = "qk_norm"

#: key -> (title, the source's statement, how it is tested)
TEXT: dict[str, tuple[str, str, str]] = {
    "0": ("Premise: without a QK-norm, the attention logits grow with the learning rate",
          "Wortsman et al. 2023: at high learning rates the attention logits of a transformer without QK-layernorm "
          "grow, the softmax collapses to one-hot and training becomes unstable.",
          f"At each high lr (>= {HIGH_LR_MIN:g}) and batch size: log10 of the largest attention logit over "
          "training of `none` minus the same at the smallest swept lr, Welch interval above 0 (seeds that "
          "diverged are left out: their run, hence their maximum, stopped early)."),
    "W1": ("QK-layernorm removes attention-logit growth",
           "Wortsman et al. 2023: QK-layernorm prevents the attention-logit growth instability.",
           f"At each high lr (>= {HIGH_LR_MIN:g}) and batch size: log10 of the largest attention logit over "
           "training, `layer` minus `none`, Welch interval below 0 (diverged seeds left out)."),
    "W2": ("QK-layernorm lowers the learning-rate sensitivity",
           "Wortsman et al. 2023: QK-layernorm reduces the sensitivity of the final loss to the learning rate.",
           "Per batch size: the per-seed LR sensitivity of the robustness table (final top-1, a diverged seed "
           "counted as chance, over every swept lr), `layer` minus `none`, Welch interval below 0. Accuracy "
           "stands in for the paper's loss."),
    "P1": ("MRS QK-norm prevents attention-logit growth",
           "PAPER.md (Phasor attention): with MRSNorm on queries and keys, large-magnitude outliers can no longer "
           "dominate the softmax.",
           f"At each high lr (>= {HIGH_LR_MIN:g}) and batch size: log10 of the largest attention logit over "
           "training, `mrs` minus `none`, Welch interval below 0 (diverged seeds left out). MRSNorm bounds a "
           "logit by max(g)^2 P^2 times the logit scale (P phasors per head), a looser bound than LayerNorm's."),
    "P2": ("MRS QK-norm prevents softmax collapse",
           "PAPER.md (Phasor attention): the softmax no longer collapses onto large-magnitude outliers.",
           f"At each high lr (>= {HIGH_LR_MIN:g}) and batch size: the smallest `attention/all/entropy_min` over "
           "training (nats; collapse drives it to 0), `mrs` minus `none`, Welch interval above 0 (diverged "
           "seeds left out). A network that stopped learning can attend uniformly (high entropy): read this "
           "with P3 and the per-cell accuracy."),
    "P3": ("MRS QK-norm lowers the learning-rate sensitivity (by extension)",
           "Not stated by the paper: asked of MRS because Wortsman et al. state it of QK-layernorm (W2).",
           "Per batch size: the per-seed LR sensitivity, `mrs` minus `none`, Welch interval below 0."),
}

_RULE = [
    "Computed by `recipes/stress_claims_qk.py` from `results.csv`; nothing in this section is written by hand.",
    "",
    *DECISION_RULE,
    f"**High learning rates** are the swept ones at or above {HIGH_LR_MIN:g}, ten times the recipe's AdamW "
    "default (1e-3): a constant of the code (`HIGH_LR_MIN`), not a flag. **Logits** are compared on a log10 "
    "scale (their growth is multiplicative); logits and entropies come from the AttentionMonitor's logged "
    "steps, and a seed whose loss turned non-finite is left out of those comparisons (its run stopped early); "
    f"a comparison where an arm ran {MIN_SEEDS} or more seeds but fewer than {MIN_SEEDS} did not diverge "
    "cannot be measured and is listed but left out of the combination. **LR sensitivity** is the robustness "
    "table's (below), per seed.",
    "",
]


def _log_logit(row: dict[str, Any]) -> Optional[float]:
    value = row.get("max_logit")
    if row.get("diverged") or value is None or not math.isfinite(value) or value <= 0:
        return None
    return math.log10(value)


def _entropy(row: dict[str, Any]) -> Optional[float]:
    value = row.get("min_entropy")
    return None if row.get("diverged") or value is None else value


def _high(rows: list[dict[str, Any]]) -> list[float]:
    return [lr for lr in distinct_lrs(rows) if lr >= HIGH_LR_MIN * (1 - 1e-9)]


def _missing(label: str, why: str) -> Comparison:
    return Comparison(label, "none", "below", 0.0, lambda level: None, why, "")


def _per_lr(rows: list[dict[str, Any]], a: str, b: str, get: Any, side: str) -> list[Comparison]:
    """``a`` minus ``b`` at every high lr and batch size; diverged seeds' values are left out."""
    sizes = sorted({r["batch_size"] for r in rows})
    out = []
    for lr in _high(rows):
        for bs in sizes:
            va = (a, arm_values(rows, a, lr, bs, get, by=_BY))
            vb = (b, arm_values(rows, b, lr, bs, get, by=_BY))
            out.append(welch_comparison(f"lr {lr:g}, batch {bs}: {a} - {b}", va, vb, side, 0.0, unit="",
                                        optional=unmeasurable(va, vb)))
    return out or [_missing(f"{a} - {b}", f"missing cells: no swept lr >= {HIGH_LR_MIN:g}")]


def _premise(rows: list[dict[str, Any]]) -> list[Comparison]:
    lrs = distinct_lrs(rows)
    sizes = sorted({r["batch_size"] for r in rows})
    out = []
    for lr in [lr for lr in _high(rows) if lrs and lr > lrs[0]]:
        for bs in sizes:
            high = (f"none @ lr {lr:g}", arm_values(rows, "none", lr, bs, _log_logit, by=_BY))
            low = (f"none @ lr {lrs[0]:g}", arm_values(rows, "none", lrs[0], bs, _log_logit, by=_BY))
            out.append(welch_comparison(f"batch {bs}: none @ {lr:g} - none @ {lrs[0]:g}", high, low, "above", 0.0,
                                        unit="", optional=unmeasurable(high, low)))
    return out or [_missing("none", f"missing cells: needs a swept lr >= {HIGH_LR_MIN:g} above the smallest")]


def _sensitivity(rows: list[dict[str, Any]], a: str, b: str) -> list[Comparison]:
    from recipes.stress_summary import robustness

    found = {(s[_BY], s["batch_size"]): s for s in robustness(rows, by=_BY)}

    def values(arm: str, bs: int) -> tuple[str, Values]:
        s = found.get((arm, bs))
        if s is None:
            return arm, ([], f"missing cells: {arm} at batch {bs}")
        if not s["complete"]:
            return arm, ([], f"missing cells: {arm} at batch {bs} lacks some of the swept lrs")
        seeds = s["per_seed_sensitivity"]
        return arm, (seeds, None if len(seeds) >= MIN_SEEDS else
                     f"too few seeds: {arm} at batch {bs} has n={len(seeds)} (needs {MIN_SEEDS})")

    return [welch_comparison(f"batch {bs}: {a} - {b}", values(a, bs), values(b, bs), "below", 0.0)
            for bs in sorted({r["batch_size"] for r in rows})]


def claims(rows: list[dict[str, Any]]) -> list[Claim]:
    """The ``qk`` sweep's claims over typed ``results.csv`` rows, not yet evaluated."""
    logit = "log10 of the largest attention logit over training (seeds that did not diverge)"
    groups = {
        "0": [(f"{logit}: none at a high lr above none at the smallest lr", _premise(rows))],
        "W1": [(f"{logit}: layer below none", _per_lr(rows, "layer", "none", _log_logit, "below"))],
        "W2": [("LR sensitivity (points of top-1): layer below none", _sensitivity(rows, "layer", "none"))],
        "P1": [(f"{logit}: mrs below none", _per_lr(rows, "mrs", "none", _log_logit, "below"))],
        "P2": [("smallest attention entropy over training (nats): mrs above none",
                _per_lr(rows, "mrs", "none", _entropy, "above"))],
        "P3": [("LR sensitivity (points of top-1): mrs below none", _sensitivity(rows, "mrs", "none"))],
    }
    return [Claim(key, *TEXT[key], groups=groups[key]) for key in TEXT]


def claims_section(rows: list[dict[str, Any]]) -> list[str]:
    """Evaluate every claim over typed ``results.csv`` rows and lay the "Claims" section out."""
    return markdown([evaluate(c) for c in claims(rows)], rule=_RULE)
