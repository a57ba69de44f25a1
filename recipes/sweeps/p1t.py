"""P1t with controls (issue 56): the table arm x lr x size, the verdict by the rule of ``docs/results-lm.md``, and
the per-layer growth of the residual stream, from ``--sweep lm`` output folders or from the committed CSVs alone.

    # collect the runs' cells into the two CSVs, then write the report and the plot from the CSVs
    python -m recipes.sweeps.p1t --runs runs/p1t/small runs/p1t/large runs/p1t/small-2threads \\
        --stem docs/stress_lm_p1t_stdlib
    # rebuild the report and the plot from the committed CSVs (identical report)
    python -m recipes.sweeps.p1t --stem docs/stress_lm_p1t_stdlib

``<stem>.csv``: one row per cell (its size, arm, lr, seed, threads, CPU model and ISA, failure, first
non-finite step and point); ``<stem>_growth.csv``: the residual stream's largest ``|x|`` per point and
recorded step (:mod:`recipes.sweeps.cells.residual_trace`: every 10th step, the last 3 and the first
non-finite one; collected here every 20th). ``<stem>.md`` and ``<stem>.png`` are computed from those two.
Needs no torch.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from recipes.sweeps.cells.residual_trace import kept_steps
from recipes.sweeps.claims.lm import EXTRA_NORMS, SAFE_HALF, SCALE_CONTROLS, split_arm
from recipes.sweeps.claims.mechanism import FP16_MAX
from recipes.sweeps.records import write_atomic
from recipes.sweeps.report import read_table

__all__ = ["COLUMNS", "GROWTH_COLUMNS", "collect", "main", "newcombe", "render", "verdict", "wilson"]

COLUMNS = ("size", "arm", "norm", "precision", "lr", "seed", "threads", "diverged", "divergence_step", "final_bpb",
           "first_nonfinite_point", "peak_absmax", "cpu_s", "cpu_model", "cpu_isa")
GROWTH_COLUMNS = ("size", "arm", "lr", "seed", "step", "point", "absmax")
Z95 = 1.959963984540054  # the standard normal's 97.5 % quantile
#: the rule's arms (docs/results-lm.md, "P1t with controls"): RMSNorm, MRSNorm, and each at the other's output scale
(RMS, MRS), (RMS_AS_MRS, MRS_AS_RMS) = SAFE_HALF, SCALE_CONTROLS
ORDER = (*SAFE_HALF, *EXTRA_NORMS)
PRIMARY = {"size": "2x32", "precision": "fp16-master", "lr": 0.1, "threads": 1}


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval for a proportion k/n."""
    if n == 0:
        return 0.0, 1.0
    p, d = k / n, 1 + z * z / n
    centre = (p + z * z / (2 * n)) / d
    half = z / d * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def newcombe(k1: int, n1: int, k2: int, n2: int) -> tuple[float, float, float]:
    """``p1 - p2`` with Newcombe's hybrid-score 95 % interval (independent proportions; his method 10)."""
    p1, p2 = k1 / n1, k2 / n2
    (l1, u1), (l2, u2) = wilson(k1, n1), wilson(k2, n2)
    d = p1 - p2
    return d, d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)


def _size(settings: dict[str, Any]) -> str:
    kw = settings.get("arch_kwargs") or {}
    return f"{kw.get('num_hidden_layers')}x{kw.get('hidden_size')}"


def _point_key(point: str) -> tuple[int, int]:
    m = re.fullmatch(r"L(\d+)\.(attn|mlp)", point)
    if m:
        return int(m.group(1)), 0 if m.group(2) == "attn" else 1
    return (10 ** 6, 0) if point == "final" else (10 ** 6, 1)


def collect(runs: Sequence[Path]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The cell rows and the growth rows of ``--sweep lm`` output folders (their ``cells/*.json``)."""
    cells, growth = [], []
    for run in runs:
        size = _size(json.loads((run / "settings.json").read_text()))
        for path in sorted((run / "cells").glob("*.json")):
            r = json.loads(path.read_text())
            norm, precision = split_arm(r["arm"])
            trace = sorted(r.get("growth", []), key=lambda g: (g["step"], _point_key(g["point"])))
            bad = [g for g in trace if not math.isfinite(g["absmax"])]
            finite = [g["absmax"] for g in trace if math.isfinite(g["absmax"])]
            cells.append({"size": size, "arm": r["arm"], "norm": norm, "precision": precision, "lr": r["lr"],
                          "seed": r["seed"], "threads": r["threads"], "diverged": int(bool(r["diverged"])),
                          "divergence_step": r["divergence_step"], "final_bpb": round(r["final_bpb"], 4),
                          "first_nonfinite_point": bad[0]["point"] if bad else "",
                          "peak_absmax": max(finite, default=""), "cpu_s": r["cpu_s"], "cpu_model": r["cpu_model"],
                          "cpu_isa": r["cpu_isa"]})
            keep = kept_steps({g["step"] for g in trace}, 20, bad[0]["step"] if bad else None)
            growth += [{"size": size, "arm": r["arm"], "lr": r["lr"], "seed": r["seed"], "step": g["step"],
                        "point": g["point"], "absmax": g["absmax"]} for g in trace
                       if g["step"] in keep and r["threads"] == PRIMARY["threads"]]
    order = {a: i for i, a in enumerate(ORDER)}
    cells.sort(key=lambda c: (c["size"], c["precision"], c["threads"], c["lr"], order.get(c["norm"], 99), c["seed"]))
    growth.sort(key=lambda g: (g["size"], g["arm"], g["lr"], g["seed"], g["step"], _point_key(g["point"])))
    return cells, growth


def _csv(rows: Iterable[dict[str, Any]], columns: Sequence[str]) -> str:
    out = io.StringIO()
    w = csv.DictWriter(out, columns, lineterminator="\n")
    w.writeheader()
    for row in rows:
        w.writerow({c: row.get(c, "") for c in columns})
    return out.getvalue()


def _group(cells: list[dict[str, Any]], **where: Any) -> list[dict[str, Any]]:  # threads: the CSV's 1.0 == 1
    return [c for c in cells if all(c[k] == v for k, v in where.items())]


def _kn(cells: list[dict[str, Any]], norm: str, **where: Any) -> tuple[int, int]:
    mine = _group(cells, norm=norm, **where)
    return sum(int(c["diverged"]) for c in mine), len(mine)


def _more(cells: list[dict[str, Any]], a: str, b: str, where: dict[str, Any]) -> tuple[bool, str]:
    """Does ``a`` fail more than ``b`` (Newcombe interval above 0)? And the comparison's line."""
    (k1, n1), (k2, n2) = _kn(cells, a, **where), _kn(cells, b, **where)
    if not n1 or not n2:
        return False, f"`{a}` - `{b}`: not run"
    d, lo, hi = newcombe(k1, n1, k2, n2)
    return lo > 0, f"`{a}` - `{b}`: {k1}/{n1} - {k2}/{n2} = {d:+.3f} [{lo:+.3f}, {hi:+.3f}]"


def verdict(cells: list[dict[str, Any]], where: dict[str, Any]) -> tuple[str, list[str]]:
    """The rule of docs/results-lm.md ("P1t with controls") on the cells matching ``where``: (verdict, lines)."""
    base, l1 = _more(cells, RMS, MRS, where)
    m1, l2 = _more(cells, RMS_AS_MRS, MRS, where)
    m2, l3 = _more(cells, RMS, MRS_AS_RMS, where)
    s1, l4 = _more(cells, RMS, RMS_AS_MRS, where)
    s2, l5 = _more(cells, MRS_AS_RMS, MRS, where)
    lines = [l1, l2, l3, l4, l5]
    if not (_kn(cells, RMS, **where)[1] and _kn(cells, MRS, **where)[1]):
        return "not applicable: the safe pair was not run here", lines
    if not all(_kn(cells, arm, **where)[1] for arm in (RMS_AS_MRS, MRS_AS_RMS)) and base:
        return "1 only (the controls were not run here): P1t is reproduced", lines
    if not base:
        return "1: `rms-half-safe` does not fail more than `mrs-half-safe` (P1t not reproduced here)", lines
    if m1 and m2:
        return "2: P1t holds, and it is the formula's", lines
    if not m1 and not m2 and (s1 or s2):
        return "3: P1t is an output-scale effect, not the formula's", lines
    return "4: P1t holds but is inconclusive between formula and output scale", lines


def _fmt(x: Optional[float]) -> str:
    return "" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def table(cells: list[dict[str, Any]]) -> list[str]:
    """One row per size x precision x threads x lr x arm: failures k/n [Wilson 95 %], where and when."""
    lines = ["| size | precision | threads | lr | arm | failures k/n [95 %] | first non-finite step | first "
             "non-finite point (seeds) | survivors' final bpb | largest finite \\|x\\| (median over seeds) |",
             "|:---|:---|---:|---:|:---|:---|:---|:---|---:|---:|"]
    keys = list(dict.fromkeys((c["size"], c["precision"], int(c["threads"]), c["lr"], c["norm"]) for c in cells))
    for size, precision, threads, lr, norm in keys:
        mine = _group(cells, size=size, precision=precision, threads=threads, lr=lr, norm=norm)
        k, n = sum(int(c["diverged"]) for c in mine), len(mine)
        lo, hi = wilson(k, n)
        steps = sorted(int(c["divergence_step"]) for c in mine if c["divergence_step"] is not None)
        points = Counter(c["first_nonfinite_point"] for c in mine if c["first_nonfinite_point"])
        alive = [c["final_bpb"] for c in mine if not int(c["diverged"])]
        peaks = sorted(c["peak_absmax"] for c in mine if c["peak_absmax"] is not None)
        lines.append(
            f"| {size} | {precision} | {threads} | {lr:g} | `{norm}` | {k}/{n} [{lo:.2f}, {hi:.2f}] | "
            f"{f'{steps[0]}-{steps[-1]}' if steps else ''} | "
            f"{', '.join(f'{p} {m}' for p, m in sorted(points.items(), key=lambda kv: _point_key(kv[0])))} | "
            f"{f'{sum(alive) / len(alive):.3f}' if alive else ''} | {_fmt(peaks[len(peaks) // 2]) if peaks else ''} |")
    return lines


def render(cells: list[dict[str, Any]], stem: Path, command: str) -> str:
    """``<stem>.md``'s text from the cell rows."""
    machines = Counter((c["cpu_model"], c["cpu_isa"], int(c["threads"])) for c in cells)
    out = ["# P1t with controls (issue 56): pure fp16 with float32 master weights", "",
           "The rule and the arms: [results-lm.md, \"P1t with controls\"](results-lm.md). A seed fails when its "
           "training loss turned non-finite within its 100 steps; k/n with Wilson's 95 % interval; differences with "
           "Newcombe's hybrid-score 95 % interval. Sizes: layers x width (2x32: 2 heads of 16, MLP 128; 4x64: 4 heads "
           "of 16, MLP 256). Rows per cell: "
           f"[{stem.name}.csv]({stem.name}.csv); the residual trace: [{stem.name}_growth.csv]({stem.name}_growth.csv).",
           "", "Machine (every row records it): " + "; ".join(
               f"{model} (torch's CPU capability {isa}), {threads} thread(s) per run: {n} cells"
               for (model, isa, threads), n in sorted(machines.items(), key=lambda kv: (-kv[1], str(kv[0])))) + ".",
           "", f"Rebuild: `{command}`", "", "## Failures", "", *table(cells), "", "## Verdict by the rule", ""]
    subsets = [("primary", PRIMARY)]
    for size in sorted({c["size"] for c in cells} - {PRIMARY["size"]}):
        subsets.append((f"second size {size}", {**PRIMARY, "size": size}))
    for lr in sorted({c["lr"] for c in cells} - {PRIMARY["lr"]}):
        subsets.append((f"lr {lr:g}", {**PRIMARY, "lr": lr}))
    subsets.append(("pure bf16 (bf16-master)", {**PRIMARY, "precision": "bf16-master"}))
    subsets.append(("2 threads per run", {**PRIMARY, "threads": 2}))
    for name, where in subsets:
        mine = _group(cells, **where)
        if not mine:
            continue
        got, lines = verdict(mine, {})
        out += [f"- **{name}** ({', '.join(f'{k} {v}' for k, v in where.items())}): {got}.",
                *(f"  - {line}" for line in lines)]
    first = [c for c in cells if c["precision"] == "fp16-master" and c["first_nonfinite_point"]]
    out += ["", "## Where it breaks", "",
            "The first point of the residual stream (forward order: `L<i>.attn` is the input of layer i's attention "
            "norm, `L<i>.mlp` of its MLP norm, `final` of the final norm, `logits` the head's output) whose largest "
            "|x| was non-finite, in the first step with one, per size and arm (fp16-master, every lr):", ""]
    tally: dict[tuple[str, str], Counter] = defaultdict(Counter)
    for c in first:
        tally[(c["size"], c["norm"])][c["first_nonfinite_point"]] += 1
    for (size, norm), points in sorted(tally.items()):
        out.append(f"- {size} `{norm}`: " + ", ".join(
            f"{p} {m}" for p, m in sorted(points.items(), key=lambda kv: _point_key(kv[0]))))
    out += ["", f"![The residual stream's largest |x| per layer and step]({stem.name}.png)", ""]
    return "\n".join(out)


def figure(growth: list[dict[str, Any]], cells: list[dict[str, Any]], path: Path) -> None:
    """Per size (rows) and arm (columns), fp16-master at lr 0.1, 1 thread: the median over seeds of the largest |x|
    per point against the step (seeds counted while alive), float16's limit dashed; an x per seed at its first
    non-finite point's last finite value."""
    from recipes.sweeps import figure as fig

    plt = fig.pyplot()
    mine = [g for g in growth if split_arm(g["arm"])[1] == "fp16-master" and g["lr"] == PRIMARY["lr"]]
    sizes = sorted({g["size"] for g in mine}, key=lambda s: int(s.split("x")[1]))
    norms = [n for n in ORDER if any(split_arm(g["arm"])[0] == n for g in mine)]
    figure_, axes = plt.subplots(len(sizes), len(norms), figsize=(3.3 * len(norms), 3.0 * len(sizes)), squeeze=False,
                                 sharey=True, constrained_layout=True)
    for i, size in enumerate(sizes):
        for j, norm in enumerate(norms):
            ax = axes[i][j]
            rows = [g for g in mine if g["size"] == size and split_arm(g["arm"])[0] == norm]
            points = sorted({g["point"] for g in rows}, key=_point_key)
            colours = plt.get_cmap("viridis")
            for k, point in enumerate(points):
                by_step: dict[float, list[float]] = defaultdict(list)
                for g in rows:
                    if g["point"] == point and math.isfinite(g["absmax"]):
                        by_step[g["step"]].append(g["absmax"])
                steps = sorted(s for s in by_step if s % 20 == 0 or len(by_step[s]) > 2)
                med = [sorted(by_step[s])[len(by_step[s]) // 2] for s in steps]
                ax.plot(steps, med, color=colours(k / max(1, len(points) - 1)), lw=1.2, label=point,
                        ls="--" if point == "logits" else "-")
            k_n = _kn(cells, norm, size=size, precision="fp16-master", lr=PRIMARY["lr"], threads=PRIMARY["threads"])
            ax.axhline(FP16_MAX, color="r", ls=":", lw=1)
            ax.set_yscale("log")
            ax.set_title(f"{size} {norm}: failed {k_n[0]}/{k_n[1]}", fontsize=9)
            ax.set_xlabel("step")
            if j == 0:
                ax.set_ylabel("largest |x| (median over seeds)")
            if j == len(norms) - 1:
                ax.legend(fontsize=6, loc="lower right")
    figure_.suptitle("Residual stream, fp16-master, lr 0.1: largest |x| per point (red: float16's 65504)", fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure_.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(figure_)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m recipes.sweeps.p1t", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="*", type=Path, default=[], help="--sweep lm output folders to collect first")
    p.add_argument("--stem", type=Path, required=True, help="docs/stress_lm_p1t_stdlib: <stem>.csv, _growth.csv, .md, "
                                                             ".png")
    args = p.parse_args(argv)
    stem = args.stem
    cells_csv, growth_csv = stem.with_suffix(".csv"), stem.parent / f"{stem.name}_growth.csv"
    if args.runs:
        cells, growth = collect(args.runs)
        write_atomic(cells_csv, _csv(cells, COLUMNS))
        write_atomic(growth_csv, _csv(growth, GROWTH_COLUMNS))
    if missing := [str(f) for f in (cells_csv, growth_csv) if not f.exists()]:  # read_table would read no rows
        p.error(f"--stem: {', '.join(missing)} not found; collect the cells into it with --runs first")
    cells = read_table(cells_csv, ("lr", "threads", "divergence_step", "final_bpb", "peak_absmax", "seed"))
    growth = read_table(growth_csv, ("lr", "seed", "step", "absmax"))
    command = f"python -m recipes.sweeps.p1t --stem {stem.as_posix()}"
    write_atomic(stem.with_suffix(".md"), render(cells, stem, command))
    figure(growth, cells, stem.with_suffix(".png"))
    print(f"wrote {stem}.md, {stem}.png from {stem}.csv ({len(cells)} cells), {stem.name}_growth.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
