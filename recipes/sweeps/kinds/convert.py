"""The ``convert`` sweep: what swapping a trained model's RMSNorms for MRSNorm costs, and how fast it heals.

A base model is trained once with its own RMSNorms (the LM recipe's Llama, 2 layers of width 64,
4 heads of 16, MLP x4, on the ``stdlib`` bytes; cached, :mod:`recipes.sweeps.cells.convert`), or is
the user's checkpoint (``--pretrained DIR``, with its tokenizer). Each arm starts from the same base
weights and trains ``--max-steps`` healing steps with the same optimizer, schedule and data order:

* ``continue``: the base model as it is (the reference every gap is measured against);
* ``mrs-inherit``: ``swap_norms(model, "mrs", init="inherit")`` (each phasor weight the mean of its
  two channels' old weights);
* ``mrs-calibrate``: ``swap_norms(model, "mrs", init="calibrate", calibration=batch)``, the batch one
  of the sweep's batch size drawn from the training split (not the validation windows);
* ``rms``: the control, ``swap_norms(model, "rms")``: LlamaRMSNorm -> lightning-mrs RMSNorm, the same
  maths, so it must cost nothing.

**The seed** drives the base model (its initialisation and training data order: a base model per
seed, so the comparisons over seeds carry the spread between independently trained models), the
calibration batch and the healing data order (the same for every arm of a seed, so the arms of a
seed are paired). With ``--pretrained`` there is one base model: the seed drives the calibration
batch and the healing data order only.

Per cell the val bits per byte right after the swap (step 0) and at :func:`eval_steps` along the
healing (the ``healing`` table: ``healing.csv``, ``healing.png``); ``results.csv`` keeps the step-0,
final and best bpb, the base model's own bpb and the calibration's relative output errors. The
claims (:mod:`recipes.sweeps.claims.convert`) compare each arm with ``continue`` of the same seed.
Needs no torch.
"""

from __future__ import annotations

import os

import argparse
import math
import statistics
from pathlib import Path
from typing import Any, Mapping

from recipes.sweeps import figure as fig
from recipes.sweeps.claims.convert import (ARMS, CONTINUE, MARGIN_BPB, RULE, TEXT, claims, first_within, gaps,
                                           healing_lines)
from recipes.sweeps.kind import Sweep, Table
from recipes.sweeps.kinds.lm import HEAD
from recipes.sweeps.records import Row
from recipes.sweeps.score import BPB

__all__ = ["ARMS", "BASE_LR", "BASE_WARMUP", "CONVERT", "CONVERT_CONFIG", "HEALING", "MARGIN_BPB", "METRICS", "TEXT",
           "eval_steps", "split_arm"]

#: the base model: the LM demo's Llama (recipes/configs/lm_demo.yaml) at 2 layers of width 64 (the CPU's size)
CONVERT_CONFIG = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                  "intermediate_size": 256}
#: the base model's own training: the LM demo's peak lr and warm-up, cosine to 0, AdamW as every LM sweep
BASE_LR, BASE_WARMUP = 3e-3, 0.05
DATASETS: dict[str, dict[str, Any]] = {
    name: {"arch": "llama", "arch_kwargs": CONVERT_CONFIG, "cifar_stem": False, "image_size": None, "augment": False,
           "accelerator": "cpu", "epochs": None, "max_steps": 200, "seq_len": 64, "val_windows": 128,
           "precision": "32-true", "base_steps": 600}
    for name in ("stdlib", "text")
}
#: where along the healing the val bpb is measured, as fractions of the healing steps (step 0: right after the swap)
EVAL_FRACTIONS = (0.0, 1 / 40, 1 / 20, 1 / 10, 1 / 4, 1 / 2, 1.0)
METRICS = ("bpb_step0", "final_bpb", "best_bpb", "base_bpb", "converted", "calib_err_inherit", "calib_err_fitted",
           "base_trained", "base_s")
TABLE = (("step-0 bpb", "bpb_step0"), ("base bpb", "base_bpb"), ("norms swapped", "converted"),
         ("calib. error inherit", "calib_err_inherit"), ("calib. error fitted", "calib_err_fitted"))
TABLE_NOTE = ("step-0 bpb: right after the swap, before any healing step; base bpb: the unswapped base model (the "
              "same for every arm of a seed); norms swapped: layers the swap converted (continue: 0); calib. error: "
              "mrs-calibrate's median over layers of the relative output error ||y - t|| / ||t|| on the calibration "
              "batch with the inherited and with the fitted weights. All mean over seeds.")


def eval_steps(steps: int) -> list[int]:
    """The healing steps at which a cell measures the val bpb: 0 and the :data:`EVAL_FRACTIONS` of ``steps``."""
    return sorted({int(round(f * steps)) for f in EVAL_FRACTIONS})


def split_arm(arm: str) -> tuple[str, str]:
    """An arm's ``(norm, init)``: ``continue`` -> ``("none", "")``, ``mrs-calibrate`` -> ``("mrs", "calibrate")``."""
    if arm == CONTINUE:
        return "none", ""
    norm, _, init = arm.partition("-")
    return norm, init or "inherit"


def factors(values: Mapping[str, Any]) -> dict[str, str]:
    norm, init = split_arm(str(values["arm"]))
    return {"norm": norm, "init": init}


def _no_monitors(args: argparse.Namespace) -> list[Any]:
    return []  # the healing cell measures the val bpb itself


def _no_measure(history: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    return {}, {}


def _no_claims(rows: list[dict[str, Any]]) -> list[Any]:
    return []  # the healing curve's claims are the kind's (recipes/sweeps/claims/convert.py)


def _model_arms(arm: str) -> dict[str, Any]:
    norm, init = split_arm(arm)
    return {"norm": norm, "init": init}


COLOURS = {CONTINUE: "tab:gray", "mrs-inherit": "tab:green", "mrs-calibrate": "tab:purple", "rms": "tab:orange"}


def _arms(present: set[str]) -> list[str]:
    return [a for a in ARMS if a in present] + sorted(present - set(ARMS))


def figure(rows: list[Row], path: Path) -> Any:
    """The bpb each arm loses against ``continue`` of the same seed, right after the swap and after the healing:
    one dot per seed, a bar at the mean. Returns the panel."""
    plt = fig.pyplot()
    figure_, ax = plt.subplots(figsize=(6.0, 4.2), constrained_layout=True)
    arms = [a for a in _arms({r.arm for r in rows}) if a != CONTINUE]
    steps = max((r.steps or 0 for r in rows), default=0)
    for i, arm in enumerate(arms):
        for j, (label, get, marker) in enumerate((("step 0", lambda r: r.metrics.get("bpb_step0"), "o"),
                                                  (f"after {steps} steps", BPB.counted, "s"))):
            values = [v for _, v in gaps(rows, arm, get)]
            x = i + (j - 0.5) * 0.3
            if values:
                ax.bar(x, statistics.fmean(values), width=0.28, color=COLOURS.get(arm), alpha=0.35 if j else 0.7)
                ax.plot([x] * len(values), values, marker, color="k", ms=4, ls="")
            ax.text(x, 0, label, rotation=90, fontsize=7, ha="center", va="bottom")
    ax.axhline(0, color="k", lw=0.8)
    for y in (-MARGIN_BPB, MARGIN_BPB):
        ax.axhline(y, color="k", ls=":", lw=0.8)
    ax.set_xticks(range(len(arms)), arms)
    ax.set_ylabel("val bpb minus continue's (same seed)")
    ax.grid(alpha=0.3, axis="y")
    seeds = sorted({r.seed for r in rows})
    fig.save(plt, figure_, [], [], f"Conversion cost: bpb lost against the unswapped model, {len(seeds)} seed(s) "
             f"(dots), bar = mean; dotted: +-{MARGIN_BPB:g} bpb", path, diverged=False)
    return ax


def healing_figure(rows: list[dict[str, Any]], path: Path) -> Any:
    """Val bpb against the healing steps per arm (left) and its gap to ``continue`` of the same seed (right):
    mean over seeds, band min-max; steps on a symlog axis (step 0 shown). Returns the two panels."""
    plt = fig.pyplot()
    figure_, (left, right) = plt.subplots(1, 2, figsize=(10.0, 4.2), constrained_layout=True)
    arms = _arms({str(r["arm"]) for r in rows})
    curves = {a: {} for a in arms}  # arm -> step -> seed -> bpb
    for r in rows:
        curves[str(r["arm"])].setdefault(int(r["step"]), {})[int(r["seed"])] = float(r["val_bpb"])
    for arm in arms:
        for ax, ref in ((left, None), (right, curves.get(CONTINUE, {}))):
            xs, mean, low, high = [], [], [], []
            for step, by_seed in sorted(curves[arm].items()):
                values = [v - ref[step][s] if ref is not None else v for s, v in by_seed.items()
                          if ref is None or s in ref.get(step, {})]
                values = [v for v in values if math.isfinite(v)]
                if values:
                    xs.append(step)
                    mean.append(statistics.fmean(values))
                    low.append(min(values))
                    high.append(max(values))
            ax.plot(xs, mean, "-o", color=COLOURS.get(arm), ms=3.5, lw=1.6, label=arm if ref is None else None)
            ax.fill_between(xs, low, high, color=COLOURS.get(arm), alpha=0.18, lw=0)
    right.axhline(MARGIN_BPB, color="k", ls=":", lw=1)
    right.axhline(0, color="k", lw=0.8)
    left.set_ylabel("validation bits per byte")
    right.set_ylabel("val bpb minus continue's (same seed)")
    right.set_yscale("symlog", linthresh=MARGIN_BPB)
    first = min((int(r["step"]) for r in rows if int(r["step"]) > 0), default=1)
    for ax in (left, right):
        ax.set_xscale("symlog", linthresh=first)
        ax.set_xlim(left=0)
        ax.set_xlabel("healing step (0: right after the swap)")
        ax.grid(alpha=0.3)
    handles, labels = left.get_legend_handles_labels()
    seeds = sorted({int(r["seed"]) for r in rows})
    fig.save(plt, figure_, handles, labels, f"Healing after the swap: mean over {len(seeds)} seed(s), band = min-max; "
             f"dotted: {MARGIN_BPB:g} bpb above continue", path, diverged=False)
    return left, right


HEALING = Table(
    name="healing", columns=("arm", "lr", "batch_size", "seed", "step", "val_bpb"),
    numeric=("lr", "batch_size", "seed", "step", "val_bpb"), title="Healing (val bpb along the healing steps)",
    intro=("Per cell, the val bits per byte on the fixed validation windows right after the swap (step 0) and at "
           "the evaluated healing steps. **Gap**: an arm's bpb minus `continue`'s at the same step and seed (the "
           "same base model and data order). **First within**: per seed, the first evaluated step at which the gap "
           f"is at most {MARGIN_BPB:g} bpb. **95 % within from**: the first evaluated step at which the 95 % t "
           f"interval of the gap over seeds lies entirely below {MARGIN_BPB:g} bpb.",),
    claims=_no_claims, rule=(), figure=healing_figure,
    plotted="the val bpb per arm and its gap to continue against the healing steps", lines=healing_lines,
)


def data_note(data: Mapping[str, Any]) -> str:
    """The Setup's data line: the text, then the base model (one line: a rebuild keeps it)."""
    return f"- {data.get('text', 'data: ?')}" + (f"; base model: {data['base']}" if data.get("base") else "")


def extra_settings(args: argparse.Namespace) -> dict[str, Any]:
    d = args.sweep.datasets[args.dataset]
    pretrained = args.pretrained
    base = (f"--pretrained {pretrained} (its tokenizer; the seed drives the calibration batch and the healing data "
            "order only)" if pretrained else
            f"trained once per seed with its own RMSNorms: {args.base_steps} AdamW steps at peak lr {BASE_LR:g}, "
            f"{100 * BASE_WARMUP:g} % warm-up then cosine, the sweep's batch size and weight decay, cached "
            "(recipes/sweeps/cells/convert.py)")
    model = _pretrained_config(pretrained) if pretrained else {}  # the checkpoint's sizes, not the sweep's defaults
    return {**model, "sweep": args.sweep.name, "seq_len": args.seq_len, "val_windows": d["val_windows"],
            "base_model": base, "eval_steps": eval_steps(args.max_steps), "gradient_clip_val": 1.0,
            "calibration": "one batch (the sweep's batch size) of training windows, drawn with the cell's seed",
            "margin_bpb": MARGIN_BPB, "precision": args.precision or d["precision"]}


def _pretrained_config(path: str) -> dict[str, Any]:
    """``arch`` and ``arch_kwargs`` (the fields of :data:`CONVERT_CONFIG`) as the ``--pretrained`` checkpoint has them."""
    if not os.path.isfile(os.path.join(path, "config.json")):  # a hub name, or a mistake the model's load reports
        return {"arch": f"the --pretrained {path}'s", "arch_kwargs": f"the --pretrained {path}'s config"}
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    return {"arch": config.model_type,
            "arch_kwargs": {key: getattr(config, key) for key in CONVERT_CONFIG if hasattr(config, key)}}


def progress_note(record: Mapping[str, Any]) -> str:
    step0 = record.get("bpb_step0")
    base = (f", base model --pretrained {record['base_pretrained']}" if record.get("base_pretrained") else
            ", base model trained" if record.get("base_trained") else ", base model from the cache")
    return (f", step-0 bpb {step0:.3f}" if isinstance(step0, float) else "") + base


CONVERT = Sweep(
    name="convert", arm_column="arm", flag="--convert-arms", arms=ARMS,
    arms_help="--sweep convert: the swaps of the trained model's RMSNorms, beside the model left as it is and an RMSNorm "
              "control",
    grid={"arms": list(ARMS), "lrs": [1e-3], "batch_sizes": [16], "seeds": [0, 1, 2]},
    quick={"seeds": [0], "max_steps": {"stdlib": 40, "text": 40}},
    datasets=DATASETS, default_dataset="stdlib", optimizer="adamw", weight_decay=0.1, warmup_frac=0.05,
    optimizer_text="AdamW betas (0.9, 0.95), decoupled weight decay on weight matrices only (not on norms, biases, "
                   "embeddings), gradient clipping at norm 1 (the LM recipe's); a fresh optimizer for the healing",
    help="convert: what swapping a trained model's RMSNorms for MRSNorm costs and how fast it heals",
    model_arms=_model_arms, monitors=_no_monitors, measure=_no_measure, metric_columns=METRICS,
    table=TABLE, table_note=TABLE_NOTE, claims=claims, rule=RULE, figure=figure,
    title="Conversion cost: RMSNorm -> MRSNorm on a trained model", arm_label="conversion arm",
    plotted="the bpb each arm loses to the unswapped model (same seed) at step 0 and after the healing",
    against="the arm (a dot per seed)",
    cell_prefix="convert-", out_stem="stress_convert", extra_settings=extra_settings, progress_note=progress_note,
    score=BPB, head_columns=HEAD, runner="recipes.sweeps.cells.convert:run_convert_cell",
    checker="recipes.sweeps.cells.convert:check_convert_cells", data_note=data_note, factor_columns=("norm", "init"),
    factors=factors, tables=(HEALING,), lr_robustness=False,
)
