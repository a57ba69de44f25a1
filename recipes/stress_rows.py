"""The stress sweep's per-cell rows: the ``results.csv`` columns, writing and reading them back typed.

A *cell* is one training run (arm, learning rate, batch size, seed); the arm is the body norm
(``norm`` column, the ``norm`` sweep) or the QK-norm (``qk_norm`` column, the ``qk`` sweep). The summaries and the
claims read the rows back from ``results.csv`` through :func:`read_csv`, so that everything in
``results.md`` can be recomputed from that file alone. Needs no torch.

Accuracy convention: a cell whose training loss turned non-finite counts as chance accuracy
(``1 / num_classes``) from that step on; :func:`accuracy` applies it to any row.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any, Iterable, Optional

__all__ = ["ARM_ORDER", "CSV_COLUMNS", "QK_COLUMNS", "accuracy", "arm_key", "chance", "csv_text", "distinct_lrs",
           "read_csv", "same_lr", "select", "survived"]

#: the order the arms (norms, QK-norms) are shown in: tables, figures, summaries; others after them
ARM_ORDER = ("none", "layer", "rms", "mrs", "batch")

CSV_COLUMNS = [
    "norm", "lr", "batch_size", "seed", "arch", "dataset", "num_classes", "steps", "planned_steps",
    "best_top1", "final_top1", "final_val_loss", "final_train_loss", "diverged", "divergence_step",
    "mean_grad_cv", "mean_starved_frac", "wall_s", "cpu_s", "tb_run",
]
#: the ``qk`` sweep's columns: the QK-norm instead of the (kept) body norm, and the attention figures
QK_COLUMNS = ["qk_norm", *CSV_COLUMNS[1:CSV_COLUMNS.index("wall_s")], "max_logit", "min_entropy",
              "max_collapsed_frac", *CSV_COLUMNS[CSV_COLUMNS.index("wall_s"):]]
_INT = ("batch_size", "seed", "num_classes", "steps", "planned_steps", "divergence_step")
_FLOAT = ("lr", "best_top1", "final_top1", "final_val_loss", "final_train_loss", "mean_grad_cv",
          "mean_starved_frac", "wall_s", "cpu_s", "max_logit", "min_entropy", "max_collapsed_frac")
# records written before num_classes was recorded
_CLASSES = {"cifar100": 100, "synthetic": 100, "digits": 10}


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.6g}"
    return str(value)


def csv_text(records: Iterable[dict[str, Any]], columns: list[str] = CSV_COLUMNS) -> str:
    """``records`` as CSV text with ``columns`` (missing values empty, floats to 6 significant digits)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(columns)
    for r in records:
        writer.writerow([_fmt(r.get(c)) for c in columns])
    return buf.getvalue()


def _parse(row: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = dict(row)
    for key in _INT:
        if key in row:
            out[key] = int(row[key]) if row[key] not in ("", None) else None
    for key in _FLOAT:
        if key in row:
            out[key] = float(row[key]) if row[key] not in ("", None) else None
    out["diverged"] = row.get("diverged") in ("1", "True", "true")
    if out.get("num_classes") is None:
        out["num_classes"] = _CLASSES.get(row.get("dataset", ""), None)
    return out


def read_csv(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``results.csv``, typed (ints, floats, ``diverged`` a bool, empty cells ``None``)."""
    with open(path, newline="") as f:
        return [_parse(row) for row in csv.DictReader(f)]


def chance(row: dict[str, Any]) -> float:
    """Top-1 of a constant guess: ``1 / num_classes`` (NaN when unknown)."""
    k = row.get("num_classes")
    return 1.0 / k if k else math.nan


def accuracy(row: dict[str, Any]) -> float:
    """The cell's final top-1, chance when it diverged, NaN when it never validated."""
    if row.get("diverged"):
        return chance(row)
    value = row.get("final_top1")
    return value if value is not None and math.isfinite(value) else math.nan


def survived(row: dict[str, Any]) -> float:
    """Fraction of the planned optimizer steps reached before the first non-finite loss (1: none).

    NaN when a diverged cell does not know its planned steps.
    """
    if not row.get("diverged"):
        return 1.0
    step, planned = row.get("divergence_step"), row.get("planned_steps")
    if not step or not planned:
        return math.nan
    return min(1.0, step / planned)


def arm_key(arm: str) -> tuple[int, str]:
    """Sort key of an arm: :data:`ARM_ORDER`, then any other arm by name."""
    return (ARM_ORDER.index(arm) if arm in ARM_ORDER else len(ARM_ORDER), arm)


def same_lr(a: float, b: float) -> bool:
    """Learning rates read back from text compare equal when they agree to 6 significant digits."""
    return math.isclose(a, b, rel_tol=1e-5)


def distinct_lrs(rows: Iterable[dict[str, Any]]) -> list[float]:
    """The learning rates of ``rows``, ascending, each once (see :func:`same_lr`)."""
    out: list[float] = []
    for lr in sorted(r["lr"] for r in rows):
        if not out or not same_lr(out[-1], lr):
            out.append(lr)
    return out


def select(rows: Iterable[dict[str, Any]], lr: Optional[float] = None, batch_size: Optional[int] = None,
           **columns: Any) -> list[dict[str, Any]]:
    """The rows of one learning rate / batch size (``None``: any) and arm, in seed order.

    ``columns``: the arm and any other equalities, e.g. ``norm="mrs"`` or ``qk_norm="mrs"``
    (``None``: any).
    """
    picked = [r for r in rows if (lr is None or same_lr(r["lr"], lr))
              and (batch_size is None or r["batch_size"] == batch_size)
              and all(v is None or r.get(k) == v for k, v in columns.items())]
    return sorted(picked, key=lambda r: r["seed"])
