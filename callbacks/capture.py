"""Helpers every monitor's capture shares: the flat collective, the sums' dtype, warnings.

A monitor's capture (``Capture`` of ``GradientHomogeneityMonitor``, ``AttentionCapture`` of
``AttentionMonitor``, ``OutlierCapture`` of ``OutlierMonitor``) collects named tensors on the
device during a logging step. :func:`apply_flat` runs one operation on all of them at once
(the step's collective, its device-to-host copy) and hands them back by name;
:func:`reduce_over_ranks` is that collective, a sum or a maximum over ranks;
:func:`sums_dtype` is the dtype they accumulate in; a hook reports a problem through a
:data:`Warn` (:func:`no_warning` drops it).

Example:
    >>> import torch
    >>> out = apply_flat({"a": torch.ones(2), "b": torch.tensor(3.0)}, lambda t: t * 2)
    >>> out["a"].tolist(), out["b"].item()
    ([2.0, 2.0], 6.0)
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Mapping, Optional, TypeVar

import torch
from torch import Tensor

__all__ = ["Warn", "apply_flat", "display_name", "eager_while_capturing", "no_warning", "reduce_over_ranks",
           "sums_dtype", "to_host"]

Warn = Callable[[str, str], None]  # (once-key, message)
K = TypeVar("K", bound=Hashable)


def apply_flat(named: Mapping[K, Tensor], fn: Callable[[Tensor], Tensor], dtype: Optional[torch.dtype] = None) -> dict[K, Tensor]:
    """Run ``fn`` once on every tensor of ``named``, concatenated, and hand them back by name.

    One collective (``fn = strategy.reduce``) or one device-to-host copy (``fn = Tensor.cpu``)
    serves any number of named tensors; only this function knows where each one lies in the
    flat vector.

    Args:
        named: name -> tensor, any shapes, all on one device.
        fn: an element-wise-preserving map of a flat vector (same length out).
        dtype: the dtype of the flat vector (default: the first tensor's).

    Returns:
        name -> ``fn``'s output for that tensor, in its original shape.

    Example:
        >>> out = apply_flat({"a": torch.ones(2), "b": torch.tensor(3.0)}, lambda t: t * 2)
        >>> out["a"].tolist(), out["b"].item()
        ([2.0, 2.0], 6.0)
    """
    values = list(named.values())
    if not values:
        return {}
    dtype = dtype or values[0].dtype
    flat = fn(torch.cat([v.reshape(-1).to(dtype) for v in values]))  # (sum of numels,)
    parts = flat.split([v.numel() for v in values])
    return {key: part.reshape(v.shape) for (key, v), part in zip(named.items(), parts)}


def to_host(named: Mapping[K, Tensor], dtype: torch.dtype) -> dict[K, Tensor]:
    """:func:`apply_flat` to the CPU in ``dtype``: concatenated on the device in its widest float
    (:func:`sums_dtype`), one device-to-host copy, then the cast (MPS has no float64).

    Example:
        >>> to_host({"n": torch.tensor(3), "s": torch.ones(2)}, torch.float64)["s"].dtype
        torch.float64
    """
    values = list(named.values())
    if not values:
        return {}
    return apply_flat(named, lambda flat: flat.cpu().to(dtype), dtype=sums_dtype(values[0].device))


def display_name(name: str) -> str:
    """A layer's name as the monitors log it: without ``torch.compile``'s ``_orig_mod`` step, so
    that a compiled run's tags are the eager run's."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


class _EagerStance:
    """While any monitor's capture is open, compiled code runs eagerly.

    Hooks registered after ``torch.compile`` traced a module are not called by the compiled code
    (dynamo does not guard on hooks), so a capture's hooks would see nothing. The logging batch
    therefore runs with ``torch.compiler.set_stance("force_eager")`` (compiled graphs are kept and
    used again from the next batch); the previous stance comes back when the last capture closes.
    """

    def __init__(self) -> None:
        self._depth = 0
        self._stance: Any = None

    def enter(self) -> None:
        if self._depth == 0 and hasattr(torch.compiler, "set_stance"):
            self._stance = torch.compiler.set_stance("force_eager")  # set now; holds the previous stance
        self._depth += 1

    def exit(self) -> None:
        if self._depth == 0:
            return
        self._depth -= 1
        if self._depth == 0 and self._stance is not None:
            self._stance.__exit__(None, None, None)  # back to the stance before the first capture
            self._stance = None


#: the one stance guard of the process (several monitors may capture in the same batch)
eager_while_capturing = _EagerStance()


def no_warning(key: str, message: str) -> None:
    """The default ``warn`` of a capture: problems met in a hook are dropped."""


def sums_dtype(device: torch.device) -> torch.dtype:
    """The dtype a capture accumulates its sums in on ``device``."""
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


def reduce_over_ranks(strategy: Any, flat: Tensor, op: str) -> Tensor:
    """``op`` (``"sum"`` or ``"max"``) over ranks through ``strategy.reduce``; a strategy that
    only sums (XLA) gives the maximum through one ``all_gather`` instead."""
    if op == "sum":
        return strategy.reduce(flat, reduce_op="sum")
    try:
        return strategy.reduce(flat, reduce_op=torch.distributed.ReduceOp.MAX if torch.distributed.is_available()
                               else "max")
    except ValueError:
        return strategy.all_gather(flat).reshape(-1, flat.numel()).amax(dim=0)  # (world, n) -> (n,)
