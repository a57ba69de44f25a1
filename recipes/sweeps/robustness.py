"""Learning-rate robustness of each arm per batch size: ``robustness.csv`` and its ``results.md`` section.

Per arm and batch size, over the swept learning rates ``L`` (accuracy = the final top-1 of
:func:`recipes.sweeps.records.accuracy`, floored at chance):

* **LR sensitivity** (after Wortsman et al. 2023, arXiv 2309.14322, in accuracy terms): per
  seed, ``mean over lr in L of (max over L of acc - acc(lr))``; reported as mean and sd over
  the seeds that have every lr of ``L``. In points of top-1; 0 is a flat curve, lower is more
  robust. A diverged cell counts as chance, so a collapse weighs ``best - chance``.
* **largest lr at 90 %**: the largest lr in ``L`` whose seed-mean accuracy is at least 90 % of
  the best seed-mean accuracy over ``L`` (smaller lrs may fail: the curve is not assumed to be
  monotonic).
* best lr and its seed-mean accuracy.

``L`` is every learning rate of the table; an arm/batch size lacking one of them is marked
incomplete and its LR sensitivity is left empty (it would not be comparable). Needs no torch.

Example:
    >>> from recipes.sweeps.records import Row
    >>> rows = [Row("mrs", lr, 32, 0, num_classes=10, final_top1=acc) for lr, acc in [(0.1, 0.9), (1.0, 0.5)]]
    >>> s = robustness(rows)[0]
    >>> round(s.lr_sensitivity, 3), s.max_lr_90, s.best_lr
    (0.2, 0.1, 0.1)
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Callable, Optional

from recipes.sweeps.records import Row, accuracy, arm_key, chance, csv_table, distinct_lrs, same_lr, select

__all__ = ["COLUMNS", "THRESHOLD", "Robustness", "by_arm", "markdown", "robustness", "robustness_csv"]

#: "still works" = reaches this fraction of the arm's best accuracy
THRESHOLD = 0.9
#: ``robustness.csv``'s columns after the arm's
COLUMNS = ("batch_size", "n_lrs", "lrs", "complete", "seeds", "best_lr", "best_top1", "lr_sensitivity",
           "lr_sensitivity_sd", "max_lr_90", "chance")


@dataclass
class Robustness:
    """The robustness summary of one arm at one batch size (see the module docstring)."""

    arm: str
    batch_size: int
    n_lrs: int
    lrs: str
    complete: bool
    seeds: int
    best_lr: Optional[float]
    best_top1: float
    lr_sensitivity: Optional[float]
    lr_sensitivity_sd: Optional[float]
    max_lr_90: Optional[float]
    chance: float
    per_seed_sensitivity: list[float] = field(default_factory=list)


def _floored(row: Row) -> float:
    acc = accuracy(row)
    return max(acc, chance(row)) if math.isfinite(acc) else math.nan


def _one(rows: list[Row], arm: str, bs: int, lrs: list[float]) -> Robustness:
    mine = select(rows, batch_size=bs, arm=arm)
    by_lr = {lr: [r for r in mine if same_lr(r.lr, lr)] for lr in lrs}
    present = [lr for lr in lrs if by_lr[lr]]
    curve = {lr: statistics.fmean(v) for lr in present
             if (v := [a for a in map(_floored, by_lr[lr]) if math.isfinite(a)])}
    best_lr = max(curve, key=lambda lr: (curve[lr], -lr)) if curve else None  # ties: the smaller lr
    best = curve[best_lr] if best_lr is not None else math.nan
    works = [lr for lr, acc in curve.items() if acc >= THRESHOLD * best]
    complete = len(present) == len(lrs)
    per_seed = []
    if complete:
        for seed in sorted({r.seed for r in mine}):
            accs = [_floored(r) for lr in lrs for r in by_lr[lr] if r.seed == seed]
            if len(accs) == len(lrs) and all(map(math.isfinite, accs)):
                top = max(accs)
                per_seed.append(statistics.fmean(top - a for a in accs))
    return Robustness(
        arm=arm, batch_size=bs, n_lrs=len(present), lrs=" ".join(f"{lr:g}" for lr in present), complete=complete,
        seeds=len(per_seed), best_lr=best_lr, best_top1=best,
        lr_sensitivity=statistics.fmean(per_seed) if per_seed else None,
        lr_sensitivity_sd=statistics.stdev(per_seed) if len(per_seed) > 1 else None,
        max_lr_90=max(works) if works else None, chance=chance(mine[0]) if mine else math.nan,
        per_seed_sensitivity=per_seed,
    )


def robustness(rows: list[Row]) -> list[Robustness]:
    """One summary per (arm, batch size) present in ``rows``, arms in :func:`~recipes.sweeps.records.arm_key` order."""
    lrs = distinct_lrs(rows)
    arms = sorted({r.arm for r in rows}, key=arm_key)
    sizes = sorted({r.batch_size for r in rows})
    return [_one(rows, arm, bs, lrs) for arm in arms for bs in sizes if select(rows, batch_size=bs, arm=arm)]


def robustness_csv(summaries: list[Robustness], arm_column: str) -> str:
    """``robustness.csv``: one row per arm and batch size; the arm under ``arm_column``."""
    return csv_table([arm_column, *COLUMNS], ([s.arm, *(getattr(s, c) for c in COLUMNS)] for s in summaries))


def _pivot(summaries: list[Robustness], cell: Callable[[Robustness], str], arm_column: str) -> list[str]:
    sizes = sorted({s.batch_size for s in summaries})
    arms = list(dict.fromkeys(s.arm for s in summaries))
    lines = [f"| {arm_column} | " + " | ".join(f"batch {b}" for b in sizes) + " |", "|:---|" + "---:|" * len(sizes)]
    for arm in arms:
        found = {s.batch_size: s for s in summaries if s.arm == arm}
        lines.append(f"| {arm} | " + " | ".join(cell(found[b]) if b in found else "-" for b in sizes) + " |")
    return lines


def _sensitivity(s: Robustness) -> str:
    if s.lr_sensitivity is None:
        return "incomplete" if not s.complete else "-"
    sd = f" ± {100 * s.lr_sensitivity_sd:.2f}" if s.lr_sensitivity_sd is not None else ""
    return f"{100 * s.lr_sensitivity:.2f}{sd} (n={s.seeds})"


def _breaking(s: Robustness) -> str:
    if s.max_lr_90 is None or s.best_lr is None:
        return "-"
    return f"{s.max_lr_90:g} ({s.best_lr:g}: {100 * s.best_top1:.1f} %)"


def markdown(summaries: list[Robustness], arm_column: str) -> list[str]:
    """The "Learning-rate robustness" section of ``results.md``."""
    if not summaries:
        return []
    lrs = max((s.lrs for s in summaries), key=len)
    return [
        "## Learning-rate robustness",
        "",
        f"Over the swept learning rates ({lrs}); final top-1 with a diverged cell counted as chance and every "
        "cell floored at chance (`robustness.csv`, from `results.csv` by `recipes/sweeps/robustness.py`).",
        "",
        "**LR sensitivity** (after Wortsman et al. 2023, arXiv 2309.14322, in accuracy terms): per seed, the mean "
        "over the learning rates of (best final top-1 over the learning rates - the cell's final top-1), in points "
        "of top-1; mean ± sd over seeds. Lower is more robust; 0 is a flat curve.",
        "",
        *_pivot(summaries, _sensitivity, arm_column),
        "",
        f"**Largest learning rate still reaching {100 * THRESHOLD:.0f} % of the {arm_column}'s best** seed-mean "
        "top-1 (best lr and best top-1 in brackets):",
        "",
        *_pivot(summaries, _breaking, arm_column),
        "",
    ]


def by_arm(summaries: list[Robustness]) -> dict[tuple[str, int], Robustness]:
    """The summaries keyed by (arm, batch size)."""
    return {(s.arm, s.batch_size): s for s in summaries}


