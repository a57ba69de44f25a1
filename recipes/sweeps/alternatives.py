"""Issue 64's pre-registered comparison: MRSNorm against LayerNorm, RMSNorm, DyT and Derf, from a ``results.csv``.

The rule is ``docs/results.md`` ("Norm-free alternatives (issue 64): the rule, fixed before the run"), committed
before any of its cells ran; this module applies it as written to the rows of one sweep (the ``norm`` sweep's
ResNet, the ``norm-vit`` digits ViT, or the ``lm`` sweep's bf16 arms):

    python -m recipes.sweeps.alternatives runs/stress_digits/results.csv                        # final top-1
    python -m recipes.sweeps.alternatives runs/stress_lm_stdlib/results.csv --metric final_bpb --precision bf16-mixed

Per arm: its best lr (the best mean over seeds of the final metric; ties: the smaller lr), the per-seed final
metric there with Student's t 95 % interval, and the per-seed LR sensitivity (Wortsman et al. 2023: the mean over
the lrs of the gap to the seed's best) with its interval. Three questions, each a Welch 95 % interval of a
difference of best final metrics (each arm at its own best lr), signed so that positive is better, against the
margin :data:`MARGINS`. Needs no torch.
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict
from dataclasses import dataclass
from typing import Optional, Sequence

from recipes.sweeps.claims.stats import mean_interval, welch_interval
from recipes.sweeps.score import DIVERGED_BPB

__all__ = ["ARMS", "MARGINS", "MIN_SEEDS", "Arm", "Question", "arm_summary", "compare", "main", "render", "verdicts"]

#: the five arms, in table order
ARMS = ("layer", "rms", "mrs", "dyt", "derf")
#: at least this many seeds per cell (the rule)
MIN_SEEDS = 5
#: the margin delta per metric: 1 point of top-1 (the norm sweep's MARGIN), 0.03 bits per byte (the lm sweep's
#: MARGIN_BPB), fixed with the rule
MARGINS = {"final_top1": 0.01, "final_bpb": 0.03}
#: whether a larger value is better
HIGHER = {"final_top1": True, "final_bpb": False}


@dataclass(frozen=True)
class Arm:
    """One arm: its best lr, the per-seed final metric there and the per-seed LR sensitivity."""

    name: str
    best_lr: float
    best: list[float]  # per seed, at best_lr
    sensitivity: list[float]  # per seed, over every lr (>= 0; in the metric's units)
    lrs: int


@dataclass(frozen=True)
class Question:
    """One of the three questions: a difference (positive: the first arm better), its interval and the verdict."""

    key: str
    label: str
    difference: float
    low: float
    high: float
    verdict: str


def _value(row: dict[str, str], metric: str) -> float:
    if metric == "final_bpb" and str(row.get("diverged", "")).lower() in ("true", "1"):
        return DIVERGED_BPB  # a diverged language model counts as 8 bits per byte, as in the lm sweep
    return float(row[metric])


def arm_summary(rows: Sequence[dict[str, str]], arm: str, metric: str, arm_column: str = "norm") -> Optional[Arm]:
    """``arm``'s :class:`Arm` from the rows, ``None`` when it has no rows."""
    sign = 1.0 if HIGHER[metric] else -1.0
    cells: dict[float, dict[int, float]] = defaultdict(dict)
    for row in rows:
        if row[arm_column] == arm:
            cells[float(row["lr"])][int(float(row["seed"]))] = sign * _value(row, metric)
    if not cells:
        return None
    lrs = sorted(cells)
    best_lr = max(lrs, key=lambda lr: (sum(cells[lr].values()) / len(cells[lr]), -lr))  # ties: the smaller lr
    seeds = sorted(set.intersection(*(set(c) for c in cells.values())))  # seeds run at every lr
    sensitivity = [sum(max(cells[lr][s] for lr in lrs) - cells[lr][s] for lr in lrs) / len(lrs) for s in seeds]
    return Arm(arm, best_lr, [sign * v for v in cells[best_lr].values()], sensitivity, len(lrs))


def compare(a: Arm, b: Arm, metric: str) -> tuple[float, float, float]:
    """``best(a) - best(b)``, signed so that positive means ``a`` is better, with Welch's 95 % interval."""
    sign = 1.0 if HIGHER[metric] else -1.0
    i = welch_interval([sign * v for v in a.best], [sign * v for v in b.best])
    return i.estimate, i.low, i.high


def verdicts(rows: Sequence[dict[str, str]], metric: str, arm_column: str = "norm") -> tuple[dict[str, Arm], list[Question]]:
    """The rule on ``rows``: every arm's summary and the three questions' verdicts.

    Raises:
        ValueError: an arm is missing or has fewer than :data:`MIN_SEEDS` seeds at its best lr.
    """
    delta = MARGINS[metric]
    arms = {}
    for name in ARMS:
        arm = arm_summary(rows, name, metric, arm_column)
        if arm is None or len(arm.best) < MIN_SEEDS:
            raise ValueError(f"arm {name!r}: {0 if arm is None else len(arm.best)} seed(s) at its best lr; the rule "
                             f"needs all of {list(ARMS)} with at least {MIN_SEEDS} seeds")
        arms[name] = arm
    d, lo, hi = compare(arms["dyt"], arms["layer"], metric)
    q1 = "yes: DyT matches LayerNorm (non-inferior within the margin)" if lo > -delta else (
        "no: DyT is worse than LayerNorm by more than the margin" if hi < -delta else "inconclusive")
    d2, lo2, hi2 = compare(arms["derf"], arms["dyt"], metric)
    q2 = "yes: Derf beats DyT" if lo2 > 0 else "no: DyT beats Derf" if hi2 < 0 else (
        "no: a tie within the margin" if lo2 > -delta and hi2 < delta else "inconclusive")
    others = [arms[n] for n in ARMS if n != "mrs"]
    best_other = max(others, key=lambda a: (1 if HIGHER[metric] else -1) * sum(a.best) / len(a.best))
    d3, lo3, hi3 = compare(arms["mrs"], best_other, metric)
    if lo3 > 0:
        q3 = f"better than the best other ({best_other.name})"
    elif lo3 > -delta:
        q3 = f"within the margin of the best other ({best_other.name}): not worse by more than it"
    elif hi3 < -delta:
        q3 = f"worse than the best other ({best_other.name}) by more than the margin"
    elif hi3 < 0:
        q3 = f"worse than the best other ({best_other.name})"
    else:
        q3 = f"inconclusive against the best other ({best_other.name})"
    return arms, [Question("1", "DyT - LayerNorm", d, lo, hi, q1), Question("2", "Derf - DyT", d2, lo2, hi2, q2),
                  Question("3", f"MRSNorm - {best_other.name} (the best of the four others)", d3, lo3, hi3, q3)]


def _interval(values: list[float]) -> str:
    i = mean_interval(values)
    return f"{i.estimate:.4g} [{i.low:.4g}, {i.high:.4g}]"


def render(arms: dict[str, Arm], questions: list[Question], metric: str) -> str:
    """The rule's tables and verdicts as markdown."""
    lines = [f"| arm | best lr | {metric} at it, mean [95 %] | seeds | LR sensitivity, mean [95 %] |",
             "|:---|---:|:---|---:|:---|"]
    for a in arms.values():
        lines.append(f"| `{a.name}` | {a.best_lr:g} | {_interval(a.best)} | {len(a.best)} | "
                     f"{_interval(a.sensitivity)} ({a.lrs} lrs) |")
    lines += ["", f"Differences of the best {metric} (positive: the first arm better), Welch 95 %, margin "
                  f"{MARGINS[metric]:g}:", ""]
    lines += [f"{q.key}. {q.label}: {q.difference:+.4g} [{q.low:+.4g}, {q.high:+.4g}]: **{q.verdict}**"
              for q in questions]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m recipes.sweeps.alternatives", description=__doc__.split("\n\n")[0])
    p.add_argument("csv", help="a sweep's results.csv")
    p.add_argument("--metric", choices=list(MARGINS), default="final_top1")
    p.add_argument("--precision", help="only the rows of this precision column value (the lm sweep: bf16-mixed)")
    args = p.parse_args(argv)
    with open(args.csv, newline="") as f:
        rows = [r for r in csv.DictReader(f) if args.precision is None or r.get("precision") == args.precision]
    try:
        arms, questions = verdicts(rows, args.metric)
    except ValueError as err:
        p.error(str(err))
    print(render(arms, questions, args.metric), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
