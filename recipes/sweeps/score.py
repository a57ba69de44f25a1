"""What a sweep scores a cell by: final top-1 (image sweeps) or validation bits per byte (language models).

A :class:`Score` says which value of a cell counts, whether higher or lower is better, what a
diverged cell counts as (chance top-1; 8 bits per byte, the cross-entropy of a uniform guess over
the 256 byte values), and how its numbers are written. The robustness table, the per-cell table
and the progress line read a kind's score; the claims of a kind use it too. Needs no torch.

Example:
    >>> from recipes.sweeps.records import Row
    >>> row = Row("mrs", 0.1, 32, 0, diverged=True, metrics={"final_bpb": None})
    >>> BPB.counted(row), BPB.near(2.2, best=2.0), TOP1.near(0.85, best=0.9)
    (8.0, True, True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

from recipes.sweeps.records import Row, accuracy, chance

__all__ = ["BPB", "DIVERGED_BPB", "NEAR_FRACTION", "TOP1", "Score"]

#: "still works" / "within" the best: 90 % of the best top-1, 10 % above the best bits per byte
NEAR_FRACTION = 0.1
#: a diverged language-model cell counts as a uniform guess over 256 bytes: log2(256) bits per byte
DIVERGED_BPB = 8.0


@dataclass(frozen=True)
class Score:
    """How a kind scores a cell.

    Attributes:
        key: the short name in column names (``top1``: ``best_top1``; ``bpb``: ``best_bpb``).
        label: the score in prose (``top-1``, ``val bpb``).
        higher_is_better: top-1 yes, bits per byte no.
        final: the cell's final value as counted (a diverged cell: its ``worst``), NaN when unknown.
        best: the cell's best validation value (before any divergence), ``None`` when unknown.
        worst: what a diverged cell counts as (chance top-1, 8 bits per byte); values are clipped to it.
        scale: display factor (100 for top-1 in %); unit: the unit after a number (``%``, `` bpb``).
        diverged_text: how the report states the divergence rule.
        near_text: how the report states "within 10 % of the best".
    """

    key: str
    label: str
    higher_is_better: bool
    final: Callable[[Row], float]
    best: Callable[[Row], Optional[float]]
    worst: Callable[[Row], float]
    scale: float
    unit: str
    diverged_text: str
    near_text: str
    digits: int = 2

    def counted(self, row: Row) -> float:
        """The final value, a diverged cell at ``worst``, every cell clipped at ``worst`` (NaN: unknown)."""
        value, worst = self.final(row), self.worst(row)
        if not math.isfinite(value):
            return math.nan
        if not math.isfinite(worst):
            return value
        return max(value, worst) if self.higher_is_better else min(value, worst)

    def gap(self, best: float, value: float) -> float:
        """How far ``value`` falls short of ``best`` (>= 0 for values no better than ``best``)."""
        return best - value if self.higher_is_better else value - best

    def better(self, values: dict) -> object:
        """The key of the best value (ties: the smallest key, e.g. the smaller lr)."""
        sign = 1 if self.higher_is_better else -1
        return max(values, key=lambda k: (sign * values[k], -k))

    def near(self, value: float, best: float) -> bool:
        """Whether ``value`` is within :data:`NEAR_FRACTION` of ``best``."""
        if self.higher_is_better:
            return value >= (1 - NEAR_FRACTION) * best
        return value <= (1 + NEAR_FRACTION) * best

    def show(self, value: Optional[float]) -> str:
        """``value`` in display units, without the unit."""
        if value is None or not math.isfinite(value):
            return "nan"
        return f"{self.scale * value:.{self.digits}f}"


def _bpb_final(row: Row) -> float:
    if row.diverged:
        return DIVERGED_BPB
    value = row.metrics.get("final_bpb")
    return value if value is not None and math.isfinite(value) else math.nan


def _best_top1(row: Row) -> Optional[float]:
    return row.best_top1


def _best_bpb(row: Row) -> Optional[float]:
    return row.metrics.get("best_bpb")


def _diverged_bpb(row: Row) -> float:
    return DIVERGED_BPB


# module-level functions, not lambdas: a kind and its score pickle into the --jobs workers
TOP1 = Score(
    key="top1", label="top-1", higher_is_better=True, final=accuracy, best=_best_top1, worst=chance,
    scale=100.0, unit=" %", diverged_text="a diverged seed counts as chance",
    near_text=f"still reaching {100 * (1 - NEAR_FRACTION):.0f} % of",
)
BPB = Score(
    key="bpb", label="val bpb", higher_is_better=False, final=_bpb_final, best=_best_bpb,
    worst=_diverged_bpb, scale=1.0, unit=" bpb",
    diverged_text=f"a diverged seed counts as {DIVERGED_BPB:g} bits per byte (a uniform guess over the 256 byte "
                  "values), and every cell is capped there",
    near_text=f"within {100 * NEAR_FRACTION:.0f} % (bpb at most {1 + NEAR_FRACTION:g} x) of", digits=3,
)
