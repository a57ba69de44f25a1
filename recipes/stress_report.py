"""The stress sweep's outputs, rebuilt from ``cells/*.json`` after every cell.

* ``results.csv``: one row per finished cell (:data:`recipes.stress_rows.CSV_COLUMNS`, or
  ``QK_COLUMNS`` for the ``qk`` sweep);
* ``robustness.csv``: LR sensitivity and breaking point per arm (norm or QK-norm) and batch
  size (:mod:`recipes.stress_summary`);
* ``results.md``: setup, the claims' verdicts (:mod:`recipes.stress_claims` or
  :mod:`recipes.stress_claims_qk`), the robustness tables and the per-cell table (mean ± sd
  over seeds), all computed from ``results.csv``;
* ``results.png``: top-1 (and for ``qk`` the largest attention logit) against learning rate
  (:mod:`recipes.stress_figure`).

Which sweep a directory holds is ``settings.json``'s ``sweep`` (absent: ``norm``).

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
from typing import Any, Callable, Optional

from recipes.stress_rows import CSV_COLUMNS, QK_COLUMNS, accuracy, arm_key, csv_text, read_csv

__all__ = ["CSV_COLUMNS", "load_records", "write_atomic", "write_outputs"]

Metric = tuple[str, Callable[[list[dict[str, Any]]], str]]  # a per-cell table column: header, rows -> text


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers (and crashes) see the old file or the new one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would hide the results from other users
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _arm(r: dict[str, Any]) -> str:
    return r["qk_norm"] if "qk_norm" in r else r["norm"]


def _order(r: dict[str, Any]) -> tuple:
    return (r["lr"], r["batch_size"], *arm_key(_arm(r)), r["seed"])


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


def _column(key: str) -> Callable[[list[dict[str, Any]]], str]:
    return lambda rs: _mean([r.get(key) for r in rs])


#: per sweep: the arm's column, the per-cell table's last columns and what they mean
_SWEEP_TABLES: dict[str, tuple[str, list[Metric], str]] = {
    "norm": ("norm", [("mean grad_cv", _column("mean_grad_cv")), ("mean starved_frac", _column("mean_starved_frac"))],
             "grad_cv and starved_frac: the monitor's `phasor/all/*`, mean over the logged steps (before any "
             "divergence), mean over seeds."),
    "qk": ("qk_norm", [("max logit", _column("max_logit")), ("min entropy", _column("min_entropy")),
                       ("max collapsed_frac", _column("max_collapsed_frac"))],
           "From the AttentionMonitor, over the logged training steps (before any divergence), mean over seeds: "
           "max logit = the largest `attention/all/logit_max` (the worst layer's largest |logit|); min entropy = "
           "the smallest `attention/all/entropy_min` (nats; the softmax entropy of the lowest head, averaged "
           "over layers); max collapsed_frac = the largest `attention/all/collapsed_frac` (the worst layer's "
           "share of attention rows with one weight above 0.99)."),
}


def _axes(rows: list[dict[str, Any]], by: str) -> list[str]:
    norms = sorted({r[by] for r in rows}, key=arm_key)
    lrs = sorted({r["lr"] for r in rows})
    return [f"- grid: {by.replace('_', '-')}s {' '.join(norms)}; learning rates {' '.join(f'{v:g}' for v in lrs)}; "
            f"batch sizes "
            f"{' '.join(str(b) for b in sorted({r['batch_size'] for r in rows}))}; seeds "
            f"{' '.join(str(s) for s in sorted({r['seed'] for r in rows}))} ({len(rows)} cells finished)"]


def _cost(rows: list[dict[str, Any]]) -> list[str]:
    wall = [r["wall_s"] for r in rows if r.get("wall_s") is not None]
    cpu = [r["cpu_s"] for r in rows if r.get("cpu_s") is not None]
    if not wall or not cpu:
        return []
    return [f"- cost per cell: {statistics.fmean(wall):.1f} s wall, {statistics.fmean(cpu):.1f} s of process CPU time "
            f"(all cells: {sum(cpu) / 60:.1f} CPU minutes; --jobs runs several at once)"]


def _cell_table(rows: list[dict[str, Any]], sweep: str) -> list[str]:
    by, metrics, meaning = _SWEEP_TABLES[sweep]
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["lr"], r["batch_size"], r[by])].append(r)
    lines = [
        "## Per cell",
        "",
        "Validation top-1 in %, mean ± sd over seeds (one seed: no ±); a diverged seed counts as chance from its "
        "divergence on. **DIVERGED k/n @ s**: k of n seeds hit a non-finite training loss, the first at optimizer "
        f"step s (the cell stops there). {meaning}",
        "",
        f"| lr | batch | {by} | seeds | final top-1 | best top-1 | divergence | "
        + " | ".join(h for h, _ in metrics) + " |",
        "|---:|---:|:---|---:|---:|---:|:---|" + "---:|" * len(metrics),
    ]
    for (lr, bs, norm), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], arm_key(kv[0][2])[0])):
        div = [r for r in rs if r["diverged"]]
        steps = [r["divergence_step"] for r in div if r.get("divergence_step") is not None]
        mark = f"**DIVERGED {len(div)}/{len(rs)} @ {min(steps) if steps else '?'}**" if div else "none"
        lines.append(
            f"| {lr:g} | {bs} | {norm} | {len(rs)} | {_pct([accuracy(r) for r in rs])} | "
            f"{_pct([r['best_top1'] for r in rs if r.get('best_top1') is not None])} | {mark} | "
            + " | ".join(show(rs) for _, show in metrics) + " |"
        )
    return lines + [""]


_TITLES = {
    "norm": ("Stress sweep", "norm", "final top-1"),
    "qk": ("QK-norm stress sweep", "QK-norm", "final top-1 and the largest attention logit"),
}


def _claims(rows: list[dict[str, Any]], sweep: str) -> list[str]:
    if sweep == "qk":
        from recipes.stress_claims_qk import claims_section
    else:
        from recipes.stress_claims_text import claims_section
    return claims_section(rows)


def _markdown(rows: list[dict[str, Any]], settings: dict[str, Any], commands: list[str],
              summaries: list[dict[str, Any]], sweep: str) -> str:
    from recipes.stress_summary import markdown as robustness_markdown

    by = _SWEEP_TABLES[sweep][0]
    title, arm, plotted = _TITLES[sweep]
    dataset = settings.get("dataset", "?")
    lines = [
        f"# {title} ({dataset})",
        "",
        "Every number below is computed by `recipes/stress_report.py` from `results.csv` (one row per cell: one "
        f"training run of one {arm}, learning rate, batch size and seed); `results.png` plots {plotted} against "
        "the learning rate.",
        "",
        "## Setup",
        "",
        *_axes(rows, by),
        *[f"- {k}: `{v}`" for k, v in settings.items()],
        *_cost(rows),
        "",
        "Command(s) that produced these cells:",
        "",
        *[f"    {c}" for c in commands],
        "",
        *_claims(rows, sweep),
        *robustness_markdown(summaries, by),
        *_cell_table(rows, sweep),
        "Files: `results.csv` (cells), `robustness.csv`, `results.png`, `cells/*.json` (records with curves), "
        "`tb/` (TensorBoard runs).",
        "",
    ]
    return "\n".join(lines)


def write_outputs(out: Path, settings: dict[str, Any], command: str, figure: bool = True) -> list[dict[str, Any]]:
    """Rebuild ``results.csv``, ``robustness.csv``, ``results.md`` and (``figure``: when stale) ``results.png``."""
    from recipes import stress_figure
    from recipes.stress_summary import robustness, robustness_csv

    sweep = settings.get("sweep", "norm")
    by = _SWEEP_TABLES[sweep][0]
    records = load_records(out)
    write_atomic(out / "results.csv", csv_text(records, QK_COLUMNS if sweep == "qk" else CSV_COLUMNS))
    rows = read_csv(out / "results.csv")  # the report rests on the CSV alone
    summaries = robustness(rows, by=by)
    write_atomic(out / "robustness.csv", robustness_csv(summaries, by))
    commands = list(dict.fromkeys(r["command"] for r in records if r.get("command")))
    write_atomic(out / "results.md", _markdown(rows, settings, commands or [command], summaries, sweep))
    png = out / "results.png"
    if figure and rows:  # the cells' files are looked at only when a figure may be drawn
        newest = max(((out / "cells" / f"{r['cell']}.json").stat().st_mtime for r in records), default=0.0)
        if not png.exists() or png.stat().st_mtime < newest:
            draw = stress_figure.qk_figure if sweep == "qk" else stress_figure.figure
            draw(rows, png)
    return records
