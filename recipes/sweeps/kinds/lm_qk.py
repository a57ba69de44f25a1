"""The ``lm-qk`` sweep: QK-norms of the byte-level Llama of the ``lm`` sweep, the Wortsman et al. 2023 setting.

Wortsman et al. 2023 ("Small-scale proxies for large-scale Transformer training instabilities", arXiv
2309.14322) measured attention-logit growth and LR sensitivity on small transformer language models.
Arms: the QK-norm added to every attention layer (``none``, ``layer``, ``rms``, ``mrs``), the Llama's
own RMSNorms kept, x AdamW learning rate x seed, in bf16 mixed precision (``--precision`` to change),
on the ``stdlib`` bytes, with the ``lm`` sweep's model, steps and monitors. Scored by the final val
bits per byte (a diverged cell: 8). ``results.csv`` states each cell's ``precision`` (Lightning's name).

The statements tested (the attention-logit comparisons are the ``qk`` sweep's,
:func:`recipes.sweeps.kinds.qk.per_lr`, on the LM): **0** the premise (logits of ``none`` grow with the lr),
**W1** QK-layernorm removes the growth, **W2** and lowers the LR sensitivity (on bpb), **Q1** the MRS
QK-norm removes the growth, **Q2** and lowers the LR sensitivity, **Q3** the MRS QK-norm does better
than QK-layernorm (LR sensitivity and best bpb), as the ViT sweep asks. Needs no torch.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from recipes.sweeps import figure as fig
from recipes.sweeps.claims.engine import Claim, Comparison, arm_values, welch_comparison
from recipes.sweeps.claims.markdown import DECISION_RULE
from recipes.sweeps.kind import Sweep
from recipes.sweeps.kinds.lm import LM_COMMON, LM_DATASETS, extra_settings as lm_settings
from recipes.sweeps.kinds.qk import HIGH_LR_MIN, log_logit, per_lr, premise, progress_note, sensitivity
from recipes.sweeps.records import Row, distinct_lrs
from recipes.sweeps.robustness import robustness
from recipes.sweeps.score import BPB, DIVERGED_BPB

__all__ = ["LM_QK", "TEXT", "claims", "figure"]

_H = f"{HIGH_LR_MIN:g}"
_LOGIT = (f"At each high lr (>= {_H}): log10 of the largest attention logit over training (AttentionMonitor, worst "
          "layer), {a} minus `none`, Welch interval below 0 (seeds that diverged are left out: their run stopped early).")
_SENS = (f"The per-seed LR sensitivity on the final val bpb over every swept lr (a diverged cell = {DIVERGED_BPB:g} "
         "bpb; robustness table), {a} minus {b}, Welch interval below 0.")
TEXT: dict[str, tuple[str, str, str]] = {
    "0": ("Premise: without a QK-norm, the attention logits grow with the learning rate",
          "Wortsman et al. 2023: at high learning rates the attention logits of a transformer without QK-layernorm "
          "grow, the softmax collapses and training becomes unstable.",
          f"At each high lr (>= {_H}): log10 of the largest attention logit over training of `none` minus the same "
          "at the smallest swept lr, Welch interval above 0 (diverged seeds left out)."),
    "W1": ("QK-layernorm removes attention-logit growth",
           "Wortsman et al. 2023: QK-layernorm prevents the attention-logit growth instability.",
           _LOGIT.format(a="`layer`")),
    "W2": ("QK-layernorm lowers the learning-rate sensitivity",
           "Wortsman et al. 2023: QK-layernorm reduces the sensitivity of the final loss to the learning rate.",
           _SENS.format(a="`layer`", b="`none`")),
    "Q1": ("MRS QK-norm removes attention-logit growth",
           "docs/method.md (Phasor attention): with MRSNorm on queries and keys, large-magnitude outliers can no "
           "longer dominate the softmax.",
           _LOGIT.format(a="`mrs`")),
    "Q2": ("MRS QK-norm lowers the learning-rate sensitivity",
           "Asked of MRS because Wortsman et al. state it of QK-layernorm (not stated by the paper).",
           _SENS.format(a="`mrs`", b="`none`")),
    "Q3": ("MRS QK-norm does better than QK-layernorm",
           "Asked by the issue as for the ViT sweep: the paper presents MRSNorm as the better norm for phasor "
           "attention.",
           _SENS.format(a="`mrs`", b="`layer`") + " And the final bpb of each at its own best swept lr, `mrs` minus "
           "`layer`, Welch interval below 0."),
}

RULE = (
    "Computed by `recipes/sweeps/kinds/lm_qk.py` from `results.csv`; nothing in this section is written by hand.",
    "",
    *DECISION_RULE,
    f"**Bits per byte** (bpb): the validation cross-entropy in bits per byte; a diverged cell counts as "
    f"{DIVERGED_BPB:g} bpb (a uniform guess over 256 bytes). **High learning rates** are the swept ones at or above "
    f"{_H} (`HIGH_LR_MIN` of the `qk` sweep: ten times the recipe's AdamW default). Logits are compared on a log10 "
    "scale (their growth is multiplicative).",
    "",
)


def _best_bpb(rows: list[Row], a: str, b: str) -> list[Comparison]:
    best = {(s.arm, s.batch_size): s.best_lr for s in robustness(rows, BPB)}
    out = []
    for bs in sorted({r.batch_size for r in rows}):
        sides = []
        for arm in (a, b):
            lr = best.get((arm, bs))
            sides.append((f"{arm} @ lr {lr:g}", arm_values(rows, arm, lr, bs, BPB.counted)) if lr is not None else
                         (arm, ([], f"missing cells: {arm} at batch {bs}" if any(r.arm == arm for r in rows) else
                                f"{arm} was not in this sweep")))
        out.append(welch_comparison(f"batch {bs}: {a} - {b}, each at its best lr", *sides, "below", 0.0, unit=""))
    return out


def claims(rows: list[Row]) -> list[Claim]:
    """The ``lm-qk`` sweep's claims over typed ``results.csv`` rows, not yet evaluated."""
    logit = "log10 of the largest attention logit over training (seeds that did not diverge)"
    sens = "LR sensitivity (bpb)"
    groups = {
        "0": [(f"{logit}: none at a high lr above none at the smallest lr", premise(rows))],
        "W1": [(f"{logit}: layer below none", per_lr(rows, "layer", "none", log_logit, "below"))],
        "W2": [(f"{sens}: layer below none", sensitivity(rows, "layer", "none", BPB))],
        "Q1": [(f"{logit}: mrs below none", per_lr(rows, "mrs", "none", log_logit, "below"))],
        "Q2": [(f"{sens}: mrs below none", sensitivity(rows, "mrs", "none", BPB))],
        "Q3": [(f"{sens}: mrs below layer", sensitivity(rows, "mrs", "layer", BPB)),
               ("final bpb at each QK-norm's best lr: mrs below layer", _best_bpb(rows, "mrs", "layer"))],
    }
    return [Claim(key, *TEXT[key], groups=groups[key]) for key in TEXT]


def figure(rows: list[Row], path: Path) -> Any:
    """Final val bpb (top) and the largest attention logit over training (bottom, log scale) against lr.

    Returns the two panels (matplotlib axes, a column), closed but readable.
    """
    plt = fig.pyplot()
    bs = min(r.batch_size for r in rows)
    all_lrs, seeds = distinct_lrs(rows), sorted({r.seed for r in rows})
    figure_, (top, logit) = plt.subplots(2, 1, figsize=(5.5, 7.0), constrained_layout=True)
    fig.lines(top, rows, bs, BPB.counted)
    top.axhline(DIVERGED_BPB, color="k", ls=":", lw=1)
    top.set_ylabel("final validation bits per byte")
    top.set_title(f"final val bpb (a diverged seed = {DIVERGED_BPB:g})", fontsize=9)
    fig.lines(logit, rows, bs, lambda r: r.metrics.get("max_logit"))
    logit.set_yscale("log")
    logit.set_ylabel("max attention logit over training")
    logit.set_title("largest |attention logit| (worst layer)", fontsize=9)
    for ax in (top, logit):
        fig.lr_axis(ax, all_lrs)
    handles, labels = top.get_legend_handles_labels()
    fig.save(plt, figure_, handles, labels, f"LM QK-norm stress: mean over {len(seeds)} seed(s), band = min-max", path)
    return top, logit


def _model_arms(arm: str) -> dict[str, Any]:
    return {"norm": "none", "qk_norm": arm}  # none: the Llama's own RMSNorms stay


def extra_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {**lm_settings(args), "body_norms": "the Llama's own LlamaRMSNorm (kept)",
            "precision": args.precision or LM_DATASETS[args.dataset]["precision"]}


LM_QK = Sweep(
    name="lm-qk", arm_column="qk_norm", flag="--lm-qk-norms", arms=("none", "layer", "rms", "mrs"),
    arms_help="--sweep lm-qk: QK-norms to compare; none adds none",
    grid={"arms": ["none", "layer", "rms", "mrs"], "lrs": [0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0],
          "batch_sizes": [16], "seeds": [0, 1, 2]},
    quick={"lrs": [0.003, 0.1, 1.0], "seeds": [0], "max_steps": {"stdlib": 40, "text": 40}},
    help="lm-qk: the QK-norms of the byte-level Llama (its RMSNorms stay)",
    model_arms=_model_arms, claims=claims, rule=RULE, figure=figure, title="Language-model QK-norm stress sweep",
    arm_label="QK-norm", plotted="the final val bpb and the largest attention logit",
    cell_prefix="lmqk-", out_stem="stress_lm_qk", extra_settings=extra_settings, progress_note=progress_note,
    factor_columns=("precision",), **LM_COMMON,
)
