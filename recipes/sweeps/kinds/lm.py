"""The ``lm`` sweep: the body norms of a small byte-level Llama in mixed and pure half precision, the paper's premise.

Arms: a norm (``rms``, ``mrs``, ``layer``: every body norm of the LM recipe's Llama replaced; the
experimental ``rms-half``/``mrs-half``/``rms-half-safe``/``mrs-half-safe`` of :mod:`lightning_mrs.swap.half`,
computed in the input's dtype) at a precision (``bf16``: bfloat16 autocast; ``fp16``: float16 autocast with a
loss scaler, where the residual stream, hence every norm input, stays float32, so a half norm's input is cast
to float16 there, :mod:`recipes.sweeps.cells.half_inputs`; ``fp16-true``: the model cast to float16, Lightning's
``16-true``; ``fp16-master``: ``16-true`` with AdamW on float32 master weights,
:mod:`recipes.sweeps.cells.master_weights`; ``bf16-master``: the same in ``bf16-true``; ``fp32``: a
reference, run at the smallest and the largest swept learning rates and at the mechanism stress's),
e.g. ``mrs-fp16``, x AdamW learning rate x seed, on the ``stdlib`` bytes. P1t's controls (issue 56): a half
norm with the suffix ``-as-<family>`` starts its gains at that family's output scale
(:mod:`recipes.sweeps.output_scale`, e.g. ``rms-half-safe-as-mrs-fp16-master``), ``dyt`` is Dynamic Tanh and
``derf`` Dynamic erf (issue 64: also ``dyt-bf16``/``derf-bf16``); every
cell records the residual stream's largest ``|x|`` per layer and step (:mod:`recipes.sweeps.cells.residual_trace`)
(:mod:`recipes.sweeps.cells.lm`). ``results.csv`` has the arm's factors as columns (``norm``,
``precision``: Lightning's name). The ``OutlierMonitor`` records the norms' inputs, the
``GradientHomogeneityMonitor`` the phasor gradients, the ``AttentionMonitor`` the attention logits,
:class:`~recipes.sweeps.cells.lm.ScalerLog` the loss scaler. A diverged cell counts as 8 bits per byte
(:data:`~recipes.sweeps.score.DIVERGED_BPB`). The fp32 models at the mechanism stress's lr are also
evaluated in pure float16 with a planted channel (:mod:`recipes.sweeps.claims.mechanism`: ``mechanism.csv``,
claim M).

The statements tested, from the paper's abstract ("in RMSNorm, sum(x^2) lets a single large-magnitude
channel dominate the denominator, which in mixed precision or under extreme optimisation leads to
numerical explosion (NaN), gradient starvation of the low-magnitude channels ..."; MRSNorm's mean
of pair magnitudes is meant to stop that) and ``docs/method.md`` ("The language-model sweeps", the claims table):
**P1** numerical explosion, as shipped (fp16 autocast, every norm computing in float32 inside) and
**P1h** as the paper states it (pure float16, the norms computed in float16), **P1m** the norms computed in
float16 inside 16-mixed, **P1t** in pure float16 with float32 master weights, **P2** outlier dominance,
**P3** gradient starvation, **P4** learning-rate robustness, **P5** half the affine parameters cost
nothing, **M** the mechanism itself. Each is a list of comparisons over seeds, decided and combined by
:func:`recipes.sweeps.claims.engine.evaluate`; the thresholds are module constants fixed before any
sweep ran. Needs no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any, Mapping, Optional

from recipes.sweeps import figure as fig
from recipes.sweeps.kind import History, Measured, Sweep
from recipes.sweeps.claims.lm import (EXTRA_NORMS, HALF_NORMS, POINTWISE_NORMS, HIGH_LR_MIN, LARGE_SHARE, MARGIN_BPB, NAIVE_HALF, NORMS, PRECISIONS,
                                      RULE, SCALE_FLOOR, TEXT, arm_name, claims, split_arm)
from recipes.sweeps.claims.mechanism import CHANNEL, MECHANISM, MECHANISM_LR
from recipes.sweeps.records import Row, distinct_lrs, same_lr, select
from recipes.sweeps.score import BPB, DIVERGED_BPB
from recipes.sweeps.series import extreme, finite_mean, thin

__all__ = ["HALF_NORMS", "HEAD", "HIGH_LR_MIN", "LARGE_SHARE", "LM", "LM_CONFIG", "LM_DATASETS", "MARGIN_BPB", "NORMS",
           "PRECISIONS", "SCALE_FLOOR", "TEXT", "claims", "figure", "measure", "monitors", "split_arm"]

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
#: validations per cell, evenly spaced, the last at the final step (``recipes/sweeps/cells/lm.py``)
VALIDATIONS = 4
#: queries per attention layer whose logits the AttentionMonitor recomputes on a logging step
ATTENTION_QUERIES = 64


def factors(values: Mapping[str, Any]) -> dict[str, str]:
    """The tidy columns of an ``lm`` row: its arm's ``norm`` and ``precision`` (Lightning's name)."""
    norm, precision = split_arm(str(values["arm"]))
    return {"norm": norm, "precision": PRECISIONS.get(precision, precision)}


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
    precisions = [p for p in ("bf16", "fp16", "fp16-true", "fp16-master", "bf16-master", "fp32")
                  if any(split_arm(r.arm)[1] == p for r in rows)]
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
            "max_x2_over_fp16_frac": largest("outlier/all/x2_over_fp16_frac"),
            "mean_grad_cv": finite_mean(history.get("phasor/all/grad_cv", [])),
            "mean_starved_frac": finite_mean(history.get("phasor/all/starved_frac", [])),
            "max_logit": largest("attention/all/logit_max")}, {
        "logit_max": thin(history.get("attention/all/logit_max", [])),
        "absmax": thin(history.get("outlier/all/absmax", []))}


#: the record's columns every language-model kind has, after the shared ones
METRICS = ("final_bpb", "best_bpb", "scaler_skipped", "scaler_final_scale", "max_absmax", "max_rms_share",
           "max_mrs_share", "max_x2_over_fp16_frac", "mean_grad_cv", "mean_starved_frac", "max_logit", "channels")
#: a metric column's old name -> its name now (records written before the rename are read under the new name)
ALIASES = {"max_fp16_overflow_frac": "max_x2_over_fp16_frac"}
TABLE = (("skipped", "scaler_skipped"), ("final scale", "scaler_final_scale"), ("absmax", "max_absmax"),
         ("rms_share", "max_rms_share"), ("mrs_share", "max_mrs_share"), ("x^2 > fp16", "max_x2_over_fp16_frac"),
         ("grad_cv", "mean_grad_cv"), ("starved", "mean_starved_frac"), ("max logit", "max_logit"))
TABLE_NOTE = ("Loss scaler (fp16 only): skipped = optimizer steps it skipped (gradients with Inf/NaN), final scale = "
              "its scale at the end (from 65536). From the OutlierMonitor at the norms' inputs, worst layer, largest "
              "over the logged steps before any divergence: absmax = largest |x|; rms_share = the largest channel's "
              "share of sum x^2 (worst token); mrs_share = the largest phasor's share of the sum of pair magnitudes "
              "(same inputs); x^2 > fp16 = share of inputs with |x| >= 256, whose square would overflow float16 if "
              "formed there (it is not, in the norms computing in float32 inside). grad_cv, starved: the "
              "GradientHomogeneityMonitor's `phasor/all/*`, mean over the logged steps. max logit: the "
              "AttentionMonitor's largest |attention logit| (for this Llama: scale x q.k of the queries and keys as they "
              "leave their projections and QK-norms, before the rotary embedding and the causal mask). All mean over "
              "seeds.")


def data_note(data: Mapping[str, Any]) -> str:
    return f"- {data.get('text', 'data: ?')}"


def keep(cell: tuple[str, float, int, int], args: argparse.Namespace) -> bool:
    """The fp32 reference runs at the smallest and the largest swept lr and at the mechanism stress's only."""
    arm, lr = cell[0], cell[1]
    return split_arm(arm)[1] != "fp32" or any(same_lr(lr, x) for x in (min(args.lrs), max(args.lrs), MECHANISM_LR))


def extra_settings(args: argparse.Namespace) -> dict[str, Any]:
    d = args.sweep.datasets[args.dataset]
    return {"sweep": args.sweep.name, "seq_len": args.seq_len, "val_windows": d["val_windows"],
            "validation": f"{VALIDATIONS} times per cell (every max_steps/4 steps) unless --val-every",
            "gradient_clip_val": 1.0, "precision": args.precision or "per arm (bf16-mixed, 16-mixed with a loss "
            "scaler, 16-true, 32-true)",
            "monitors": f"outlier, homogeneity, attention ({ATTENTION_QUERIES} queries) every {args.log_every} "
                        "steps"} | ({} if args.sweep.name != "lm" else {
                "mechanism": f"the fp32 models at lr {MECHANISM_LR:g} evaluated in pure float16, channel {CHANNEL} "
                             f"planted at 0, 2^4 .. 2^15 before every norm (recipes/sweeps/claims/mechanism.py)"})


def progress_note(record: Mapping[str, Any]) -> str:
    skipped = record.get("scaler_skipped")
    share = record.get("max_rms_share")
    return ((f", scaler skipped {skipped}" if skipped is not None else "")
            + (f", max rms_share {share:.3g}" if share is not None else ""))


def _model_arms(arm: str) -> dict[str, Any]:
    norm, precision = split_arm(arm)
    return {"norm": norm, "qk_norm": "none", "precision": precision}


LM_ARMS = tuple(dict.fromkeys((
    *(arm_name(n, p) for p in ("fp16", "bf16", "fp16-true", "fp16-master", "fp32") for n in NORMS),
    # P1t's rerun (issue 56): the safe pair's output-scale controls and DyT, and all of them in pure bf16
    *(arm_name(n, p) for p in ("fp16-master", "bf16-master") for n in (*HALF_NORMS, *EXTRA_NORMS)),
    # issue 64: DyT and Derf at the standard precision, beside rms/mrs/layer-bf16
    *(arm_name(n, "bf16") for n in POINTWISE_NORMS))))
#: the default grid's arms: every shipped norm in fp16 and bf16 (fp16 first: the premise); the half-precision norms
#: inside fp16 autocast (P1m); in pure fp16 the naive half norms and the shipped rms and mrs beside them (P1h); the
#: four half norms in pure fp16 with float32 master weights (P1t); the fp32 reference for rms and mrs
DEFAULT_ARMS = [*(arm_name(n, p) for p in ("fp16", "bf16") for n in ("rms", "mrs", "layer")),
                *(arm_name(n, "fp16") for n in HALF_NORMS),
                *(arm_name(n, "fp16-true") for n in ("rms", "mrs", *NAIVE_HALF)),
                *(arm_name(n, "fp16-master") for n in HALF_NORMS), "rms-fp32", "mrs-fp32"]

#: what the language-model kinds share: data, budget, optimizer, monitors, columns, score, cell and checks
LM_COMMON: dict[str, Any] = dict(
    datasets=LM_DATASETS, default_dataset="stdlib", optimizer="adamw", weight_decay=0.1, warmup_frac=0.0,
    optimizer_text="AdamW betas (0.9, 0.95), decoupled weight decay on weight matrices only (not on norms, biases, "
                   "embeddings), gradient clipping at norm 1 (the LM recipe's)",
    monitors=monitors, measure=measure, metric_columns=METRICS, table=TABLE, table_note=TABLE_NOTE, score=BPB,
    head_columns=HEAD, runner="recipes.sweeps.cells.lm:run_lm_cell", checker="recipes.sweeps.cells.lm:check_lm_cells",
    data_note=data_note, aliases=ALIASES,
)

LM = Sweep(
    name="lm", arm_column="arm", flag="--lm-arms", arms=LM_ARMS,
    arms_help=f"--sweep lm: norm-precision arms (fp32 runs at the smallest and largest lr and at {MECHANISM_LR:g} "
              "only)",
    # 10 seeds: with 3, a comparison's verdict moved on a rerun on another CPU (issue 30); the report checks it
    grid={"arms": DEFAULT_ARMS, "lrs": [0.001, 0.01, 0.1, 1.0], "batch_sizes": [16], "seeds": list(range(10))},
    quick={"lrs": [0.01, 1.0], "seeds": [0], "max_steps": {"stdlib": 40, "text": 40}},
    help="lm: the body norms of a byte-level Llama in bf16 and fp16 mixed and pure fp16 precision",
    model_arms=_model_arms, claims=claims, rule=RULE, figure=figure, title="Language-model norm stress sweep",
    arm_label="norm and precision", plotted="the final val bpb and RMSNorm's largest-channel share per precision",
    cell_prefix="lm-", out_stem="stress_lm", extra_settings=extra_settings, progress_note=progress_note, keep=keep,
    factor_columns=("norm", "precision"), factors=factors, tables=(MECHANISM,), **LM_COMMON,
)
