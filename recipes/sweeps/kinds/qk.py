"""The ``qk`` sweep: the QK-norm of a small ViT, its claims on attention-logit growth, softmax collapse and
LR sensitivity, and its figure.

After Wortsman et al. 2023 ("Small-scale proxies for large-scale Transformer training instabilities",
arXiv 2309.14322). Arms: the QK-norm added to every attention layer (``none``, ``layer``, ``rms``,
``mrs``), the ViT's own LayerNorms kept, x learning rate x batch size x seed; AdamW; the
``AttentionMonitor`` records the attention logits and the softmax entropy, the
``GradientHomogeneityMonitor`` the phasor gradients.

The statements tested (each a list of comparisons over seeds, decided and combined by
:func:`recipes.sweeps.claims.engine.evaluate`):

* **0** (the premise, Wortsman et al. 2023): without a QK-norm the attention logits grow with
  the learning rate;
* **W1** (Wortsman et al. 2023): QK-layernorm removes the attention-logit growth; **W2**: it lowers
  the LR sensitivity;
* **P1** (``docs/method.md``, "Phasor attention"): the MRS QK-norm prevents the logit growth; **P2**: and
  softmax collapse;
* **P3** (asked of MRS by extension, not stated by the paper): the MRS QK-norm lowers the LR
  sensitivity.

"High learning rates" are the swept ones at or above :data:`HIGH_LR_MIN`. Needs no torch.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any, Mapping, Optional

from recipes.sweeps import figure as fig
from recipes.sweeps.claims.engine import (Claim, Comparison, Values, arm_values, missing, unmeasurable,
                                          welch_comparison)
from recipes.sweeps.claims.markdown import DECISION_RULE
from recipes.sweeps.claims.stats import MIN_SEEDS
from recipes.sweeps.kind import History, Measured, Sweep
from recipes.sweeps.kinds.norm import measure as norm_measure, monitors as norm_monitors
from recipes.sweeps.records import Row, accuracy, distinct_lrs
from recipes.sweeps.robustness import by_arm, robustness
from recipes.sweeps.score import TOP1, Score
from recipes.sweeps.series import extreme, thin

__all__ = ["ATTENTION_QUERIES", "HIGH_LR_MIN", "QK", "TEXT", "VIT_CIFAR", "VIT_DIGITS", "claims", "figure", "log_logit",
           "per_lr", "premise", "sensitivity"]

#: "high" learning rates: ten times the recipe's AdamW default (1e-3) and above
HIGH_LR_MIN = 0.01
#: queries per attention layer whose logits the AttentionMonitor recomputes on a logging step
ATTENTION_QUERIES = 256
#: the digits ViT (``recipes/configs/vit_digits.yaml``): 2x2 patches of the 8x8 scans (16 tokens
#: and a class token), width 64, 4 blocks of 4 heads of width 16 (8 phasors per head), MLP x2
VIT_DIGITS = {"img_size": 8, "patch_size": 2, "embed_dim": 64, "depth": 4, "num_heads": 4, "mlp_ratio": 2.0}
#: the CIFAR ViT (``recipes/configs/vit_cifar100.yaml``): ViT-Lite-7/4 of Hassani et al. 2021
#: (arXiv 2104.05704): 4x4 patches of 32x32 images (64 tokens), width 256, 7 blocks of 4 heads of
#: width 64, MLP x2 (3.7 M parameters)
VIT_CIFAR = {"img_size": 32, "patch_size": 4, "embed_dim": 256, "depth": 7, "num_heads": 4, "mlp_ratio": 2.0}
_VIT = "timm:vit_tiny_patch16_224"

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
           "docs/method.md (Phasor attention): with MRSNorm on queries and keys, large-magnitude outliers can no longer "
           "dominate the softmax.",
           f"At each high lr (>= {HIGH_LR_MIN:g}) and batch size: log10 of the largest attention logit over "
           "training, `mrs` minus `none`, Welch interval below 0 (diverged seeds left out). MRSNorm bounds a "
           "logit by max(g)^2 P^2 times the logit scale (P phasors per head), a looser bound than LayerNorm's."),
    "P2": ("MRS QK-norm prevents softmax collapse",
           "docs/method.md (Phasor attention): the softmax no longer collapses onto large-magnitude outliers.",
           f"At each high lr (>= {HIGH_LR_MIN:g}) and batch size: the smallest `attention/all/entropy_min` over "
           "training (nats; collapse drives it to 0), `mrs` minus `none`, Welch interval above 0 (diverged "
           "seeds left out). A network that stopped learning can attend uniformly (high entropy): read this "
           "with P3 and the per-cell accuracy."),
    "P3": ("MRS QK-norm lowers the learning-rate sensitivity (by extension)",
           "Not stated by the paper: asked of MRS because Wortsman et al. state it of QK-layernorm (W2).",
           "Per batch size: the per-seed LR sensitivity, `mrs` minus `none`, Welch interval below 0."),
}

RULE = (
    "Computed by `recipes/sweeps/kinds/qk.py` from `results.csv`; nothing in this section is written by hand.",
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
)


def log_logit(row: Row) -> Optional[float]:
    value = row.metrics.get("max_logit")
    if row.diverged or value is None or not math.isfinite(value) or value <= 0:
        return None
    return math.log10(value)


def _entropy(row: Row) -> Optional[float]:
    value = row.metrics.get("min_entropy")
    return None if row.diverged or value is None else value


def _high(rows: list[Row]) -> list[float]:
    return [lr for lr in distinct_lrs(rows) if lr >= HIGH_LR_MIN * (1 - 1e-9)]


def per_lr(rows: list[Row], a: str, b: str, get: Any, side: str) -> list[Comparison]:
    """``a`` minus ``b`` at every high lr and batch size; diverged seeds' values are left out."""
    sizes = sorted({r.batch_size for r in rows})
    out = []
    for lr in _high(rows):
        for bs in sizes:
            va = (a, arm_values(rows, a, lr, bs, get))
            vb = (b, arm_values(rows, b, lr, bs, get))
            out.append(welch_comparison(f"lr {lr:g}, batch {bs}: {a} - {b}", va, vb, side, 0.0, unit="",
                                        optional=unmeasurable(va, vb)))
    return out or [missing(f"{a} - {b}", f"missing cells: no swept lr >= {HIGH_LR_MIN:g}")]


def premise(rows: list[Row]) -> list[Comparison]:
    lrs = distinct_lrs(rows)
    sizes = sorted({r.batch_size for r in rows})
    out = []
    for lr in [lr for lr in _high(rows) if lrs and lr > lrs[0]]:
        for bs in sizes:
            high = (f"none @ lr {lr:g}", arm_values(rows, "none", lr, bs, log_logit))
            low = (f"none @ lr {lrs[0]:g}", arm_values(rows, "none", lrs[0], bs, log_logit))
            out.append(welch_comparison(f"batch {bs}: none @ {lr:g} - none @ {lrs[0]:g}", high, low, "above", 0.0,
                                        unit="", optional=unmeasurable(high, low)))
    return out or [missing("none", f"missing cells: needs a swept lr >= {HIGH_LR_MIN:g} above the smallest")]


def sensitivity(rows: list[Row], a: str, b: str, score: Score = TOP1) -> list[Comparison]:
    """Per batch size: the per-seed LR sensitivity (:mod:`recipes.sweeps.robustness`) of ``a`` minus ``b``, below 0."""
    found = by_arm(robustness(rows, score))

    def values(arm: str, bs: int) -> tuple[str, Values]:
        s = found.get((arm, bs))
        if s is None:
            swept = any(r.arm == arm for r in rows)
            return arm, ([], f"missing cells: {arm} at batch {bs}" if swept else f"{arm} was not in this sweep")
        if not s.complete:
            return arm, ([], f"missing cells: {arm} at batch {bs} lacks some of the swept lrs")
        seeds = s.per_seed_sensitivity
        return arm, (seeds, None if len(seeds) >= MIN_SEEDS else
                     f"too few seeds: {arm} at batch {bs} has n={len(seeds)} (needs {MIN_SEEDS})")

    return [welch_comparison(f"batch {bs}: {a} - {b}", values(a, bs), values(b, bs), "below", 0.0,
                             unit="pt" if score is TOP1 else "")
            for bs in sorted({r.batch_size for r in rows})]


def claims(rows: list[Row]) -> list[Claim]:
    """The ``qk`` sweep's claims over typed ``results.csv`` rows, not yet evaluated."""
    logit = "log10 of the largest attention logit over training (seeds that did not diverge)"
    groups = {
        "0": [(f"{logit}: none at a high lr above none at the smallest lr", premise(rows))],
        "W1": [(f"{logit}: layer below none", per_lr(rows, "layer", "none", log_logit, "below"))],
        "W2": [("LR sensitivity (points of top-1): layer below none", sensitivity(rows, "layer", "none"))],
        "P1": [(f"{logit}: mrs below none", per_lr(rows, "mrs", "none", log_logit, "below"))],
        "P2": [("smallest attention entropy over training (nats): mrs above none",
                per_lr(rows, "mrs", "none", _entropy, "above"))],
        "P3": [("LR sensitivity (points of top-1): mrs below none", sensitivity(rows, "mrs", "none"))],
    }
    return [Claim(key, *TEXT[key], groups=groups[key]) for key in TEXT]


def figure(rows: list[Row], path: Path) -> Any:
    """Per batch size a row of two panels, final top-1 and the largest attention logit over training
    (``max_logit``, log scale; a diverged seed's value is the largest logged before the divergence),
    against lr, into ``path``.

    Returns the panels (matplotlib axes: a row per batch size, two columns), closed but readable.
    """
    plt = fig.pyplot()
    sizes = sorted({r.batch_size for r in rows})
    all_lrs = distinct_lrs(rows)
    seeds = sorted({r.seed for r in rows})
    figure_, axes = plt.subplots(len(sizes), 2, figsize=(9.5, 0.6 + 3.6 * len(sizes)), squeeze=False,
                                 constrained_layout=True)
    for (top, logit), bs in zip(axes, sizes):
        fig.lines(top, rows, bs, accuracy, scale=100)
        fig.chance_line(top, rows, all_lrs)
        top.set_ylim(bottom=0, top=100)
        top.set_ylabel("final validation top-1 (%)")
        top.set_title(f"final top-1 (batch {bs}; a diverged seed = chance)", fontsize=9)
        fig.lines(logit, rows, bs, lambda r: r.metrics.get("max_logit"))
        if any((r.metrics.get("max_logit") or 0) > 0 for r in rows):  # none logged yet: a log axis has no range
            logit.set_yscale("log")
        logit.set_ylabel("max attention logit over training")
        logit.set_title(f"largest |attention logit| (batch {bs}; worst layer)", fontsize=9)
        for ax in (top, logit):
            fig.lr_axis(ax, all_lrs)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.save(plt, figure_, handles, labels, f"QK-norm stress: mean over {len(seeds)} seed(s), band = min-max", path)
    return axes


def _model_arms(arm: str) -> dict[str, Any]:
    return {"norm": "batch", "qk_norm": arm}  # batch: the ViT's own norms stay


def monitors(args: argparse.Namespace) -> list[Any]:
    """The norm sweep's GradientHomogeneityMonitor and the AttentionMonitor."""
    from lightning_mrs.callbacks import AttentionMonitor

    return [*norm_monitors(args), AttentionMonitor(log_every_n_steps=args.log_every, max_queries=ATTENTION_QUERIES)]


def measure(history: History) -> Measured:
    """The norm sweep's gradient figures and the AttentionMonitor's extremes over the logged steps
    (finite values: before any divergence); the logit curve."""
    metrics, _ = norm_measure(history)
    metrics.update(max_logit=extreme(history.get("attention/all/logit_max", []), max),
                   min_entropy=extreme(history.get("attention/all/entropy_min", []), min),
                   max_collapsed_frac=extreme(history.get("attention/all/collapsed_frac", []), max))
    return metrics, {"logit_max": thin(history.get("attention/all/logit_max", []))}


def extra_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {"sweep": "qk", "body_norms": "the model's own (kept)",
            "attention_monitor": f"every {args.log_every} steps, {ATTENTION_QUERIES} sampled queries per layer"}


def progress_note(record: Mapping[str, Any]) -> str:
    value = record.get("max_logit")
    return f", max attention logit {value:.3g}" if value is not None else ""


QK = Sweep(
    name="qk", arm_column="qk_norm", flag="--qk-norms", arms=("none", "layer", "rms", "mrs"),
    arms_help="--sweep qk: QK-norms to compare; none adds none",
    # log-spaced, from the recipe's AdamW default (1e-3) to 300x it
    grid={"arms": ["none", "layer", "rms", "mrs"], "lrs": [0.001, 0.003, 0.01, 0.03, 0.1, 0.3],
          "batch_sizes": [64], "seeds": [0, 1, 2]},
    quick={"lrs": [0.003, 0.03, 0.3], "seeds": [0], "epochs": {"digits": 10}},
    datasets={
        # no augmentation: 1-pixel shifts of the 8x8 scans slow this ViT down several-fold
        "digits": {"arch": _VIT, "arch_kwargs": VIT_DIGITS, "cifar_stem": False, "image_size": 8,
                   "augment": False, "epochs": 20, "accelerator": "cpu"},
        "cifar100": {"arch": _VIT, "arch_kwargs": VIT_CIFAR, "cifar_stem": False, "image_size": 32,
                     "augment": True, "epochs": None, "accelerator": "auto"},
        "folder": {"arch": _VIT, "arch_kwargs": VIT_CIFAR, "cifar_stem": False, "image_size": 32,
                   "augment": True, "epochs": None, "accelerator": "auto"},
        "synthetic": {"arch": _VIT, "arch_kwargs": VIT_CIFAR, "cifar_stem": False, "image_size": 32,
                      "augment": True, "epochs": None, "accelerator": "auto"},
    },
    optimizer="adamw", weight_decay=0.05, warmup_frac=0.05,
    optimizer_text="AdamW betas (0.9, 0.999), decoupled weight decay on weight matrices only (not on norms, "
                   "biases, position embeddings, tokens)",
    help="qk: the QK-norms of a ViT whose LayerNorms stay",
    model_arms=_model_arms, monitors=monitors, measure=measure,
    metric_columns=("mean_grad_cv", "mean_starved_frac", "max_logit", "min_entropy", "max_collapsed_frac"),
    table=(("max logit", "max_logit"), ("min entropy", "min_entropy"), ("max collapsed_frac", "max_collapsed_frac")),
    table_note="From the AttentionMonitor, over the logged training steps (before any divergence), mean over seeds: "
               "max logit = the largest `attention/all/logit_max` (the worst layer's largest |logit|); min entropy = "
               "the smallest `attention/all/entropy_min` (nats; the softmax entropy of the lowest head, averaged "
               "over layers); max collapsed_frac = the largest `attention/all/collapsed_frac` (the worst layer's "
               "share of attention rows with one weight above 0.99).",
    claims=claims, rule=RULE, figure=figure,
    title="QK-norm stress sweep", arm_label="QK-norm", plotted="final top-1 and the largest attention logit",
    cell_prefix="qk-", out_stem="stress_qk", extra_settings=extra_settings, progress_note=progress_note,
)
