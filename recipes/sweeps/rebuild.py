"""Rebuild a sweep's report from its ``results.csv`` alone: a committed report whose cells are gone.

    python -m recipes.sweeps.rebuild --sweep qk --csv docs/stress_qk_digits.csv --report docs/stress_qk_digits.md \\
        --out /tmp/qk_digits

The old report (``--report``, the ``results.md`` being replaced) gives what the CSV does not hold: the
settings, the data line and the commands of its Setup section. ``results.csv`` is rewritten in the
kind's current columns (the arm's factors filled in from the arm, or from a setting of the same name;
renamed columns read under their new names; the machine columns stay empty where the cells did not
record it, and the report says so), then ``results.md``, ``robustness.csv`` and ``results.png`` are
written into ``--out`` by :func:`recipes.sweeps.report.render`, the same code that writes them after
every cell. A kind's own tables are read from ``<csv stem>_<table>.csv`` beside ``--csv`` (a sweep's
own ``<table>.csv`` beside its ``results.csv``) when present.
Needs no torch.
"""

from __future__ import annotations

import argparse
import ast
import shutil
import sys
from pathlib import Path
from typing import Any, Optional

from recipes.sweeps.records import csv_text, write_atomic
from recipes.sweeps.report import render

__all__ = ["main", "old_setup", "rebuild"]

_COMPUTED = ("grid", "machine", "cost per cell")  # Setup lines the report computes from the rows


def _value(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a plain string (the report writes them without quotes)


def old_setup(report: str) -> tuple[dict[str, Any], list[str], list[str]]:
    """``(settings, data lines, commands)`` of a ``results.md``'s Setup section."""
    settings: dict[str, Any] = {}
    data: list[str] = []
    commands: list[str] = []
    lines = report.splitlines()
    start = lines.index("## Setup")
    for i, line in enumerate(lines[start + 1:], start + 1):
        if line.startswith("## "):
            break
        if line.startswith("Command(s) that produced these cells:"):
            for command in lines[i + 2:]:  # after a blank line, one indented line each
                if not command.startswith("    "):
                    break
                commands.append(command.strip())
            break
        if not line.startswith("- ") or ": " not in line:
            continue
        key, value = line[2:].split(": ", 1)
        if key == "data":
            data.append(line)
        elif key not in _COMPUTED and value.startswith("`") and value.endswith("`"):
            settings[key] = _value(value[1:-1])
    return settings, data, commands


def rebuild(kind_name: str, csv_path: Path, report_path: Path, out: Path) -> Path:
    """Write ``out/results.csv`` (current columns), ``results.md``, ``robustness.csv``, the figures; return ``out``."""
    from recipes.sweeps.kinds import SWEEPS

    kind = SWEEPS[kind_name]
    settings, data, commands = old_setup(report_path.read_text())
    out.mkdir(parents=True, exist_ok=True)
    rows = kind.read(csv_path)
    for row in rows:
        for name in kind.factor_columns:  # e.g. lm-qk's precision: a setting of the whole sweep
            if not row.factors.get(name) and isinstance(settings.get(name), str):
                row.factors[name] = settings[name]
    write_atomic(out / "results.csv", csv_text(rows, kind.arm_column, kind.metric_columns, kind.head_columns,
                                               kind.factor_columns))
    for table in kind.tables:  # docs/stress_lm_stdlib_mechanism.csv, or a sweep's own mechanism.csv
        names = [f"{csv_path.stem}_{table.name}.csv"] + ([f"{table.name}.csv"] if csv_path.stem == "results" else [])
        beside = next((csv_path.with_name(n) for n in names if csv_path.with_name(n).exists()), None)
        if beside is not None and beside.resolve() != (out / f"{table.name}.csv").resolve():
            shutil.copyfile(beside, out / f"{table.name}.csv")
    render(out, kind, settings, commands or ["(not recorded)"], setup=data)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    from recipes.sweeps.kinds import SWEEPS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sweep", required=True, choices=list(SWEEPS), help="the kind of the sweep")
    p.add_argument("--csv", required=True, type=Path, help="its results.csv")
    p.add_argument("--report", required=True, type=Path, help="its results.md (settings, data line, commands)")
    p.add_argument("--out", required=True, type=Path, help="where to write the rebuilt report")
    args = p.parse_args(argv)
    out = rebuild(args.sweep, args.csv, args.report, args.out)
    print(f"wrote {out / 'results.md'}, {out / 'results.csv'}, {out / 'robustness.csv'}, {out / 'results.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
