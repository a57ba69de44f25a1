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

The same for any :class:`~recipes.sweeps.score.Score`: a language-model sweep's is the final val
bits per byte (lower is better, a diverged cell counted as 8 and every cell capped there): the
sensitivity is the mean of (bpb - the seed's best), "largest lr within 10 %" allows 1.1 x the best
bpb, and ``per_seed_max_lr`` gives that lr per seed.

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

from recipes.sweeps.records import Row, arm_key, csv_table, distinct_lrs, same_lr, select
from recipes.sweeps.score import NEAR_FRACTION, TOP1, Score

__all__ = ["COLUMNS", "THRESHOLD", "Robustness", "by_arm", "columns", "markdown", "robustness", "robustness_csv"]

#: "still works" = reaches this fraction of the arm's best accuracy
THRESHOLD = 1 - NEAR_FRACTION
#: ``robustness.csv``'s columns after the arm's (top-1 sweeps; :func:`columns` for any score)
COLUMNS = ("batch_size", "n_lrs", "lrs", "complete", "seeds", "best_lr", "best_top1", "lr_sensitivity",
           "lr_sensitivity_sd", "max_lr_90", "chance")


def columns(score: Score = TOP1) -> tuple[str, ...]:
    """``robustness.csv``'s columns after the arm's, named for ``score`` (top-1: :data:`COLUMNS`)."""
    if score is TOP1:
        return COLUMNS
    return ("batch_size", "n_lrs", "lrs", "complete", "seeds", "best_lr", f"best_{score.key}", "lr_sensitivity",
            "lr_sensitivity_sd", f"max_lr_within_{100 * NEAR_FRACTION:.0f}pct", "diverged_counts_as")


_FIELDS = {"best_top1": "best", "max_lr_90": "max_lr_near", "chance": "worst"}


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
    best: float
    lr_sensitivity: Optional[float]
    lr_sensitivity_sd: Optional[float]
    max_lr_near: Optional[float]
    worst: float
    per_seed_sensitivity: list[float] = field(default_factory=list)
    #: per seed with every lr: the largest lr whose value is near (see the module docstring) that seed's best
    per_seed_max_lr: list[float] = field(default_factory=list)

    @property
    def best_top1(self) -> float:
        return self.best

    @property
    def max_lr_90(self) -> Optional[float]:
        return self.max_lr_near

    @property
    def chance(self) -> float:
        return self.worst


def _one(rows: list[Row], arm: str, bs: int, lrs: list[float], score: Score) -> Robustness:
    mine = select(rows, batch_size=bs, arm=arm)
    by_lr = {lr: [r for r in mine if same_lr(r.lr, lr)] for lr in lrs}
    present = [lr for lr in lrs if by_lr[lr]]
    curve = {lr: statistics.fmean(v) for lr in present
             if (v := [a for a in map(score.counted, by_lr[lr]) if math.isfinite(a)])}
    best_lr = score.better(curve) if curve else None  # ties: the smaller lr
    best = curve[best_lr] if best_lr is not None else math.nan
    works = [lr for lr, value in curve.items() if score.near(value, best)]
    complete = len(present) == len(lrs)
    per_seed, per_seed_lr = [], []
    if complete:
        for seed in sorted({r.seed for r in mine}):
            values = {lr: score.counted(r) for lr in lrs for r in by_lr[lr] if r.seed == seed}
            if len(values) == len(lrs) and all(map(math.isfinite, values.values())):
                top = values[score.better(values)]
                per_seed.append(statistics.fmean(score.gap(top, v) for v in values.values()))
                per_seed_lr.append(max(lr for lr, v in values.items() if score.near(v, top)))
    return Robustness(
        arm=arm, batch_size=bs, n_lrs=len(present), lrs=" ".join(f"{lr:g}" for lr in present), complete=complete,
        seeds=len(per_seed), best_lr=best_lr, best=best,
        lr_sensitivity=statistics.fmean(per_seed) if per_seed else None,
        lr_sensitivity_sd=statistics.stdev(per_seed) if len(per_seed) > 1 else None,
        max_lr_near=max(works) if works else None, worst=score.worst(mine[0]) if mine else math.nan,
        per_seed_sensitivity=per_seed, per_seed_max_lr=per_seed_lr,
    )


def robustness(rows: list[Row], score: Score = TOP1) -> list[Robustness]:
    """One summary per (arm, batch size) present in ``rows``, arms in :func:`~recipes.sweeps.records.arm_key` order."""
    lrs = distinct_lrs(rows)
    arms = sorted({r.arm for r in rows}, key=arm_key)
    sizes = sorted({r.batch_size for r in rows})
    return [_one(rows, arm, bs, lrs, score) for arm in arms for bs in sizes if select(rows, batch_size=bs, arm=arm)]


def robustness_csv(summaries: list[Robustness], arm_column: str, score: Score = TOP1) -> str:
    """``robustness.csv``: one row per arm and batch size; the arm under ``arm_column``."""
    names = [_FIELDS.get(c, c) for c in COLUMNS]
    return csv_table([arm_column, *columns(score)], ([s.arm, *(getattr(s, c) for c in names)] for s in summaries))


def _pivot(summaries: list[Robustness], cell: Callable[[Robustness], str], arm_column: str) -> list[str]:
    sizes = sorted({s.batch_size for s in summaries})
    arms = list(dict.fromkeys(s.arm for s in summaries))
    lines = [f"| {arm_column} | " + " | ".join(f"batch {b}" for b in sizes) + " |", "|:---|" + "---:|" * len(sizes)]
    for arm in arms:
        found = {s.batch_size: s for s in summaries if s.arm == arm}
        lines.append(f"| {arm} | " + " | ".join(cell(found[b]) if b in found else "-" for b in sizes) + " |")
    return lines


def _sensitivity(s: Robustness, score: Score) -> str:
    if s.lr_sensitivity is None:
        return "incomplete" if not s.complete else "-"
    sd = f" ± {score.show(s.lr_sensitivity_sd)}" if s.lr_sensitivity_sd is not None else ""
    return f"{score.show(s.lr_sensitivity)}{sd} (n={s.seeds})"


def _breaking(s: Robustness, score: Score) -> str:
    if s.max_lr_near is None or s.best_lr is None:
        return "-"
    best = f"{100 * s.best:.1f} %" if score is TOP1 else f"{score.show(s.best)}{score.unit}"
    return f"{s.max_lr_near:g} ({s.best_lr:g}: {best})"


def markdown(summaries: list[Robustness], arm_column: str, score: Score = TOP1) -> list[str]:
    """The "Learning-rate robustness" section of ``results.md``."""
    if not summaries:
        return []
    lrs = max((s.lrs for s in summaries), key=len)
    if score is TOP1:
        counted = "final top-1 with a diverged cell counted as chance and every cell floored at chance"
        terms, points = "in accuracy terms", "in points of top-1"
        gap = "best final top-1 over the learning rates - the cell's final top-1"
    else:
        counted = f"final {score.label}, {score.diverged_text}"
        terms, points = f"on the final {score.label}", f"in{score.unit}"
        gap = f"the cell's final {score.label} - the best over the learning rates"
    return [
        "## Learning-rate robustness",
        "",
        f"Over the swept learning rates ({lrs}); {counted} (`robustness.csv`, from `results.csv` by "
        "`recipes/sweeps/robustness.py`).",
        "",
        f"**LR sensitivity** (after Wortsman et al. 2023, arXiv 2309.14322, {terms}): per seed, the mean "
        f"over the learning rates of ({gap}), {points}; mean ± sd over seeds. Lower is more robust; 0 is a flat curve.",
        "",
        *_pivot(summaries, lambda s: _sensitivity(s, score), arm_column),
        "",
        f"**Largest learning rate {score.near_text} the {arm_column}'s best** seed-mean "
        f"{'top-1' if score is TOP1 else score.label} (best lr and best {'top-1' if score is TOP1 else score.label} "
        "in brackets):",
        "",
        *_pivot(summaries, lambda s: _breaking(s, score), arm_column),
        "",
    ]


def by_arm(summaries: list[Robustness]) -> dict[tuple[str, int], Robustness]:
    """The summaries keyed by (arm, batch size)."""
    return {(s.arm, s.batch_size): s for s in summaries}


