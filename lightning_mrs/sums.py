"""What a monitor accumulates per layer and logs from it, declared once: :class:`Sums` and :class:`Figure`.

A monitor's per-layer statistics are a frozen dataclass of tensors, each field declared as added
(:func:`sum_field`) or maximised (:func:`max_field`) over calls, micro-batches and ranks; this
module gives them zeros, device moves, ``+`` and the split by reduction (one collective per kind).
What is logged is a table of :class:`Figure` (a formula on the sums, and how ``<prefix>/all``
pools it over layers, :func:`pool`). Needs only torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import lru_cache
from typing import Any, Callable, Iterable, Mapping, Optional, TypeVar

import torch
from torch import Tensor

__all__ = ["POOL", "Figure", "Sums", "max_field", "pool", "sum_field"]

S = TypeVar("S", bound="Sums")


def sum_field(vector: bool = False) -> Any:
    """A field of a :class:`Sums` that adds over calls, micro-batches and ranks (``vector``: one
    entry per unit of the layer, e.g. a phasor or a head; else 0-d)."""
    return field(metadata={"reduce": "sum", "vector": vector})


def max_field() -> Any:
    """A 0-d field of a :class:`Sums` that takes the maximum instead (0 is its empty value)."""
    return field(metadata={"reduce": "max", "vector": False})


class Sums:
    """One layer's accumulated statistics: a frozen dataclass of tensors declared with
    :func:`sum_field` / :func:`max_field`. Zeros, device moves, ``+`` and the split by reduction
    (:meth:`reduced_by`, one collective per kind) come from here; a monitor declares only its fields.

    Example:
        >>> @dataclass(frozen=True)
        ... class Peak(Sums):
        ...     total: Tensor = sum_field()
        ...     peak: Tensor = max_field()
        >>> both = Peak(torch.tensor(1.0), torch.tensor(5.0)) + Peak(torch.tensor(2.0), torch.tensor(3.0))
        >>> both.total.item(), both.peak.item(), Peak.reduced_by("max")
        (3.0, 5.0, ('peak',))
    """

    def __post_init__(self) -> None:
        vector_shape = None
        for name, _, vector in _spec(type(self)):
            shape = getattr(self, name).shape
            if len(shape) != vector or (vector and vector_shape not in (None, shape)):
                shapes = {f: (v, tuple(getattr(self, f).shape)) for f, _, v in _spec(type(self))}
                raise ValueError(
                    f"{type(self).__name__}: " + ", ".join(k for k, (v, _) in shapes.items() if v) + " must be "
                    "vectors of one length and " + ", ".join(k for k, (v, _) in shapes.items() if not v) + " 0-d; got "
                    + ", ".join(f"{k} {shape}" for k, (_, shape) in shapes.items()) + ".")
            vector_shape = shape if vector else vector_shape

    @classmethod
    def reduced_by(cls, op: str) -> tuple[str, ...]:
        """The fields that combine with ``op`` (``"sum"`` or ``"max"``)."""
        return tuple(name for name, maxed, _ in _spec(cls) if ("max" if maxed else "sum") == op)

    @classmethod
    def zeros(cls: type[S], size: int = 0, *, dtype: torch.dtype = torch.float64,
              device: Optional[torch.device] = None) -> S:
        """Empty sums with vector fields of ``size`` entries (the start of an accumulation)."""
        return cls(*(torch.zeros((size,) if vector else (), dtype=dtype, device=device) for _, _, vector in _spec(cls)))

    def as_dict(self) -> dict[str, Tensor]:
        """Field name -> tensor."""
        return {name: getattr(self, name) for name, _, _ in _spec(type(self))}

    def to(self: S, *args: Any, **kwargs: Any) -> S:
        """Every field through ``Tensor.to(*args, **kwargs)``."""
        return self._like(getattr(self, name).to(*args, **kwargs) for name, _, _ in _spec(type(self)))

    def __add__(self: S, other: S) -> S:
        if type(other) is not type(self):
            return NotImplemented
        return self._like(torch.maximum(getattr(self, name), getattr(other, name)) if maxed
                          else getattr(self, name) + getattr(other, name) for name, maxed, _ in _spec(type(self)))

    def _like(self: S, values: Iterable[Tensor]) -> S:
        """Sums of this class from field values in declaration order, unchecked: ``+`` and ``to`` keep
        checked shapes, and a hook adds often (``__post_init__`` checks a monitor's own sums)."""
        out = object.__new__(type(self))
        for (name, _, _), value in zip(_spec(type(self)), values):
            object.__setattr__(out, name, value)  # as a frozen dataclass's __init__ does
        return out


@lru_cache(maxsize=None)
def _spec(cls: type) -> tuple[tuple[str, bool, bool], ...]:
    """``(name, taken with max, vector)`` of each field of a :class:`Sums` class (read once: a hook adds often)."""
    return tuple((f.name, f.metadata["reduce"] == "max", f.metadata["vector"]) for f in fields(cls))


#: how ``<prefix>/all`` pools a figure over the layers that have it
POOL: dict[str, Callable[[list[float]], float]] = {
    "mean": lambda values: torch.tensor(values, dtype=torch.float64).mean().item(),
    "max": max,
    "sum": sum,
}


@dataclass(frozen=True)
class Figure:
    """A logged figure of a layer: its formula on the layer's :class:`Sums` and how ``<prefix>/all``
    pools it over layers (a key of :data:`POOL`).

    Attributes:
        formula: sums -> 0-d tensor, on their device.
        over_layers: ``"mean"``, ``"max"`` or ``"sum"`` over the layers that have the figure.
        needs: a count field that must be ``> 0`` for the figure to mean something (``None``: always).
    """

    formula: Callable[[Any], Tensor]
    over_layers: str = "mean"
    needs: Optional[str] = None


def pool(table: Mapping[str, Figure], rows: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """``<prefix>/all``: each figure of ``table`` pooled over the ``rows`` (per-layer figures on the
    host) that have it.

    Example:
        >>> pool({"a": Figure(len, "max"), "b": Figure(len, "mean")}, [{"a": 1.0, "b": 2.0}, {"a": 3.0}])
        {'a': 3.0, 'b': 2.0}
    """
    rows = list(rows)
    out = {}
    for name, figure in table.items():
        values = [row[name] for row in rows if name in row]
        if values:
            out[name] = POOL[figure.over_layers](values)
    return out
