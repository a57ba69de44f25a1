"""The ``norm`` sweep (the default, the paper's): the body norm of a ResNet, its claims and its figure.

Arms: ``layer``, ``rms``, ``mrs`` (every norm layer of the model replaced) and ``batch`` (the
model's own BatchNorm, a reference) x learning rate x batch size x seed; SGD with momentum; the
``GradientHomogeneityMonitor`` measures ``mean_grad_cv`` and ``mean_starved_frac``.

The claims are those of ``docs/method.md`` ("The paper's experiments") plus the mechanism claim,
each a list of comparisons over seeds (:mod:`recipes.sweeps.claims.engine`). Their operational
definitions (thresholds, the cells each claim rests on) are module constants, fixed before any
sweep ran, and written into the report with their reasons. Needs no torch.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any, Optional

from recipes.sweeps import figure as fig
from recipes.sweeps.claims.engine import Claim, Comparison, arm_values, ratio, single, unmeasurable, welch_comparison
from recipes.sweeps.claims.markdown import DECISION_RULE
from recipes.sweeps.claims.stats import MIN_SEEDS
from recipes.sweeps.kind import History, Measured, Sweep
from recipes.sweeps.records import Row, accuracy, distinct_lrs, survived
from recipes.sweeps.robustness import robustness
from recipes.sweeps.series import finite_mean

__all__ = ["BASELINES", "COLLAPSE_FRACTION", "CONVERGE_FRACTION", "IMMEDIATE_FRACTION", "MARGIN", "NORM",
           "PAPER_BATCH_SIZES", "PAPER_LRS", "TEXT", "claims", "figure"]

PAPER_LRS = (0.1, 0.3, 0.4)
PAPER_BATCH_SIZES = (32, 64, 128)
BASELINES = ("layer", "rms")
#: "matches" / "costs no accuracy": MRSNorm at most this much top-1 (absolute) below
MARGIN = 0.01
#: "collapse": final top-1 below chance + this fraction of the way from chance to 100 %
COLLAPSE_FRACTION = 0.10
#: "immediate divergence": a non-finite loss within this fraction of the planned steps
IMMEDIATE_FRACTION = 0.10
#: "converges" at lr 0.4: at least this fraction of the same norm's top-1 at lr 0.1
CONVERGE_FRACTION = 0.90

_D = f"{100 * MARGIN:g} point"
_F = f"{CONVERGE_FRACTION:g}"
_I = f"{100 * IMMEDIATE_FRACTION:g} %"

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
          f"{100 * COLLAPSE_FRACTION:g} % of (100 % - chance), i.e. 'near zero' measured from what guessing "
          "gives, on any number of classes. 'Stable gradient flow' is read as 'keeps training' here; the "
          "gradient statistics themselves are the mechanism claim."),
    "3": ("lr 0.4: only MRSNorm avoids immediate divergence; it converges at batch 128 and struggles at batch 32",
          "lr = 0.4: MRSNorm is the only method that avoids immediate divergence, and converges at batch 128 "
          "(it struggles at batch 32).",
          f"At lr 0.4. Immediate divergence: a non-finite training loss within the first {_I} of the planned "
          "optimizer steps (a run whose loss stays finite while its accuracy falls to chance has not diverged "
          "in this sense; claim 2 covers such collapse). Per seed the share of the planned steps reached before "
          f"the first non-finite loss (1 when none), t interval above {IMMEDIATE_FRACTION:g} for MRSNorm and below "
          "it for LayerNorm and RMSNorm, at each batch size ('the only method' among the paper's three; the "
          "BatchNorm reference row is not compared). Converges at batch 128: mean final top-1 at lr 0.4 above "
          f"{_F} x its mean at lr 0.1 (Welch interval of the difference with that factor); struggles at batch 32: "
          f"below {_F} x."),
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
          "measured: it is listed and left out of the combination. A missing cell counts as inconclusive."),
}

RULE = (
    "Computed by `recipes/sweeps/kinds/norm.py` from `results.csv`; nothing in this section is written by hand.",
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
)

Groups = list[tuple[str, list[Comparison]]]


def _chance(rows: list[Row]) -> float:
    ks = {r.num_classes for r in rows if r.num_classes}
    return 1.0 / ks.pop() if len(ks) == 1 else math.nan


def collapse_line(rows: list[Row]) -> float:
    """Claim 2's collapse line: chance + :data:`COLLAPSE_FRACTION` of the way to 100 %."""
    c = _chance(rows)
    return c + COLLAPSE_FRACTION * (1 - c)


def _claim1(rows: list[Row]) -> Groups:
    acc = lambda n, bs: (n, arm_values(rows, n, 0.1, bs, accuracy))  # noqa: E731
    matches = [welch_comparison(f"batch {bs}: mrs - {b}", acc("mrs", bs), acc(b, bs), "above", -MARGIN)
               for bs in PAPER_BATCH_SIZES for b in BASELINES]
    stable = [ratio("batch 32: var(rms) / var(mrs)", acc("rms", 32), acc("mrs", 32))]
    return [("matches or beats (final top-1 at lr 0.1)", matches),
            ("steadier than RMSNorm at batch 32 (variance of final top-1 over seeds)", stable)]


def _claim2(rows: list[Row]) -> Groups:
    line = collapse_line(rows)
    acc = lambda n, lr, bs: (n, arm_values(rows, n, lr, bs, accuracy))  # noqa: E731
    high = [(lr, bs) for lr in PAPER_LRS if lr >= 0.3 for bs in PAPER_BATCH_SIZES]
    collapse = [single(f"lr {lr:g}, batch {bs}: {b}", acc(b, lr, bs), "below", line, "%")
                for lr, bs in high for b in BASELINES]
    trains = [single(f"lr {lr:g}, batch {bs}: mrs", acc("mrs", lr, bs), "above", line, "%") for lr, bs in high]
    return [(f"LayerNorm and RMSNorm collapse (final top-1 below {100 * line:.1f} %)", collapse),
            (f"MRSNorm keeps training (final top-1 above {100 * line:.1f} %)", trains)]


def _claim3(rows: list[Row]) -> Groups:
    surv = lambda n, bs: (n, arm_values(rows, n, 0.4, bs, survived))  # noqa: E731
    acc = lambda n, lr, bs: (f"{n} @ lr {lr:g}", arm_values(rows, n, lr, bs, accuracy))  # noqa: E731
    avoids = [single(f"batch {bs}: mrs", surv("mrs", bs), "above", IMMEDIATE_FRACTION, "") for bs in PAPER_BATCH_SIZES]
    others = [single(f"batch {bs}: {b}", surv(b, bs), "below", IMMEDIATE_FRACTION, "")
              for bs in PAPER_BATCH_SIZES for b in BASELINES]
    f = CONVERGE_FRACTION
    converges = [welch_comparison("batch 128: mrs@0.4 - 0.9 x mrs@0.1", acc("mrs", 0.4, 128), acc("mrs", 0.1, 128),
                                  "above", 0.0, scale=f)]
    struggles = [welch_comparison("batch 32: mrs@0.4 - 0.9 x mrs@0.1", acc("mrs", 0.4, 32), acc("mrs", 0.1, 32),
                                  "below", 0.0, scale=f)]
    share = f"{100 * IMMEDIATE_FRACTION:.0f} %"
    return [(f"MRSNorm avoids immediate divergence (share of the planned steps before a non-finite loss > {share})",
             avoids),
            (f"LayerNorm and RMSNorm diverge immediately (that share < {share})", others),
            (f"MRSNorm converges at batch 128 (final top-1 >= {f:g} x its top-1 at lr 0.1)", converges),
            (f"MRSNorm struggles at batch 32 (final top-1 < {f:g} x its top-1 at lr 0.1)", struggles)]


def _claim4(rows: list[Row]) -> Groups:
    # each norm at the learning rate of the robustness table's best seed-mean top-1 (one definition)
    best = {(s.arm, s.batch_size): s.best_lr for s in robustness(rows)}
    parts = []
    for bs in PAPER_BATCH_SIZES:
        arms = []
        for n in ("mrs", "rms"):
            lr = best.get((n, bs))
            if lr is not None:
                arms.append((f"{n} @ lr {lr:g}", arm_values(rows, n, lr, bs, accuracy)))
            elif not any(r.arm == n for r in rows):
                arms.append((n, ([], f"{n} was not in this sweep")))
            else:
                arms.append((n, ([], f"missing cells: {n} at batch {bs}")))
        parts.append(welch_comparison(f"batch {bs}: mrs - rms, each at its best lr", arms[0], arms[1], "above",
                                      -MARGIN))
    return [("no accuracy cost against RMSNorm (final top-1 at each norm's best swept lr)", parts)]


def _mechanism(rows: list[Row]) -> Groups:
    line = collapse_line(rows)

    def grad_cv(r: Row) -> Optional[float]:
        # a diverged or collapsed run's gradients can vanish: its grad_cv (0 for all-zero
        # gradients, by the monitor's 0/0 convention) says nothing about a norm in training
        return r.metrics.get("mean_grad_cv") if accuracy(r) > line else None

    parts = []
    for lr in PAPER_LRS:
        for bs in PAPER_BATCH_SIZES:
            for b in BASELINES:
                a, base = ("mrs", arm_values(rows, "mrs", lr, bs, grad_cv)), (b, arm_values(rows, b, lr, bs, grad_cv))
                parts.append(welch_comparison(f"lr {lr:g}, batch {bs}: mrs - {b}", a, base, "below", 0.0, unit="",
                                              optional=unmeasurable(a, base)))
    return [("mean grad_cv lower under MRSNorm (same lr and batch size, seeds that trained)", parts)]


def claims(rows: list[Row]) -> list[Claim]:
    """The five claims over typed ``results.csv`` rows, not yet evaluated."""
    builders = {"1": _claim1, "2": _claim2, "3": _claim3, "4": _claim4, "M": _mechanism}
    return [Claim(key, *TEXT[key], groups=build(rows)) for key, build in builders.items()]


_PAPER_SPAN = (0.1, 0.4)
_PAPER_COLOUR = "#fdf1c7"  # a pale yellow: apart from the grey of the BatchNorm reference


def figure(rows: list[Row], path: Path) -> Any:
    """Final top-1 against lr, one panel per batch size (grey span: the paper's lrs), into ``path``.

    Returns the panels (matplotlib axes, one row), closed but readable.
    """
    plt = fig.pyplot()
    sizes = sorted({r.batch_size for r in rows})
    all_lrs = distinct_lrs(rows)
    seeds = sorted({r.seed for r in rows})
    figure_, axes = plt.subplots(1, len(sizes), figsize=(0.8 + 3.9 * len(sizes), 3.9), sharey=True, squeeze=False,
                                 constrained_layout=True)
    for ax, bs in zip(axes[0], sizes):
        ax.axvspan(*_PAPER_SPAN, color=_PAPER_COLOUR, zorder=0)
        fig.lines(ax, rows, bs, accuracy, scale=100)
        fig.chance_line(ax, rows, all_lrs)
        fig.lr_axis(ax, all_lrs)
        ax.set_title(f"batch {bs}")
    axes[0][0].set_ylabel("final validation top-1 (%)")
    axes[0][0].set_ylim(bottom=0, top=100)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.save(plt, figure_, [*handles, plt.Rectangle((0, 0), 1, 1, color=_PAPER_COLOUR)], [*labels, "paper's lrs"],
             f"Final top-1 vs learning rate: mean over {len(seeds)} seed(s), band = min-max; a diverged seed = chance",
             path)
    return axes


def _model_arms(arm: str) -> dict[str, Any]:
    return {"norm": arm}


def monitors(args: argparse.Namespace) -> list[Any]:
    """The GradientHomogeneityMonitor (a cell that diverges keeps logging: ``on_nonfinite="ignore"``)."""
    from lightning_mrs.callbacks import GradientHomogeneityMonitor

    return [GradientHomogeneityMonitor(log_every_n_steps=args.log_every, on_nonfinite="ignore")]


def measure(history: History) -> Measured:
    """The monitor's ``phasor/all/grad_cv`` and ``starved_frac``, mean over the logged steps."""
    return {"mean_grad_cv": finite_mean(history.get("phasor/all/grad_cv", [])),
            "mean_starved_frac": finite_mean(history.get("phasor/all/starved_frac", []))}, {}


_NARROW_RESNET = {"layers": [1, 1, 1, 1], "channels": [8, 16, 32, 64], "stem_width": 8}
_SYNTHETIC_RESNET = {"layers": [1, 1, 1, 1], "channels": [32, 48, 64, 96], "stem_width": 32}

NORM = Sweep(
    name="norm", arm_column="norm", flag="--norms", arms=("layer", "rms", "mrs", "batch", "dyt", "derf"),
    arms_help="--sweep norm: norms to compare; batch keeps the model's BatchNorm; dyt, derf: norm-free (not in "
              "the default grid)",
    # the paper's lrs (0.1, 0.3, 0.4) inside a log-spaced axis from 0.03 to 3
    grid={"arms": ["layer", "rms", "mrs", "batch"], "lrs": [0.03, 0.1, 0.3, 0.4, 1.0, 3.0],
          "batch_sizes": [32, 64, 128], "seeds": [0, 1, 2]},
    quick={"lrs": [0.1, 0.4, 3.0], "batch_sizes": [32, 128], "seeds": [0], "epochs": {"digits": 5}},
    datasets={
        # the 8x8 scans at their own size; a 4-block ResNet of 8-64 channels; no augmentation: 10
        # epochs bring every norm above 93 % at lr 0.1 and batch 128, and a cell costs seconds
        "digits": {"arch": "timm:resnet18", "arch_kwargs": _NARROW_RESNET, "cifar_stem": True, "image_size": 8,
                   "augment": False, "epochs": 10, "accelerator": "cpu"},
        "cifar100": {"arch": "resnet18", "arch_kwargs": None, "cifar_stem": True, "image_size": 32, "augment": True,
                     "epochs": None, "accelerator": "auto"},
        "folder": {"arch": "resnet18", "arch_kwargs": None, "cifar_stem": True, "image_size": 32, "augment": True,
                   "epochs": None, "accelerator": "auto"},
        "synthetic": {"arch": "timm:resnet18", "arch_kwargs": _SYNTHETIC_RESNET, "cifar_stem": False,
                      "image_size": 32, "augment": True, "epochs": None, "accelerator": "auto"},
    },
    optimizer="sgd", weight_decay=5e-4, warmup_frac=0.0,
    optimizer_text="SGD momentum 0.9 nesterov, weight decay on every parameter",
    help="norm: the paper's sweep of a ResNet's body norms",
    model_arms=_model_arms, monitors=monitors, measure=measure,
    metric_columns=("mean_grad_cv", "mean_starved_frac"),
    table=(("mean grad_cv", "mean_grad_cv"), ("mean starved_frac", "mean_starved_frac")),
    table_note="grad_cv and starved_frac: the monitor's `phasor/all/*`, mean over the logged steps (before any "
               "divergence), mean over seeds.",
    claims=claims, rule=RULE, figure=figure,
    title="Stress sweep", arm_label="norm", plotted="final top-1",
)

