"""The stress sweep's outputs: ``results.csv``, ``results.md`` and ``results.png`` from ``cells/*.json``.

Needs no torch (a rerun with nothing to train stays fast); matplotlib (Agg) for the figure.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

__all__ = ["CSV_COLUMNS", "load_records", "write_atomic", "write_outputs"]

CSV_COLUMNS = [
    "norm", "lr", "batch_size", "seed", "arch", "dataset", "steps", "best_top1", "final_top1",
    "final_val_loss", "final_train_loss", "diverged", "divergence_step", "mean_grad_cv",
    "mean_starved_frac", "wall_s", "tb_run",
]
NORM_ORDER = {"layer": 0, "rms": 1, "mrs": 2, "batch": 3}
NORM_COLOURS = {"layer": "tab:blue", "rms": "tab:orange", "mrs": "tab:green", "batch": "tab:gray"}


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


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.6g}"
    return str(value)


def _csv(records: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for r in records:
        writer.writerow([_fmt(r.get(c)) for c in CSV_COLUMNS])
    return buf.getvalue()


def _pct(values: list[float]) -> str:
    """Mean +- std (over seeds) in percent; NaN (a collapsed model) counted as 0 % is not hidden."""
    finite = [100 * v for v in values if math.isfinite(v)]
    if not finite:
        return "nan"
    mean = statistics.fmean(finite)
    std = statistics.stdev(finite) if len(finite) > 1 else 0.0
    return f"{mean:.2f} ± {std:.2f}" if len(finite) > 1 else f"{mean:.2f}"


def _mean(values: list[Optional[float]]) -> str:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return f"{statistics.fmean(finite):.3g}" if finite else "-"


def _markdown(records: list[dict[str, Any]], settings: dict[str, Any], commands: list[str]) -> str:
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        groups[(r["lr"], r["batch_size"], r["norm"])].append(r)
    lines = [
        "# Stress sweep",
        "",
        "Top-1 accuracy on the validation set in %, mean ± std over seeds (one seed: no ±). "
        "**DIVERGED k/n @ s**: k of n seeds hit a non-finite training loss, the first at optimizer step s; "
        "such a cell stops there and its top-1 is that of the collapsed model.",
        "",
        "| lr | batch | norm | seeds | final top-1 | best top-1 | divergence | mean grad_cv | mean starved_frac |",
        "|---:|---:|:---|---:|---:|---:|:---|---:|---:|",
    ]
    for (lr, bs, norm), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], NORM_ORDER.get(kv[0][2], 9))):
        div = [r for r in rs if r["diverged"]]
        mark = f"**DIVERGED {len(div)}/{len(rs)} @ {min(r['divergence_step'] for r in div)}**" if div else "none"
        lines.append(
            f"| {lr:g} | {bs} | {norm} | {len(rs)} | {_pct([r['final_top1'] for r in rs])} | "
            f"{_pct([r['best_top1'] for r in rs])} | {mark} | {_mean([r.get('mean_grad_cv') for r in rs])} | "
            f"{_mean([r.get('mean_starved_frac') for r in rs])} |"
        )
    lines += ["", "## Settings", ""]
    lines += [f"- {k}: `{v}`" for k, v in settings.items()]
    if commands:
        lines += ["", "Command(s) that produced these cells:", ""]
        lines += [f"    {c}" for c in commands]
    lines += ["", f"{len(records)} cells; per-cell rows in `results.csv`, TensorBoard runs in `tb/`.", ""]
    return "\n".join(lines)


def _figure(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    norms = sorted({r["norm"] for r in records}, key=lambda n: (NORM_ORDER.get(n, 9), n))
    configs = sorted({(r["lr"], r["batch_size"]) for r in records})
    lrs = sorted({r["lr"] for r in records})
    fig, (ax_acc, *ax_curves) = plt.subplots(
        1, 1 + len(lrs), figsize=(4.5 + 4 * len(lrs), 4.2), squeeze=True, constrained_layout=True
    )
    width = 0.8 / max(1, len(norms))
    for j, norm in enumerate(norms):
        for i, (lr, bs) in enumerate(configs):
            rs = [r for r in records if r["norm"] == norm and r["lr"] == lr and r["batch_size"] == bs]
            if not rs:
                continue
            vals = [100 * (r["final_top1"] if math.isfinite(r["final_top1"]) else 0.0) for r in rs]
            mean = statistics.fmean(vals)
            std = statistics.stdev(vals) if len(vals) > 1 else 0.0
            x = i + (j - (len(norms) - 1) / 2) * width
            ax_acc.bar(x, mean, width, yerr=std, color=NORM_COLOURS.get(norm), label=norm if i == 0 else None)
            if any(r["diverged"] for r in rs):
                ax_acc.text(x, mean + std + 0.5, "x", ha="center", color="red", fontweight="bold")
    ax_acc.set_xticks(range(len(configs)), [f"lr {lr:g}\nbs {bs}" for lr, bs in configs], fontsize=8)
    ax_acc.set_ylabel("final val top-1 (%)")
    ax_acc.set_title("accuracy per cell (red x: diverged)")
    ax_acc.legend(fontsize=8)
    styles = ["-", "--", ":", "-."]
    sizes = sorted({r["batch_size"] for r in records})
    for ax, lr in zip(ax_curves, lrs):
        for r in records:
            if r["lr"] != lr or not r.get("curves", {}).get("train_loss"):
                continue
            steps, losses = zip(*r["curves"]["train_loss"])
            ax.plot(steps, losses, color=NORM_COLOURS.get(r["norm"]), lw=1, alpha=0.8,
                    ls=styles[sizes.index(r["batch_size"]) % len(styles)])
            if r["diverged"]:
                finite = [(s, v) for s, v in zip(steps, losses) if math.isfinite(v)]
                if finite:
                    ax.plot(*finite[-1], "x", color="red", ms=8)
        ax.set_title(f"training loss, lr {lr:g}")
        ax.set_xlabel("optimizer step")
        finite = [v for r in records if r["lr"] == lr for _, v in r.get("curves", {}).get("train_loss", [])
                  if math.isfinite(v) and v > 0]
        if finite and max(finite) / min(finite) > 20:  # blow-ups: log scale keeps the rest readable
            ax.set_yscale("log")
        handles = [plt.Line2D([], [], color=NORM_COLOURS.get(n), label=n) for n in norms]
        handles += [plt.Line2D([], [], color="k", ls=styles[i % len(styles)], label=f"bs {b}")
                    for i, b in enumerate(sizes)]
        ax.legend(handles=handles, fontsize=7)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def write_outputs(out: Path, settings: dict[str, Any], command: str) -> list[dict[str, Any]]:
    """Rebuild ``results.csv``, ``results.md`` and ``results.png`` from the finished cells."""
    records = load_records(out)
    write_atomic(out / "results.csv", _csv(records))
    commands = list(dict.fromkeys(r["command"] for r in records if r.get("command")))
    write_atomic(out / "results.md", _markdown(records, settings, commands or [command]))
    png = out / "results.png"
    newest = max(((out / "cells" / f"{r['cell']}.json").stat().st_mtime for r in records), default=0.0)
    if records and (not png.exists() or png.stat().st_mtime < newest):
        _figure(records, png)
    return records
