"""What every monitor's capture shares: its hooks' life, the guarded add, the reduction, the metrics.

A monitor's capture (a :class:`LayerCapture`) holds the hooks of one logging step and the
per-layer :class:`~lightning_mrs.sums.Sums` they add up; :meth:`LayerCapture.reduced` reduces them
over ranks (:func:`reduce_over_ranks`), :func:`layer_metrics` turns them into the logged metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Generic, Hashable, Mapping, Optional, Sequence, TypeVar

import torch
from torch import Tensor, nn

from lightning_mrs.sums import Figure, Sums, pool

__all__ = ["Layer", "LayerCapture", "Warn", "apply_flat", "display_name", "eager_while_capturing", "layer_metrics",
           "no_warning", "reduce_over_ranks", "sums_dtype", "to_host"]

Warn = Callable[[str, str], None]  # (once-key, message)
Reduce = Callable[[Tensor, str], Tensor]  # (flat tensor, "sum" | "max") -> reduced over ranks
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


@dataclass
class Layer:
    """A layer under watch: its qualified name (as logged) and the module."""

    name: str
    module: nn.Module


LayerT = TypeVar("LayerT", bound=Layer)


class LayerCapture(Generic[LayerT]):
    """The hooks of logging step ``step`` on ``layers`` and the per-layer sums they add up.

    A subclass sets :attr:`owner`, gives each layer's empty sums (:meth:`_zeros`) and registers its
    hooks (:meth:`_hooks`), which hand their sums to :meth:`add`. The monitor arms the capture for
    each (micro-)batch of the logging step (and, for a forward-only monitor, disarms it after the
    training forward); :meth:`close` ends it.

    Attributes:
        sums: layer name -> the sums so far (calls, micro-batches and backward passes add up).
        stepped: an optimizer step happened since the capture opened.
    """

    owner: ClassVar[str]

    def __init__(self, layers: list[LayerT], step: int, device: torch.device, warn: Warn = no_warning) -> None:
        self.layers, self.step, self._warn = layers, step, warn
        self.sums = {layer.name: self._zeros(layer, dtype=sums_dtype(device), device=device) for layer in layers}
        self.stepped = False
        self._handles: list[Any] = []

    def _zeros(self, layer: LayerT, **kwargs: Any) -> Sums:
        """The empty sums of ``layer`` (``kwargs``: dtype and device)."""
        raise NotImplementedError

    def _hooks(self, layer: LayerT) -> list[Any]:
        """Register the hooks of ``layer``; their handles."""
        raise NotImplementedError

    def arm(self) -> None:
        """Register the hooks. Idempotent."""
        if not self._handles:
            self._handles = [handle for layer in self.layers for handle in self._hooks(layer)]

    def disarm(self) -> None:
        """Remove every hook: the one place that does. Idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def close(self) -> None:
        """End the capture (the logging step is over or dropped)."""
        self.disarm()

    def add(self, layer: LayerT, compute: Callable[[], Sums]) -> None:
        """Add ``compute()`` to ``layer``'s sums; an error warns (once per layer) instead of breaking training."""
        try:
            total = self.sums[layer.name]
            self.sums[layer.name] = total + compute().to(next(iter(total.as_dict().values())))
        except Exception as err:  # noqa: BLE001 - a statistic must never break training
            self._warn(f"hook:{layer.name}", f"{self.owner}: layer {layer.name or 'root'!r} "
                       f"({type(layer.module).__name__}) is not monitored on this step: {err}")

    def reduced(self, reduce: Reduce) -> dict[str, Sums]:
        """The sums after ``reduce`` (over ranks): one ``reduce(flat, op)`` per reduction kind."""
        out: dict[tuple[str, str], Tensor] = {}
        for op in ("sum", "max"):
            named = {(name, f): getattr(s, f) for name, s in self.sums.items() for f in s.reduced_by(op)}
            out.update(apply_flat(named, lambda flat, op=op: reduce(flat, op)))
        return {name: s._like(out[name, f] for f in s.as_dict()) for name, s in self.sums.items()}


def layer_metrics(tag: Callable[[str, str], str], layers: Sequence[LayerT], sums: Mapping[str, Sums],
                  table: Mapping[str, Figure], seen: str, figures_of: Callable[[LayerT], Sequence[str]],
                  per_layer: bool = True) -> dict[str, float]:
    """The per-layer figures ``tag(layer, figure)`` and their pool over layers ``tag("all", figure)``.

    The figures of each layer (those ``figures_of`` gives, formulas of ``table``) are computed on
    the sums' device and copied to the host once. A layer whose count ``seen`` is 0 (not called on
    this step) is left out, and so is a figure whose :attr:`~lightning_mrs.sums.Figure.needs` is 0.
    """
    on_device: dict[tuple[str, str], Tensor] = {}
    for layer in layers:
        s = sums[layer.name]
        on_device.update({(layer.name, f): table[f].formula(s) for f in figures_of(layer)})
        counts = {seen, *(table[f].needs for f in figures_of(layer) if table[f].needs)}
        on_device.update({(layer.name, count): getattr(s, count) for count in counts})
    host = {key: v.item() for key, v in to_host(on_device, torch.float64).items()}  # the one copy
    rows = {layer.name: {f: host[layer.name, f] for f in figures_of(layer)
                         if table[f].needs is None or host[layer.name, table[f].needs] > 0}
            for layer in layers if host[layer.name, seen] > 0}
    metrics = {tag(name, f): v for name, row in rows.items() for f, v in row.items()} if per_layer else {}
    metrics.update({tag("all", f): v for f, v in pool(table, rows.values()).items()})
    return metrics
