"""Issue 64's pre-registered comparison: MRSNorm against LayerNorm, RMSNorm, DyT and Derf, from a ``results.csv``.

The rule is ``docs/results.md`` ("Norm-free alternatives (issue 64): the rule, fixed before the run"), committed
before any of its cells ran; this module applies it as written to the rows of one sweep (the ``norm`` sweep's
ResNet, the ``norm-vit`` digits ViT, or the ``lm`` sweep's bf16 arms):

    python -m recipes.sweeps.alternatives runs/stress_digits/results.csv                        # final top-1
    python -m recipes.sweeps.alternatives runs/stress_lm_stdlib/results.csv --metric final_bpb --precision bf16-mixed
    python -m recipes.sweeps.alternatives --report docs/stress_alternatives     # the committed report, rebuilt

Per arm: its best lr (the best mean over seeds of the final metric; ties: the smaller lr), the per-seed final
metric there with Student's t 95 % interval, and the per-seed LR sensitivity (Wortsman et al. 2023: the mean over
the lrs of the gap to the seed's best) with its interval. Three questions, each a Welch 95 % interval of a
difference of best final metrics (each arm at its own best lr), signed so that positive is better, against the
margin :data:`MARGINS`. Needs no torch.
"""

from __future__ import annotations

import argparse
import csv
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from recipes.sweeps.claims.stats import mean_interval, welch_interval
from recipes.sweeps.score import DIVERGED_BPB

__all__ = ["ARMS", "COMPARISONS", "MARGINS", "MIN_SEEDS", "Arm", "Question", "arm_summary", "compare", "held_out", "main",
           "render", "report", "verdicts"]

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


def _best_other(arms: dict[str, Arm], metric: str) -> Arm:
    """The arm other than ``mrs`` with the best mean best-final-metric (chosen on the same seeds)."""
    return max((arms[n] for n in ARMS if n != "mrs"), key=lambda a: (1 if HIGHER[metric] else -1) * sum(a.best) / len(a.best))


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
    best_other = _best_other(arms, metric)
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


#: the rule's three comparisons: name (``<stem>_<name>.csv``), title, metric, the precision column's value or None
COMPARISONS = (
    ("vit", "ViT on the digits (`--sweep norm-vit`)", "final_top1", None),
    ("resnet", "ResNet on the digits (`--sweep norm`)", "final_top1", None),
    ("lm", "Byte-level Llama on the standard library (`--sweep lm`, bf16-mixed)", "final_bpb", "bf16-mixed"),
)


def _read(path: Path, precision: Optional[str]) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return [r for r in csv.DictReader(f) if precision is None or r.get("precision") == precision]


def held_out(arms: dict[str, Arm], rows: Sequence[dict[str, str]], metric: str) -> list[tuple[str, float, float, bool]]:
    """The three differences on held-out seeds, each arm at its best lr of the main run: ``(label, main
    difference, held-out difference, same sign)`` (positive: the first arm better)."""
    sign = 1.0 if HIGHER[metric] else -1.0

    def mean_at_best(arm: Arm) -> float:
        values = [_value(r, metric) for r in rows if r["norm"] == arm.name and float(r["lr"]) == arm.best_lr]
        if not values:
            raise ValueError(f"no held-out cell of {arm.name!r} at its best lr {arm.best_lr:g}")
        return sum(values) / len(values)

    other = _best_other(arms, metric)
    out = []
    for label, a, b in (("DyT - LayerNorm", arms["dyt"], arms["layer"]), ("Derf - DyT", arms["derf"], arms["dyt"]),
                        (f"MRSNorm - {other.name}", arms["mrs"], other)):
        main_d = sign * (sum(a.best) / len(a.best) - sum(b.best) / len(b.best))
        held_d = sign * (mean_at_best(a) - mean_at_best(b))
        out.append((label, main_d, held_d, (main_d > 0) == (held_d > 0)))
    return out


def report(stem: Path) -> str:
    """The committed report of the rule: ``<stem>.md`` from ``<stem>_<comparison>.csv`` (and
    ``<stem>_<comparison>_heldout.csv`` where present) and ``<stem>.json`` (what the CSVs do not hold:
    when the rule and the cells ran, what was cut, the commands)."""
    facts = json.loads(stem.with_suffix(".json").read_text())
    lines = [f"# Norm-free alternatives (issue 64): the results", "",
             f"Written by `python -m recipes.sweeps.alternatives --report {stem.parent.name}/{stem.name}` from the CSVs beside it and "
             f"`{stem.name}.json`; the rule is [docs/results.md](results.md#norm-free-alternatives-issue-64-the-rule-fixed-"
             f"before-the-run), committed in {facts['rule_commit']} at {facts['rule_time']}. The first cell ran at "
             f"{facts['cells_started']}.", "", f"**Budget.** {facts['budget']}", ""]
    total = 0.0
    for name, title, metric, precision in COMPARISONS:
        rows = _read(stem.parent / f"{stem.name}_{name}.csv", precision)
        cpu = sum(float(r["cpu_s"]) for r in rows) / 60
        total += cpu
        arms, questions = verdicts(rows, metric)
        lrs = sorted({float(r["lr"]) for r in rows})
        lines += [f"## {title}", "", f"`{facts['commands'][name]}`", "",
                  f"{len(rows)} cells ({', '.join(sorted({r['norm'] for r in rows}))}; lrs "
                  f"{', '.join(f'{lr:g}' for lr in lrs)}; seeds {', '.join(sorted({r['seed'] for r in rows}, key=int))}), "
                  f"{cpu:.1f} CPU minutes.", "", render(arms, questions, metric).rstrip("\n"), ""]
        for extra in sorted({r["norm"] for r in rows} - set(ARMS)):  # e.g. the ResNet's own BatchNorm
            a = arm_summary(rows, extra, metric)
            lines += [f"Beside them, not compared: `{extra}`, best lr {a.best_lr:g}, {metric} {_interval(a.best)}, "
                      f"LR sensitivity {_interval(a.sensitivity)}.", ""]
        heldout_csv = stem.parent / f"{stem.name}_{name}_heldout.csv"
        if heldout_csv.exists():
            held = _read(heldout_csv, precision)
            seeds = ", ".join(sorted({r["seed"] for r in held}, key=int))
            lines += [f"Held out (seeds {seeds}, {len(held)} cells, each arm at its best lr above; "
                      f"{sum(float(r['cpu_s']) for r in held) / 60:.1f} CPU minutes, outside the budget):", ""]
            lines += [f"- {label}: {main_d:+.4g} here, {held_d:+.4g} held out: " + (
                      f"**{'agrees' if same else 'disagrees'}** with the verdict's direction" if q.low > 0 or q.high < 0
                      else f"{'same' if same else 'the other'} sign; the verdict has no direction (its interval holds 0)")
                      for q, (label, main_d, held_d, same) in zip(questions, held_out(arms, held, metric))]
            lines.append("")
    lines += [f"All cells of the three comparisons: {total:.1f} CPU minutes.", ""]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m recipes.sweeps.alternatives", description=__doc__.split("\n\n")[0])
    p.add_argument("csv", nargs="?", help="a sweep's results.csv")
    p.add_argument("--report", metavar="STEM", type=Path,
                   help="write STEM.md, the committed report, from STEM_{vit,resnet,lm}.csv and STEM.json")
    p.add_argument("--metric", choices=list(MARGINS), default="final_top1")
    p.add_argument("--precision", help="only the rows of this precision column value (the lm sweep: bf16-mixed)")
    args = p.parse_args(argv)
    if (args.csv is None) == (args.report is None):
        p.error("give a results.csv or --report STEM")
    if args.report is not None:
        args.report.with_suffix(".md").write_text(report(args.report))
        print(f"wrote {args.report.with_suffix('.md')}")
        return 0
    rows = _read(Path(args.csv), args.precision)
    try:
        arms, questions = verdicts(rows, args.metric)
    except ValueError as err:
        p.error(str(err))
    print(render(arms, questions, args.metric), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
