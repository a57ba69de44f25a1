"""The stress sweep's outputs, rebuilt from ``cells/*.json`` after every cell.

* ``results.csv``: one row per finished cell (:data:`recipes.stress_rows.CSV_COLUMNS`);
* ``robustness.csv``: LR sensitivity and breaking point per norm and batch size
  (:mod:`recipes.stress_summary`);
* ``results.md``: setup, the claims' verdicts (:mod:`recipes.stress_claims`), the robustness
  tables and the per-cell table (mean ± sd over seeds), all computed from ``results.csv``;
* ``results.png``: top-1 against learning rate (:mod:`recipes.stress_figure`).

Needs no torch (a rerun with nothing to train stays fast); scipy for the intervals, matplotlib
(Agg) for the figure.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

from recipes.stress_rows import CSV_COLUMNS, accuracy, csv_text, read_csv

__all__ = ["CSV_COLUMNS", "load_records", "write_atomic", "write_outputs"]

NORM_ORDER = {"layer": 0, "rms": 1, "mrs": 2, "batch": 3}


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers (and crashes) see the old file or the new one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _order(r: dict[str, Any]) -> tuple:
    return (r["lr"], r["batch_size"], NORM_ORDER.get(r["norm"], 9), r["norm"], r["seed"])


def load_records(out: Path) -> list[dict[str, Any]]:
    """Every finished cell's record in ``out/cells``, in table order."""
    records = []
    for path in sorted((out / "cells").glob("*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (json.JSONDecodeError, OSError):
            continue  # not a record written by the sweep (records are written atomically)
    return sorted(records, key=_order)


def _pct(values: list[float]) -> str:
    """Mean ± sd (over seeds) in percent."""
    finite = [100 * v for v in values if math.isfinite(v)]
    if not finite:
        return "nan"
    mean = statistics.fmean(finite)
    return f"{mean:.2f} ± {statistics.stdev(finite):.2f}" if len(finite) > 1 else f"{mean:.2f}"


def _mean(values: list[Optional[float]]) -> str:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return f"{statistics.fmean(finite):.3g}" if finite else "-"


def _axes(rows: list[dict[str, Any]]) -> list[str]:
    norms = sorted({r["norm"] for r in rows}, key=lambda n: (NORM_ORDER.get(n, 9), n))
    lrs = sorted({r["lr"] for r in rows})
    return [f"- grid: norms {' '.join(norms)}; learning rates {' '.join(f'{v:g}' for v in lrs)}; batch sizes "
            f"{' '.join(str(b) for b in sorted({r['batch_size'] for r in rows}))}; seeds "
            f"{' '.join(str(s) for s in sorted({r['seed'] for r in rows}))} ({len(rows)} cells finished)"]


def _cost(rows: list[dict[str, Any]]) -> list[str]:
    wall = [r["wall_s"] for r in rows if r.get("wall_s") is not None]
    cpu = [r["cpu_s"] for r in rows if r.get("cpu_s") is not None]
    if not wall or not cpu:
        return []
    return [f"- cost per cell: {statistics.fmean(wall):.1f} s wall, {statistics.fmean(cpu):.1f} s of process CPU time "
            f"(all cells: {sum(cpu) / 60:.1f} CPU minutes; --jobs runs several at once)"]


def _cell_table(rows: list[dict[str, Any]]) -> list[str]:
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["lr"], r["batch_size"], r["norm"])].append(r)
    lines = [
        "## Per cell",
        "",
        "Validation top-1 in %, mean ± sd over seeds (one seed: no ±); a diverged seed counts as chance from its "
        "divergence on. **DIVERGED k/n @ s**: k of n seeds hit a non-finite training loss, the first at optimizer "
        "step s (the cell stops there). grad_cv and starved_frac: the monitor's `phasor/all/*`, mean over the "
        "logged steps (before any divergence), mean over seeds.",
        "",
        "| lr | batch | norm | seeds | final top-1 | best top-1 | divergence | mean grad_cv | mean starved_frac |",
        "|---:|---:|:---|---:|---:|---:|:---|---:|---:|",
    ]
    for (lr, bs, norm), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], NORM_ORDER.get(kv[0][2], 9))):
        div = [r for r in rs if r["diverged"]]
        steps = [r["divergence_step"] for r in div if r.get("divergence_step") is not None]
        mark = f"**DIVERGED {len(div)}/{len(rs)} @ {min(steps) if steps else '?'}**" if div else "none"
        lines.append(
            f"| {lr:g} | {bs} | {norm} | {len(rs)} | {_pct([accuracy(r) for r in rs])} | "
            f"{_pct([r['best_top1'] for r in rs if r.get('best_top1') is not None])} | {mark} | "
            f"{_mean([r.get('mean_grad_cv') for r in rs])} | {_mean([r.get('mean_starved_frac') for r in rs])} |"
        )
    return lines + [""]


def _markdown(rows: list[dict[str, Any]], settings: dict[str, Any], commands: list[str],
              summaries: list[dict[str, Any]]) -> str:
    from recipes.stress_claims_text import claims_section
    from recipes.stress_summary import markdown as robustness_markdown

    dataset = settings.get("dataset", "?")
    lines = [
        f"# Stress sweep ({dataset})",
        "",
        "Every number below is computed by `recipes/stress_report.py` from `results.csv` (one row per cell: one "
        "training run of one norm, learning rate, batch size and seed); `results.png` plots final top-1 against "
        "the learning rate.",
        "",
        "## Setup",
        "",
        *_axes(rows),
        *[f"- {k}: `{v}`" for k, v in settings.items()],
        *_cost(rows),
        "",
        "Command(s) that produced these cells:",
        "",
        *[f"    {c}" for c in commands],
        "",
        *claims_section(rows),
        *robustness_markdown(summaries),
        *_cell_table(rows),
        "Files: `results.csv` (cells), `robustness.csv`, `results.png`, `cells/*.json` (records with curves), "
        "`tb/` (TensorBoard runs).",
        "",
    ]
    return "\n".join(lines)


def write_outputs(out: Path, settings: dict[str, Any], command: str, figure: bool = True) -> list[dict[str, Any]]:
    """Rebuild ``results.csv``, ``robustness.csv``, ``results.md`` and (``figure``: when stale) ``results.png``."""
    from recipes.stress_summary import robustness, robustness_csv

    records = load_records(out)
    write_atomic(out / "results.csv", csv_text(records))
    rows = read_csv(out / "results.csv")  # the report rests on the CSV alone
    summaries = robustness(rows)
    write_atomic(out / "robustness.csv", robustness_csv(summaries))
    commands = list(dict.fromkeys(r["command"] for r in records if r.get("command")))
    write_atomic(out / "results.md", _markdown(rows, settings, commands or [command], summaries))
    png = out / "results.png"
    newest = max(((out / "cells" / f"{r['cell']}.json").stat().st_mtime for r in records), default=0.0)
    if figure and rows and (not png.exists() or png.stat().st_mtime < newest):
        from recipes.stress_figure import figure as draw

        draw(rows, png)
    return records
