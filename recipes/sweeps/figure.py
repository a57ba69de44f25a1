"""The parts every sweep's ``results.png`` is drawn with: one line per arm against the learning rate.

Line: mean over seeds; band: min to max over seeds; a red ``x`` on a point where at least one
seed diverged. The kinds lay their panels out (:mod:`recipes.sweeps.kinds.norm`, :mod:`recipes.sweeps.kinds.qk`).
Needs matplotlib (Agg), no torch.
"""

from __future__ import annotations

import math
import os
import statistics
import textwrap
from pathlib import Path
from typing import Any, Callable, Optional

from recipes.sweeps.records import Row, arm_key, chance, distinct_lrs, select

__all__ = ["COLOURS", "chance_line", "lines", "lr_axis", "pyplot", "save"]

COLOURS = {"layer": "tab:blue", "rms": "tab:orange", "mrs": "tab:green", "batch": "tab:gray", "none": "tab:red",
           "rms-half": "tab:brown", "mrs-half": "tab:olive", "rms-half-safe": "tab:pink", "mrs-half-safe": "tab:cyan"}
_TITLE_PT = 10
_CHAR_WIDTH_IN = 0.6 * _TITLE_PT / 72  # an average character of the title font, in inches


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def lines(ax: Any, rows: list[Row], bs: int, value: Callable[[Row], Optional[float]], scale: float = 1.0) -> None:
    """One line per arm of ``value`` (times ``scale``) against lr at batch size ``bs``: mean, min-max band."""
    for arm in sorted({r.arm for r in rows}, key=arm_key):
        xs, mean, low, high, bad = [], [], [], [], []
        for lr in distinct_lrs(rows):
            cells = select(rows, lr=lr, batch_size=bs, arm=arm)
            values = [scale * v for v in map(value, cells) if v is not None and math.isfinite(v)]
            if not values:
                continue
            xs.append(lr)
            mean.append(statistics.fmean(values))
            low.append(min(values))
            high.append(max(values))
            if any(r.diverged for r in cells):
                bad.append((lr, mean[-1]))
        colour = COLOURS.get(arm)
        ax.plot(xs, mean, "-o", color=colour, ms=3.5, lw=1.6, label=arm)
        ax.fill_between(xs, low, high, color=colour, alpha=0.18, lw=0)
        if bad:
            ax.plot(*zip(*bad), "x", color="red", ms=9, mew=2, zorder=5)


def lr_axis(ax: Any, lrs: list[float]) -> None:
    ax.set_xscale("log")
    ax.set_xticks(lrs, [f"{lr:g}" for lr in lrs], fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel("peak learning rate")
    ax.grid(alpha=0.3)


def chance_line(ax: Any, rows: list[Row], lrs: list[float]) -> None:
    for c in {chance(r) for r in rows if math.isfinite(chance(r))}:
        ax.axhline(100 * c, color="k", ls=":", lw=1)
        ax.text(lrs[-1], 100 * c + 1, "chance", fontsize=8, va="bottom", ha="right")


def save(plt: Any, fig: Any, handles: list, labels: list[str], title: str, path: Path, diverged: bool = True) -> None:
    """Title (wrapped to the figure's width, so a one-panel figure keeps all of it), legend (``diverged``: with
    the divergence mark), atomic save."""
    if diverged:
        handles = handles + [plt.Line2D([], [], color="red", marker="x", ls="", mew=2)]
        labels = labels + ["a seed diverged"]
    width_in = fig.get_size_inches()[0]
    fig.suptitle(textwrap.fill(title, max(20, int(0.9 * width_in / _CHAR_WIDTH_IN))), fontsize=_TITLE_PT)
    columns = max(1, min(len(handles), int(width_in / 1.1)))  # a legend entry needs about 1.1 inches
    fig.legend(handles, labels, fontsize=8, loc="outside lower center", ncol=columns, frameon=False)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
