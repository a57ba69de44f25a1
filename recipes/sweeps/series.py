"""Reductions of a logged series ``[(step, value), ...]``: what the sweep kinds measure from a cell's logs.

Example:
    >>> finite_mean([(1, 2.0), (2, float("nan")), (3, 4.0)]), extreme([(1, 2.0), (3, 4.0)], max)
    (3.0, 4.0)
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

__all__ = ["MAX_CURVE_POINTS", "extreme", "finite_mean", "thin"]

MAX_CURVE_POINTS = 400

Series = Sequence[tuple[int, float]]


def finite_mean(points: Series) -> Optional[float]:
    """The mean of the finite values (``None`` without any)."""
    values = [v for _, v in points if math.isfinite(v)]
    return sum(values) / len(values) if values else None


def extreme(points: Series, pick: Callable[[list[float]], float]) -> Optional[float]:
    """``pick`` (``max``, ``min``) of the finite values (``None`` without any)."""
    values = [v for _, v in points if math.isfinite(v)]
    return pick(values) if values else None


def thin(points: Series, limit: int = MAX_CURVE_POINTS) -> list[list[float]]:
    """At most about ``limit`` evenly strided points, always with the last (where the run ended or diverged)."""
    stride = max(1, math.ceil(len(points) / limit))
    kept = list(points[::stride])
    if points and kept[-1] != points[-1]:
        kept.append(points[-1])
    return [[s, v] for s, v in kept]
