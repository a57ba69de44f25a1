"""The ``lm`` sweep: the body norms of a small byte-level Llama in mixed precision, the paper's premise.

Arms: a norm (``rms``, ``mrs``, ``layer``: every body norm of the LM recipe's Llama replaced) at a
precision (``bf16``: bfloat16 autocast; ``fp16``: float16 autocast with a loss scaler; ``fp32``: a
reference, run at the smallest and the largest swept learning rates only), e.g. ``mrs-fp16``, x
AdamW learning rate x seed, on the ``stdlib`` bytes (:mod:`recipes.sweeps.lm_cell`). The
``OutlierMonitor`` records the norms' inputs, the ``GradientHomogeneityMonitor`` the phasor
gradients, the ``AttentionMonitor`` the attention logits, :class:`~recipes.sweeps.lm_cell.ScalerLog`
the loss scaler. A diverged cell counts as 8 bits per byte (:data:`~recipes.sweeps.score.DIVERGED_BPB`).

The statements tested, from the paper's abstract ("in RMSNorm, sum(x^2) lets a single large-magnitude
channel dominate the denominator, which in mixed precision or under extreme optimisation leads to
numerical explosion (NaN), gradient starvation of the low-magnitude channels ..."; MRSNorm's mean
of pair magnitudes is meant to stop that) and ``docs/method.md`` ("The language-model sweeps", the claims table):
**P1** numerical explosion, **P2** outlier dominance, **P3** gradient starvation, **P4** learning-rate
robustness, **P5** half the affine parameters cost nothing. Each is a list of comparisons over
seeds, decided and combined by :func:`recipes.sweeps.claims.engine.evaluate`; the thresholds are
module constants fixed before any sweep ran. Needs no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from recipes.sweeps import figure as fig
from recipes.sweeps.claims.engine import (Claim, Comparison, Values, arm_values, single, unmeasurable,
                                          welch_comparison)
from recipes.sweeps.claims.markdown import DECISION_RULE
from recipes.sweeps.claims.stats import MIN_SEEDS
from recipes.sweeps.kind import History, Measured, Sweep
from recipes.sweeps.records import Row, distinct_lrs, same_lr, select, survived
from recipes.sweeps.robustness import by_arm, robustness
from recipes.sweeps.score import BPB, DIVERGED_BPB, NEAR_FRACTION
from recipes.sweeps.series import extreme, finite_mean, thin

__all__ = ["HEAD", "HIGH_LR_MIN", "LARGE_SHARE", "LM", "LM_CONFIG", "LM_DATASETS", "MARGIN_BPB", "NORMS",
           "SCALE_FLOOR", "TEXT", "claims", "figure", "measure", "monitors", "split_arm"]

NORMS = ("rms", "mrs", "layer")
#: the precisions the claims compare (fp32 is a reference only)
CLAIM_PRECISIONS = ("bf16", "fp16")
#: "high" learning rates: ten times the recipe's AdamW default (1e-3) and above
HIGH_LR_MIN = 0.01
#: "a large share": the largest channel takes at least this many times a uniform share (1/C) of sum x^2
LARGE_SHARE = 10.0
#: "exhausts the loss scaler": its scale fell below 1, so even the unscaled gradients overflow float16
SCALE_FLOOR = 1.0
#: "within a stated margin" (P5): MRSNorm's best bpb at most this many bits per byte above RMSNorm's
MARGIN_BPB = 0.03
#: the model: the LM recipe's Llama, 2 layers of width 32, 2 heads of 16 (8 phasors per head), MLP x4
LM_CONFIG = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
             "intermediate_size": 128}
#: per dataset: the model, the windows, the steps (a stream of windows: steps, not epochs)
LM_DATASETS: dict[str, dict[str, Any]] = {
    name: {"arch": "llama", "arch_kwargs": LM_CONFIG, "cifar_stem": False, "image_size": None, "augment": False,
           "accelerator": "cpu", "epochs": None, "max_steps": 100, "seq_len": 64, "val_windows": 64,
           "precision": "bf16-mixed"}
    for name in ("stdlib", "text")
}
#: the shared columns a language-model sweep has (no top-1, no classes)
HEAD = ("lr", "batch_size", "seed", "arch", "dataset", "steps", "planned_steps", "final_val_loss", "final_train_loss",
        "diverged", "divergence_step")
#: validations per cell, evenly spaced, the last at the final step (``recipes/sweeps/lm_cell.py``)
VALIDATIONS = 4
#: queries per attention layer whose logits the AttentionMonitor recomputes on a logging step
ATTENTION_QUERIES = 64

_H = f"{HIGH_LR_MIN:g}"
TEXT: dict[str, tuple[str, str, str]] = {
    "P1": ("Numerical explosion: under fp16, RMSNorm runs blow up at high learning rates where MRSNorm runs do not",
           "Abstract: sum(x^2) lets a single large-magnitude channel dominate the denominator, which in mixed "
           "precision or under extreme optimisation leads to numerical explosion (NaN).",
           f"fp16 cells at the high learning rates (>= {_H}). A seed *fails* at an lr when its training loss turned "
           f"non-finite or its loss scaler was exhausted (scale below {SCALE_FLOOR:g}: even unscaled gradients "
           "overflow float16). Per seed: the share of the high lrs at which it failed, RMSNorm minus MRSNorm, Welch "
           "interval above 0; and the mean over the high lrs of the share of the planned steps reached before the "
           "first non-finite loss (1 when none), MRSNorm minus RMSNorm, Welch interval above 0. Per-lr divergence "
           "counts and first non-finite steps: the per-cell table."),
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
           "Abstract: ... gradient starvation of the low-magnitude channels (PAPER.md: under MRSNorm every phasor "
           "receives a scale-gradient of the same norm).",
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
    "Computed by `recipes/sweeps/lm.py` from `results.csv`; nothing in this section is written by hand.",
    "",
    *DECISION_RULE,
    f"**Bits per byte** (bpb) is the validation cross-entropy in bits per byte; a cell whose training loss turned "
    f"non-finite counts as {DIVERGED_BPB:g} bpb (a uniform guess over the 256 byte values, the loss at "
    f"initialisation) from that step on. **High learning rates** are the swept ones at or above {_H}. The "
    f"thresholds (`HIGH_LR_MIN`, `LARGE_SHARE` = {LARGE_SHARE:g}, `SCALE_FLOOR` = {SCALE_FLOOR:g}, `MARGIN_BPB` = "
    f"{MARGIN_BPB:g} bpb, about 1 % of the bpb these models reach) are constants of the code fixed before any "
    "sweep ran, not flags. The fp32 arms are a reference at two learning rates and enter no claim.",
    "",
)


def split_arm(arm: str) -> tuple[str, str]:
    """``mrs-fp16`` -> ``("mrs", "fp16")``."""
    norm, _, precision = arm.rpartition("-")
    return norm, precision


def _arm(norm: str, precision: str) -> str:
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


def _claim1(rows: list[Row]) -> list[tuple[str, list[Comparison]]]:
    high, out_rate, out_steps = _high(rows), [], []
    for bs in sorted({r.batch_size for r in rows}):
        rms, mrs = _arm("rms", "fp16"), _arm("mrs", "fp16")
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
        arm = _arm("rms", precision)
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
            rms, mrs = _arm("rms", precision), _arm("mrs", precision)
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
        mrs = _arm("mrs", precision)
        for base in ("rms", "layer"):
            other = _arm(base, precision)
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
                arm = _arm(norm, precision)
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
    """P1-P5 over typed ``results.csv`` rows, not yet evaluated."""
    builders = {"P1": _claim1, "P2": _claim2, "P3": _claim3, "P4": _claim4, "P5": _claim5}
    return [Claim(key, *TEXT[key], groups=build(rows)) for key, build in builders.items()]


def _divergence_marks(ax: Any, rows: list[Row], bs: int) -> None:
    """At the foot of ``ax``, an x in the norm's colour and ``k/n`` where k of a cell's n seeds diverged
    (a diverged run may have recorded no share at all, so the line above it can stop short)."""
    norms = sorted({r.arm for r in rows}, key=lambda n: NORMS.index(n) if n in NORMS else len(NORMS))
    for i, norm in enumerate(norms):
        for lr in distinct_lrs(rows):
            cells = select(rows, lr=lr, batch_size=bs, arm=norm)
            k = sum(r.diverged for r in cells)
            if k:
                y = 0.04 + 0.07 * i  # axes fraction: one level per norm
                ax.plot([lr], [y], "x", color=fig.COLOURS.get(norm), ms=8, mew=2, transform=ax.get_xaxis_transform())
                ax.text(lr, y, f"{k}/{len(cells)}  ", color=fig.COLOURS.get(norm), fontsize=7, va="center", ha="right",
                        transform=ax.get_xaxis_transform())


def figure(rows: list[Row], path: Path) -> Any:
    """Per precision a column: final bpb against lr (top), RMSNorm's largest-channel share of the norm inputs
    (``max_rms_share``, bottom); a red x where a seed diverged. Returns the panels (2 x precisions)."""
    plt = fig.pyplot()
    precisions = [p for p in ("bf16", "fp16", "fp32") if any(split_arm(r.arm)[1] == p for r in rows)]
    all_lrs, seeds = distinct_lrs(rows), sorted({r.seed for r in rows})
    bs = min(r.batch_size for r in rows)
    figure_, axes = plt.subplots(2, len(precisions), figsize=(0.8 + 3.9 * len(precisions), 7.0), squeeze=False,
                                 sharey="row", constrained_layout=True)
    for column, precision in enumerate(precisions):
        mine = [dataclasses.replace(r, arm=split_arm(r.arm)[0]) for r in rows if split_arm(r.arm)[1] == precision]
        top, share = axes[0][column], axes[1][column]
        fig.lines(top, mine, bs, BPB.counted)
        top.axhline(DIVERGED_BPB, color="k", ls=":", lw=1)
        top.set_title(f"{precision}: final val bpb (diverged = {DIVERGED_BPB:g})", fontsize=9)
        fig.lines(share, mine, bs, lambda r: r.metrics.get("max_rms_share"))
        _divergence_marks(share, mine, bs)
        share.set_title(f"{precision}: largest channel's share of sum x^2 (x: k/n diverged)", fontsize=8)
        for ax in (top, share):
            fig.lr_axis(ax, all_lrs)
    axes[0][0].set_ylabel("final validation bits per byte")
    axes[1][0].set_ylabel("max rms_share of the norm inputs")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.save(plt, figure_, handles, labels, f"Byte-level LM norm stress: mean over {len(seeds)} seed(s), band = "
             "min-max", path)
    return axes


def monitors(args: argparse.Namespace) -> list[Any]:
    """The OutlierMonitor, the GradientHomogeneityMonitor and the AttentionMonitor, every ``--log-every`` steps."""
    from lightning_mrs.callbacks import AttentionMonitor, GradientHomogeneityMonitor, OutlierMonitor

    return [OutlierMonitor(args.log_every, per_layer=False, dashboard=False),
            GradientHomogeneityMonitor(log_every_n_steps=args.log_every, on_nonfinite="ignore"),
            AttentionMonitor(log_every_n_steps=args.log_every, max_queries=ATTENTION_QUERIES)]


def measure(history: History) -> Measured:
    """Extremes of the monitors' worst-layer figures over the logged steps (finite values: before any divergence)."""
    def largest(tag: str) -> Optional[float]:
        return extreme(history.get(tag, []), max)

    return {"max_absmax": largest("outlier/all/absmax"), "max_rms_share": largest("outlier/all/rms_share"),
            "max_mrs_share": largest("outlier/all/mrs_share"),
            "max_fp16_overflow_frac": largest("outlier/all/fp16_overflow_frac"),
            "mean_grad_cv": finite_mean(history.get("phasor/all/grad_cv", [])),
            "mean_starved_frac": finite_mean(history.get("phasor/all/starved_frac", [])),
            "max_logit": largest("attention/all/logit_max")}, {
        "logit_max": thin(history.get("attention/all/logit_max", [])),
        "absmax": thin(history.get("outlier/all/absmax", []))}


#: the record's columns every language-model kind has, after the shared ones
METRICS = ("final_bpb", "best_bpb", "scaler_skipped", "scaler_final_scale", "max_absmax", "max_rms_share",
           "max_mrs_share", "max_fp16_overflow_frac", "mean_grad_cv", "mean_starved_frac", "max_logit", "channels")
TABLE = (("skipped", "scaler_skipped"), ("final scale", "scaler_final_scale"), ("absmax", "max_absmax"),
         ("rms_share", "max_rms_share"), ("mrs_share", "max_mrs_share"), ("fp16 overflow", "max_fp16_overflow_frac"),
         ("grad_cv", "mean_grad_cv"), ("starved", "mean_starved_frac"), ("max logit", "max_logit"))
TABLE_NOTE = ("Loss scaler (fp16 only): skipped = optimizer steps it skipped (gradients with Inf/NaN), final scale = "
              "its scale at the end (from 65536). From the OutlierMonitor at the norms' inputs, worst layer, largest "
              "over the logged steps before any divergence: absmax = largest |x|; rms_share = the largest channel's "
              "share of sum x^2 (worst token); mrs_share = the largest phasor's share of the sum of pair magnitudes "
              "(same inputs); fp16 overflow = share of inputs with |x| >= 256. grad_cv, starved: the "
              "GradientHomogeneityMonitor's `phasor/all/*`, mean over the logged steps. max logit: the "
              "AttentionMonitor's largest |attention logit| (for this Llama: scale x q.k of the queries and keys as they "
              "leave their projections and QK-norms, before the rotary embedding and the causal mask). All mean over "
              "seeds.")


def data_note(data: Mapping[str, Any]) -> str:
    return f"- {data.get('text', 'data: ?')}"


def keep(cell: tuple[str, float, int, int], args: argparse.Namespace) -> bool:
    """The fp32 reference runs at the smallest and the largest swept lr only."""
    arm, lr = cell[0], cell[1]
    return split_arm(arm)[1] != "fp32" or any(same_lr(lr, x) for x in (min(args.lrs), max(args.lrs)))


def extra_settings(args: argparse.Namespace) -> dict[str, Any]:
    d = args.sweep.datasets[args.dataset]
    return {"sweep": args.sweep.name, "seq_len": d["seq_len"], "val_windows": d["val_windows"],
            "validation": f"{VALIDATIONS} times per cell (every max_steps/4 steps) unless --val-every",
            "gradient_clip_val": 1.0, "precision": args.precision or "per arm (bf16-mixed, 16-mixed with a loss "
            "scaler, 32-true)", "monitors": f"outlier, homogeneity, attention ({ATTENTION_QUERIES} queries) every "
            f"{args.log_every} steps"}


def progress_note(record: Mapping[str, Any]) -> str:
    skipped = record.get("scaler_skipped")
    share = record.get("max_rms_share")
    return ((f", scaler skipped {skipped}" if skipped is not None else "")
            + (f", max rms_share {share:.3g}" if share is not None else ""))


def _model_arms(arm: str) -> dict[str, Any]:
    norm, precision = split_arm(arm)
    return {"norm": norm, "qk_norm": "none", "precision": precision}


LM_ARMS = tuple(_arm(n, p) for p in ("fp16", "bf16", "fp32") for n in NORMS)
#: the default grid's arms: every norm in fp16 and bf16 (fp16 first: the premise), the fp32 reference for rms and mrs
DEFAULT_ARMS = [*(_arm(n, p) for p in ("fp16", "bf16") for n in NORMS), "rms-fp32", "mrs-fp32"]

#: what the language-model kinds share: data, budget, optimizer, monitors, columns, score, cell and checks
LM_COMMON: dict[str, Any] = dict(
    datasets=LM_DATASETS, default_dataset="stdlib", optimizer="adamw", weight_decay=0.1, warmup_frac=0.0,
    optimizer_text="AdamW betas (0.9, 0.95), decoupled weight decay on weight matrices only (not on norms, biases, "
                   "embeddings), gradient clipping at norm 1 (the LM recipe's)",
    monitors=monitors, measure=measure, metric_columns=METRICS, table=TABLE, table_note=TABLE_NOTE, score=BPB,
    head_columns=HEAD, runner="recipes.sweeps.lm_cell:run_lm_cell", checker="recipes.sweeps.lm_cell:check_lm_cells",
    data_note=data_note,
)

LM = Sweep(
    name="lm", arm_column="arm", flag="--lm-arms", arms=LM_ARMS,
    arms_help="--sweep lm: norm-precision arms (fp32 runs at the smallest and largest lr only)",
    grid={"arms": DEFAULT_ARMS, "lrs": [0.001, 0.01, 0.1, 1.0], "batch_sizes": [16], "seeds": [0, 1, 2]},
    quick={"lrs": [0.01, 1.0], "seeds": [0], "max_steps": {"stdlib": 40, "text": 40}},
    help="lm: the body norms of a byte-level Llama in bf16 and fp16 mixed precision",
    model_arms=_model_arms, claims=claims, rule=RULE, figure=figure, title="Language-model norm stress sweep",
    arm_label="norm and precision", plotted="the final val bpb and RMSNorm's largest-channel share per precision",
    cell_prefix="lm-", out_stem="stress_lm", extra_settings=extra_settings, progress_note=progress_note, keep=keep,
    **LM_COMMON,
)
