"""A sweep's per-cell rows, typed: the ``results.csv`` columns, writing and reading them back, atomic writes.

A *cell* is one training run (arm, learning rate, batch size, seed); the *arm* is what the sweep varies
(the body norm: column ``norm``; the QK-norm: ``qk_norm``; the sweep kind names the column). The table is
tidy: an arm that packs several factors (``--sweep lm``'s ``mrs-fp16``) has one column per factor
beside it (``norm``, ``precision``: the kind's ``factor_columns``), and every row says the machine it ran
on (``device``, ``cpu_model``, ``cpu_isa``: torch's CPU capability, ``threads``). The report
and the claims read the rows back from ``results.csv`` (:func:`read_csv`), so everything in ``results.md``
can be recomputed from that file alone. Needs no torch.

Accuracy convention: a cell whose training loss turned non-finite counts as chance accuracy
(``1 / num_classes``) from that step on; :func:`accuracy` applies it to any row.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import tempfile
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

__all__ = ["ARM_ORDER", "HEAD_COLUMNS", "TAIL_COLUMNS", "Row", "accuracy", "arm_key", "chance", "columns", "row_key",
           "csv_table", "csv_text", "distinct_lrs", "load_records", "read_csv", "same_lr", "select", "survived",
           "write_atomic"]

#: the order the arms (norms, QK-norms) are shown in: tables, figures, summaries; others after them, by name
ARM_ORDER = ("none", "layer", "rms", "mrs", "batch")
#: the columns every sweep has, after its arm column and before its own metric columns
HEAD_COLUMNS = ("lr", "batch_size", "seed", "arch", "dataset", "num_classes", "steps", "planned_steps", "best_top1",
                "final_top1", "final_val_loss", "final_train_loss", "diverged", "divergence_step")
#: the columns every sweep has after its metric columns: cost, machine (empty in records older than it), run
TAIL_COLUMNS = ("wall_s", "cpu_s", "device", "cpu_model", "cpu_isa", "threads", "tb_run")
_TEXT = ("arch", "dataset", "tb_run", "device", "cpu_model", "cpu_isa")
# records written before num_classes was recorded
_CLASSES = {"cifar100": 100, "synthetic": 100, "digits": 10}


@dataclass
class Row:
    """One finished cell as ``results.csv`` holds it (``None``: not recorded).

    ``metrics`` holds the sweep kind's own columns (e.g. ``mean_grad_cv``, ``max_logit``), ``factors``
    the factors its arm packs (e.g. ``{"norm": "mrs", "precision": "16-mixed"}``).
    """

    arm: str
    lr: float
    batch_size: int
    seed: int
    arch: str = ""
    dataset: str = ""
    num_classes: Optional[int] = None
    steps: Optional[int] = None
    planned_steps: Optional[int] = None
    best_top1: Optional[float] = None
    final_top1: Optional[float] = None
    final_val_loss: Optional[float] = None
    final_train_loss: Optional[float] = None
    diverged: bool = False
    divergence_step: Optional[int] = None
    metrics: dict[str, Optional[float]] = field(default_factory=dict)
    wall_s: Optional[float] = None
    cpu_s: Optional[float] = None
    device: str = ""
    cpu_model: str = ""
    cpu_isa: str = ""
    threads: Optional[int] = None
    tb_run: str = ""
    factors: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, values: Mapping[str, Any], arm_column: str, metric_columns: Sequence[str],
              factor_columns: Sequence[str] = ()) -> "Row":
        """A row from a cell record (JSON values) or a CSV row (strings); absent or empty values are ``None``."""
        kinds = {f.name: f.type for f in fields(cls)}
        out: dict[str, Any] = {"arm": str(values[arm_column])}
        for name in (*HEAD_COLUMNS, *TAIL_COLUMNS):
            out[name] = _typed(values.get(name), kinds[name])
        out["diverged"] = values.get("diverged") in (True, 1, "1", "True", "true")
        out.update({k: str(values.get(k) or "") for k in _TEXT})
        out["factors"] = {k: str(values.get(k) or "") for k in factor_columns}
        if out["num_classes"] is None:
            out["num_classes"] = _CLASSES.get(out["dataset"])
        out["metrics"] = {k: _typed(values.get(k), "Optional[float]") for k in metric_columns}
        return cls(**out)

    def value(self, column: str, arm_column: str) -> Any:
        """The value of ``column`` (the arm's column is ``arm_column``; metrics by their own name)."""
        if column == arm_column:
            return self.arm
        if column in self.factors:
            return self.factors[column]
        return self.metrics.get(column) if column in self.metrics else getattr(self, column, None)


def _typed(value: Any, kind: str) -> Any:
    if value is None or value == "":
        return None
    if "int" in kind:
        return int(value)
    if "float" in kind:
        return float(value)
    return value


def columns(arm_column: str, metric_columns: Sequence[str], head: Sequence[str] = HEAD_COLUMNS,
            factors: Sequence[str] = ()) -> list[str]:
    """``results.csv``'s header: the arm, its factors, the shared columns (``head``), the sweep's metrics, cost,
    machine and run."""
    return [arm_column, *factors, *head, *metric_columns, *TAIL_COLUMNS]


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.6g}"
    return str(value)


def csv_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """CSV text of ``rows`` under ``header`` (missing values empty, floats to 6 significant digits)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    writer.writerows([_fmt(v) for v in row] for row in rows)
    return buf.getvalue()


def csv_text(rows: Iterable[Row], arm_column: str, metric_columns: Sequence[str],
             head: Sequence[str] = HEAD_COLUMNS, factors: Sequence[str] = ()) -> str:
    """``results.csv``'s text of ``rows`` (``head``: the shared columns the kind has; ``factors``: its arm's)."""
    header = columns(arm_column, metric_columns, head, factors)
    return csv_table(header, ([r.value(c, arm_column) for c in header] for r in rows))


def read_csv(path: Path, arm_column: str, metric_columns: Sequence[str],
             factor_columns: Sequence[str] = ()) -> list[Row]:
    """The rows of a ``results.csv``, typed."""
    with open(path, newline="") as f:
        return [Row.parse(row, arm_column, metric_columns, factor_columns) for row in csv.DictReader(f)]


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


def load_records(out: Path) -> list[dict[str, Any]]:
    """Every finished cell's record in ``out/cells`` (JSON objects with their curves), by file name."""
    records = []
    for path in sorted((out / "cells").glob("*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (json.JSONDecodeError, OSError):
            continue  # not a record written by the sweep (records are written atomically)
    return records


def chance(row: Row) -> float:
    """Top-1 of a constant guess: ``1 / num_classes`` (NaN when unknown)."""
    return 1.0 / row.num_classes if row.num_classes else math.nan


def accuracy(row: Row) -> float:
    """The cell's final top-1, chance when it diverged, NaN when it never validated."""
    if row.diverged:
        return chance(row)
    value = row.final_top1
    return value if value is not None and math.isfinite(value) else math.nan


def survived(row: Row) -> float:
    """Fraction of the planned optimizer steps reached before the first non-finite loss (1: none).

    NaN when a diverged cell does not know its planned steps.
    """
    if not row.diverged:
        return 1.0
    step, planned = row.divergence_step, row.planned_steps
    if not step or not planned:
        return math.nan
    return min(1.0, step / planned)


def arm_key(arm: str) -> tuple[int, str]:
    """Sort key of an arm: :data:`ARM_ORDER`, then any other arm by name."""
    return (ARM_ORDER.index(arm) if arm in ARM_ORDER else len(ARM_ORDER), arm)


def row_key(row: Row) -> tuple:
    """The table order of rows: lr, batch size, arm, seed."""
    return (row.lr, row.batch_size, *arm_key(row.arm), row.seed)


def same_lr(a: float, b: float) -> bool:
    """Learning rates read back from text compare equal when they agree to 6 significant digits."""
    return math.isclose(a, b, rel_tol=1e-5)


def distinct_lrs(rows: Iterable[Row]) -> list[float]:
    """The learning rates of ``rows``, ascending, each once (see :func:`same_lr`)."""
    out: list[float] = []
    for lr in sorted(r.lr for r in rows):
        if not out or not same_lr(out[-1], lr):
            out.append(lr)
    return out


def select(rows: Iterable[Row], lr: Optional[float] = None, batch_size: Optional[int] = None,
           arm: Optional[str] = None) -> list[Row]:
    """The rows of one learning rate, batch size and arm (``None``: any), in seed order."""
    picked = [r for r in rows if (lr is None or same_lr(r.lr, lr))
              and (batch_size is None or r.batch_size == batch_size) and (arm is None or r.arm == arm)]
    return sorted(picked, key=lambda r: r.seed)
