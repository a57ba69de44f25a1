"""``results.png``: final top-1 against learning rate, one line per norm, one panel per batch size.

Line: mean over seeds; band: min to max over seeds; a red ``x`` on a point where at least one
seed diverged (it counts as chance, :func:`recipes.stress_rows.accuracy`); dotted line: chance;
grey span: the paper's learning rates (0.1 to 0.4). Needs matplotlib (Agg), no torch.
"""

from __future__ import annotations

import math
import os
import statistics
from pathlib import Path
from typing import Any

from recipes.stress_rows import accuracy, chance, distinct_lrs, select

__all__ = ["NORM_COLOURS", "figure"]

NORM_COLOURS = {"layer": "tab:blue", "rms": "tab:orange", "mrs": "tab:green", "batch": "tab:gray"}
_NORM_ORDER = ("layer", "rms", "mrs", "batch")
_PAPER_SPAN = (0.1, 0.4)


def figure(rows: list[dict[str, Any]], path: Path) -> None:
    """Draw the figure of ``rows`` (typed ``results.csv`` rows) into ``path`` (written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["batch_size"] for r in rows})
    norms = sorted({r["norm"] for r in rows}, key=lambda n: (_NORM_ORDER.index(n) if n in _NORM_ORDER else 9, n))
    all_lrs = distinct_lrs(rows)
    seeds = sorted({r["seed"] for r in rows})
    fig, axes = plt.subplots(1, len(sizes), figsize=(0.8 + 3.9 * len(sizes), 3.9), sharey=True, squeeze=False,
                             constrained_layout=True)
    for ax, bs in zip(axes[0], sizes):
        ax.axvspan(*_PAPER_SPAN, color="0.93", zorder=0)
        for norm in norms:
            xs, mean, low, high, bad = [], [], [], [], []
            for lr in all_lrs:
                cells = select(rows, norm=norm, lr=lr, batch_size=bs)
                accs = [100 * a for a in map(accuracy, cells) if math.isfinite(a)]
                if not accs:
                    continue
                xs.append(lr)
                mean.append(statistics.fmean(accs))
                low.append(min(accs))
                high.append(max(accs))
                if any(r["diverged"] for r in cells):
                    bad.append((lr, mean[-1]))
            colour = NORM_COLOURS.get(norm)
            ax.plot(xs, mean, "-o", color=colour, ms=3.5, lw=1.6, label=norm)
            ax.fill_between(xs, low, high, color=colour, alpha=0.18, lw=0)
            if bad:
                ax.plot(*zip(*bad), "x", color="red", ms=9, mew=2, zorder=5)
        ks = {chance(r) for r in rows if math.isfinite(chance(r))}
        for c in ks:
            ax.axhline(100 * c, color="k", ls=":", lw=1)
            ax.text(all_lrs[-1], 100 * c + 1, "chance", fontsize=8, va="bottom", ha="right")
        ax.set_xscale("log")
        ax.set_xticks(all_lrs, [f"{lr:g}" for lr in all_lrs], fontsize=8)
        ax.minorticks_off()
        ax.set_title(f"batch {bs}")
        ax.set_xlabel("peak learning rate")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("final validation top-1 (%)")
    axes[0][0].set_ylim(bottom=0, top=100)
    handles, labels = axes[0][0].get_legend_handles_labels()
    handles += [plt.Line2D([], [], color="red", marker="x", ls="", mew=2),
                plt.Rectangle((0, 0), 1, 1, color="0.93")]
    labels += ["a seed diverged (= chance)", "paper's lrs"]
    fig.suptitle(f"Final top-1 vs learning rate: mean over {len(seeds)} seed(s), band = min-max", fontsize=10)
    fig.legend(handles, labels, fontsize=8, loc="outside lower center", ncol=len(handles), frameon=False)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
