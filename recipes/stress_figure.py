"""``results.png``: the sweep's figures against the learning rate, one line per arm (norm or QK-norm).

Line: mean over seeds; band: min to max over seeds; a red ``x`` on a point where at least one
seed diverged. Needs matplotlib (Agg), no torch.

* :func:`figure` (``norm`` sweep): final top-1 against lr, one panel per batch size; a diverged
  seed counts as chance (:func:`recipes.stress_rows.accuracy`); dotted line: chance; grey
  span: the paper's learning rates (0.1 to 0.4).
* :func:`qk_figure` (``qk`` sweep): per batch size a row of two panels, final top-1 and the
  largest attention logit over training (``max_logit``, log scale; a diverged seed's value is
  the largest logged before the divergence), against lr.
"""

from __future__ import annotations

import math
import os
import statistics
from pathlib import Path
from typing import Any, Callable, Optional

from recipes.stress_rows import accuracy, arm_key, chance, distinct_lrs, select

__all__ = ["NORM_COLOURS", "figure", "qk_figure"]

NORM_COLOURS = {"layer": "tab:blue", "rms": "tab:orange", "mrs": "tab:green", "batch": "tab:gray",
                "none": "tab:red"}
_PAPER_SPAN = (0.1, 0.4)
_PAPER_COLOUR = "#fdf1c7"  # a pale yellow: apart from the grey of the BatchNorm reference


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _arms(rows: list[dict[str, Any]], by: str) -> list[str]:
    return sorted({r[by] for r in rows}, key=arm_key)


def _lines(ax: Any, rows: list[dict[str, Any]], by: str, bs: int, value: Callable[[dict[str, Any]], Optional[float]],
           scale: float = 1.0) -> None:
    """One line per arm of ``value`` (times ``scale``) against lr at batch size ``bs``: mean, min-max band."""
    for arm in _arms(rows, by):
        xs, mean, low, high, bad = [], [], [], [], []
        for lr in distinct_lrs(rows):
            cells = select(rows, lr=lr, batch_size=bs, **{by: arm})
            values = [scale * v for v in map(value, cells) if v is not None and math.isfinite(v)]
            if not values:
                continue
            xs.append(lr)
            mean.append(statistics.fmean(values))
            low.append(min(values))
            high.append(max(values))
            if any(r["diverged"] for r in cells):
                bad.append((lr, mean[-1]))
        colour = NORM_COLOURS.get(arm)
        ax.plot(xs, mean, "-o", color=colour, ms=3.5, lw=1.6, label=arm)
        ax.fill_between(xs, low, high, color=colour, alpha=0.18, lw=0)
        if bad:
            ax.plot(*zip(*bad), "x", color="red", ms=9, mew=2, zorder=5)


def _lr_axis(ax: Any, lrs: list[float]) -> None:
    ax.set_xscale("log")
    ax.set_xticks(lrs, [f"{lr:g}" for lr in lrs], fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel("peak learning rate")
    ax.grid(alpha=0.3)


def _chance_line(ax: Any, rows: list[dict[str, Any]], lrs: list[float]) -> None:
    for c in {chance(r) for r in rows if math.isfinite(chance(r))}:
        ax.axhline(100 * c, color="k", ls=":", lw=1)
        ax.text(lrs[-1], 100 * c + 1, "chance", fontsize=8, va="bottom", ha="right")


def _save(plt: Any, fig: Any, handles: list, labels: list[str], title: str, path: Path) -> None:
    handles = handles + [plt.Line2D([], [], color="red", marker="x", ls="", mew=2)]
    labels = labels + ["a seed diverged"]
    fig.suptitle(title, fontsize=10)
    fig.legend(handles, labels, fontsize=8, loc="outside lower center", ncol=len(handles), frameon=False)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def figure(rows: list[dict[str, Any]], path: Path) -> Any:
    """Draw the ``norm`` sweep's figure of ``rows`` (typed ``results.csv`` rows) into ``path`` (atomically).

    Returns the panels (matplotlib axes, one row), closed but readable.
    """
    plt = _pyplot()
    sizes = sorted({r["batch_size"] for r in rows})
    all_lrs = distinct_lrs(rows)
    seeds = sorted({r["seed"] for r in rows})
    fig, axes = plt.subplots(1, len(sizes), figsize=(0.8 + 3.9 * len(sizes), 3.9), sharey=True, squeeze=False,
                             constrained_layout=True)
    for ax, bs in zip(axes[0], sizes):
        ax.axvspan(*_PAPER_SPAN, color=_PAPER_COLOUR, zorder=0)
        _lines(ax, rows, "norm", bs, accuracy, scale=100)
        _chance_line(ax, rows, all_lrs)
        _lr_axis(ax, all_lrs)
        ax.set_title(f"batch {bs}")
    axes[0][0].set_ylabel("final validation top-1 (%)")
    axes[0][0].set_ylim(bottom=0, top=100)
    handles, labels = axes[0][0].get_legend_handles_labels()
    _save(plt, fig, [*handles, plt.Rectangle((0, 0), 1, 1, color=_PAPER_COLOUR)], [*labels, "paper's lrs"],
          f"Final top-1 vs learning rate: mean over {len(seeds)} seed(s), band = min-max; a diverged seed = chance",
          path)
    return axes


def qk_figure(rows: list[dict[str, Any]], path: Path) -> Any:
    """Draw the ``qk`` sweep's figure (top-1 and max attention logit against lr) into ``path`` (atomically).

    Returns the panels (matplotlib axes: a row per batch size, two columns), closed but readable.
    """
    plt = _pyplot()
    sizes = sorted({r["batch_size"] for r in rows})
    all_lrs = distinct_lrs(rows)
    seeds = sorted({r["seed"] for r in rows})
    fig, axes = plt.subplots(len(sizes), 2, figsize=(9.5, 0.6 + 3.6 * len(sizes)), squeeze=False,
                             constrained_layout=True)
    for (top, logit), bs in zip(axes, sizes):
        _lines(top, rows, "qk_norm", bs, accuracy, scale=100)
        _chance_line(top, rows, all_lrs)
        top.set_ylim(bottom=0, top=100)
        top.set_ylabel("final validation top-1 (%)")
        top.set_title(f"final top-1 (batch {bs}; a diverged seed = chance)", fontsize=9)
        _lines(logit, rows, "qk_norm", bs, lambda r: r.get("max_logit"))
        logit.set_yscale("log")
        logit.set_ylabel("max attention logit over training")
        logit.set_title(f"largest |attention logit| (batch {bs}; worst layer)", fontsize=9)
        for ax in (top, logit):
            _lr_axis(ax, all_lrs)
    handles, labels = axes[0][0].get_legend_handles_labels()
    _save(plt, fig, handles, labels,
          f"QK-norm stress: mean over {len(seeds)} seed(s), band = min-max", path)
    return axes
