"""A sweep's outputs, rebuilt from ``cells/*.json`` after every cell.

* ``results.csv``: one row per finished cell (the kind's columns, :func:`recipes.sweeps.records.columns`);
* ``robustness.csv``: LR sensitivity and breaking point per arm and batch size (:mod:`recipes.sweeps.robustness`);
* ``<table>.csv`` and ``<table>.png``: a kind's own tables (:class:`~recipes.sweeps.kind.Table`, e.g. the
  ``lm`` sweep's ``mechanism``), from its cells' records;
* ``results.md``: setup (the machine included), the claims' verdicts (the kind's claims and its tables',
  laid out by :mod:`recipes.sweeps.claims.markdown`, with the seeds each inconclusive comparison would
  need), the tables' sections, the robustness tables and the per-cell table (mean ± sd over seeds), all
  computed from the CSV files;
* ``results.png``: the kind's figure.

:func:`render` rebuilds ``results.md``, ``robustness.csv`` and the figures from the CSV files alone
(:mod:`recipes.sweeps.rebuild`: a committed report whose cells are gone).

Needs no torch (a rerun with nothing to train stays fast); scipy for the intervals, matplotlib (Agg)
for the figure.
"""

from __future__ import annotations

import csv
import json
import math
import shlex
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Optional, Sequence

from recipes.sweeps import robustness as rb
from recipes.sweeps.claims.engine import evaluate
from recipes.sweeps.claims.markdown import markdown as claims_markdown
from recipes.sweeps.claims.stats import MIN_SEEDS
from recipes.sweeps.kind import Sweep, Table
from recipes.sweeps.records import Row, arm_key, csv_table, csv_text, load_records, row_key, write_atomic
from recipes.sweeps.score import TOP1, Score

__all__ = ["DATA_FILE", "machine_lines", "read_table", "render", "table_csv", "verdict_command", "write_outputs"]

#: what the data of the sweep were (classes, sizes), written when the cells' settings are checked
DATA_FILE = "data.json"


def _pct(values: list[float], score: Score = TOP1) -> str:
    """Mean ± sd (over seeds) in the score's display units (top-1: percent)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return "nan"
    mean = statistics.fmean(finite)
    return f"{score.show(mean)} ± {score.show(statistics.stdev(finite))}" if len(finite) > 1 else score.show(mean)


def _mean(values: list[Optional[float]]) -> str:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return f"{statistics.fmean(finite):.3g}" if finite else "-"


def _axes(rows: list[Row], kind: Sweep) -> list[str]:
    arms = sorted({r.arm for r in rows}, key=arm_key)
    lrs = sorted({r.lr for r in rows})
    return [f"- grid: {kind.arm_column.replace('_', '-')}s {' '.join(arms)}; learning rates "
            f"{' '.join(f'{v:g}' for v in lrs)}; batch sizes {' '.join(str(b) for b in sorted({r.batch_size for r in rows}))}; "
            f"seeds {' '.join(str(s) for s in sorted({r.seed for r in rows}))} ({len(rows)} cells finished)"]


def _data(out: Path, kind: Sweep) -> list[str]:
    path = out / DATA_FILE
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, OSError):
        return []
    if kind.data_note is not None:
        return [kind.data_note(data)]
    classes = data.get("classes", [])
    shown = ", ".join(classes[:12]) + (f", ... ({len(classes) - 12} more)" if len(classes) > 12 else "")
    return [f"- data: {len(classes)} classes ({shown}); {data.get('train')} training and {data.get('val')} "
            f"validation images" + (f" in `{data['root']}`" if data.get("root") else "")]


def machine_lines(rows: list[Row]) -> list[str]:
    """The Setup line that says what the cells ran on: device, CPU model, vector ISA, threads (cells of each)."""
    groups = Counter((r.device, r.cpu_model, r.cpu_isa, r.threads) for r in rows)
    parts = []
    for (device, model, isa, threads), n in sorted(groups.items(), key=lambda kv: (-kv[1], str(kv[0]))):
        if not (model or isa):
            parts.append(f"not recorded ({n} cells, written before the records kept it)")
            continue
        gpu = f"{device}, host CPU " if device and device != "cpu" else ""
        parts.append(f"{gpu}{model or '?'} (vector ISA: torch's CPU capability {isa or '?'}), "
                     f"{threads if threads is not None else '?'} thread(s) per cell: {n} cells")
    return [f"- machine: {'; '.join(parts)}"] if parts else []


def _cost(rows: list[Row]) -> list[str]:
    wall = [r.wall_s for r in rows if r.wall_s is not None]
    cpu = [r.cpu_s for r in rows if r.cpu_s is not None]
    if not wall or not cpu:
        return []
    return [f"- cost per cell: {statistics.fmean(wall):.1f} s wall, {statistics.fmean(cpu):.1f} s of process CPU time "
            f"(all cells: {sum(cpu) / 60:.1f} CPU minutes; --jobs runs several at once)"]


def _cell_table(rows: list[Row], kind: Sweep) -> list[str]:
    groups: dict[tuple, list[Row]] = defaultdict(list)
    for r in rows:
        groups[(r.lr, r.batch_size, r.arm)].append(r)
    score = kind.score
    what = ("Validation top-1 in %, mean ± sd over seeds (one seed: no ±); a diverged seed counts as chance from its "
            "divergence on." if score is TOP1 else
            f"Final and best {score.label}, mean ± sd over seeds (one seed: no ±); {score.diverged_text}; best: "
            "the best validation before any divergence.")
    lines = [
        "## Per cell",
        "",
        f"{what} **DIVERGED k/n @ s**: k of n seeds hit a non-finite training loss, the first at optimizer "
        f"step s (the cell stops there). {kind.table_note}",
        "",
        f"| lr | batch | {kind.arm_column} | seeds | final {score.label} | best {score.label} | divergence | "
        + "".join(f"{h} | " for h, _ in kind.table),
        "|---:|---:|:---|---:|---:|---:|:---|" + "---:|" * len(kind.table),
    ]
    lines[-2] = lines[-2].rstrip()
    for (lr, bs, arm), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], arm_key(kv[0][2])[0])):
        div = [r for r in rs if r.diverged]
        steps = [r.divergence_step for r in div if r.divergence_step is not None]
        mark = f"**DIVERGED {len(div)}/{len(rs)} @ {min(steps) if steps else '?'}**" if div else "none"
        lines.append(
            f"| {lr:g} | {bs} | {arm} | {len(rs)} | {_pct([score.final(r) for r in rs], score)} | "
            f"{_pct([b for b in map(score.best, rs) if b is not None], score)} | {mark} | "
            + "".join(f"{_mean([r.metrics.get(key) for r in rs])} | " for _, key in kind.table)
        )
        lines[-1] = lines[-1].rstrip()
    return lines + [""]


def verdict_command(command: str) -> str:
    """``command`` without ``--quick``, ``--seeds`` and ``--out``: the full grid of the same sweep, into its own --out."""
    words = shlex.split(command)
    kept: list[str] = []
    skip = False
    for word in words:
        if word.startswith("--"):
            skip = word.split("=")[0] in ("--quick", "--seeds", "--out")
            if skip:
                continue
        elif skip:
            continue
        kept.append(word)
    return shlex.join(kept)


def _few_seeds(rows: list[Row], commands: list[str]) -> list[str]:
    seeds: dict[tuple, int] = defaultdict(int)
    for r in rows:
        seeds[(r.arm, r.lr, r.batch_size)] += 1
    if not rows or max(seeds.values()) >= MIN_SEEDS:
        return []
    command = verdict_command(commands[0]) if commands else "python recipes/stress.py ..."
    return [f"**Every claim below is inconclusive by construction:** this sweep ran {max(seeds.values())} seed per "
            f"cell (`--quick` runs one), and a verdict needs at least {MIN_SEEDS} seeds of every cell a claim "
            f"compares. For verdicts, run the full grid (its default seeds, without `--quick`): `{command}`", ""]


def table_csv(table: Table, records: Sequence[dict[str, Any]]) -> str:
    """``<table>.csv``: the rows every record holds under the table's name, in record order."""
    rows = [row for r in records for row in r.get(table.name) or ()]
    return csv_table(table.columns, ([row.get(c) for c in table.columns] for row in rows))


def read_table(path: Path, numeric: Sequence[str]) -> list[dict[str, Any]]:
    """A table's rows read back from its CSV (``numeric`` columns as floats, NaN kept; empty: ``None``; no file: [])."""
    if not path.exists():
        return []
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return [{k: (float(v) if v not in ("", None) else None) if k in numeric else v for k, v in row.items()}
            for row in rows]


def _table_section(table: Table, rows: list[dict[str, Any]]) -> list[str]:
    return [f"## {table.title}", "", *table.intro, "",
            f"Rows: `{table.name}.csv` ({len(rows)} rows); `{table.name}.png` plots {table.plotted}. Its claim is "
            "in the Claims section above.", "", *table.lines(rows)]


def _markdown(out: Path, rows: list[Row], kind: Sweep, settings: dict[str, Any], commands: list[str],
              summaries: list[rb.Robustness], tables: dict[str, list[dict[str, Any]]],
              setup: Optional[list[str]] = None) -> str:
    dataset = settings.get("dataset", "?")
    claims = [evaluate(c) for c in kind.claims(rows)]
    rule = list(kind.rule)
    sections: list[str] = []
    for table in kind.tables:
        claims += [evaluate(c) for c in table.claims(tables.get(table.name, []))]
        rule += table.rule
        sections += _table_section(table, tables.get(table.name, []))
    lines = [
        f"# {kind.title} ({dataset})",
        "",
        *_few_seeds(rows, commands),
        "Every number below is computed by `recipes/sweeps/report.py` from `results.csv` (one row per cell: one "
        f"training run of one {kind.arm_label}, learning rate, batch size and seed)"
        + "".join(f" and `{t.name}.csv`" for t in kind.tables) + f"; `results.png` plots "
        f"{kind.plotted} against {kind.against}.",
        "",
        "## Setup",
        "",
        *_axes(rows, kind),
        *(setup if setup is not None else _data(out, kind)),
        *machine_lines(rows),
        *[f"- {k}: `{v}`" for k, v in settings.items()],
        *_cost(rows),
        "",
        "Command(s) that produced these cells:",
        "",
        *[f"    {c}" for c in commands],
        "",
        *claims_markdown(claims, rule),
        *sections,
        *(rb.markdown(summaries, kind.arm_column, kind.score) if kind.lr_robustness else []),
        *_cell_table(rows, kind),
        "Files: `results.csv` (cells), `robustness.csv`, `results.png`, "
        + "".join(f"`{t.name}.csv`, `{t.name}.png`, " for t in kind.tables)
        + "`cells/*.json` (records with curves), `tb/` (TensorBoard runs).",
        "",
    ]
    return "\n".join(lines)


def render(out: Path, kind: Sweep, settings: dict[str, Any], commands: list[str], figures: bool = True,
           setup: Optional[list[str]] = None) -> list[Row]:
    """``robustness.csv``, ``results.md`` and (``figures``) every figure of ``out`` from its CSV files alone.

    ``setup``: the data lines of the Setup section (default: from ``data.json``). Returns the rows.
    """
    rows = kind.read(out / "results.csv")  # the report rests on the CSV alone
    tables = {t.name: read_table(out / f"{t.name}.csv", t.numeric) for t in kind.tables}
    summaries = rb.robustness(rows, kind.score)
    write_atomic(out / "robustness.csv", rb.robustness_csv(summaries, kind.arm_column, kind.score))
    write_atomic(out / "results.md", _markdown(out, rows, kind, settings, commands, summaries, tables, setup))
    if figures and rows:
        kind.figure(rows, out / "results.png")
        for table in kind.tables:
            if tables[table.name]:
                table.figure(tables[table.name], out / f"{table.name}.png")
    return rows


def write_outputs(out: Path, kind: Sweep, settings: dict[str, Any], command: str,
                  figure: bool = True) -> list[dict[str, Any]]:
    """Rebuild ``results.csv``, the kind's tables, ``robustness.csv``, ``results.md`` and (``figure``: when
    stale) the figures.

    Returns the cell records, in table order.
    """
    records = sorted(load_records(out), key=lambda r: row_key(kind.row(r)))
    write_atomic(out / "results.csv", csv_text(map(kind.row, records), kind.arm_column, kind.metric_columns,
                                               kind.head_columns, kind.factor_columns))
    for table in kind.tables:
        write_atomic(out / f"{table.name}.csv", table_csv(table, records))
    commands = list(dict.fromkeys(r["command"] for r in records if r.get("command")))
    stale = False
    png = out / "results.png"
    if figure and records:  # the cells' files are looked at only when a figure may be drawn
        newest = max(((out / "cells" / f"{r['cell']}.json").stat().st_mtime for r in records), default=0.0)
        stale = not png.exists() or png.stat().st_mtime < newest
    render(out, kind, settings, commands or [command], figures=stale)
    return records
