"""``AttentionMonitor``'s capture of one logging step, and the metrics dict it turns into.

An :class:`AttentionCapture` exists while a logging step runs. :meth:`AttentionCapture.arm`
registers a forward hook on the ``q_norm`` and ``k_norm`` of each watched layer;
:meth:`AttentionCapture.disarm` is the one place that removes them (the monitor disarms right
after the training forward, so validation and backward recomputation are never captured).
Once a layer's hooks have seen both its q and k, the pair is reduced at once to
:class:`~lightning_mrs.attention_stats.AttentionSums` (nothing is kept beyond the call);
calls, micro-batches and, through :meth:`AttentionCapture.reduced`, ranks add up.
:func:`step_metrics` computes the figures on the device, copies them to the host once and
names them ``z-layers/attention/<layer>/<stat>`` and ``attention/all/<stat>``.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from lightning_mrs.swap import AttentionInfo
    >>> attn = nn.Module()
    >>> attn.q_norm, attn.k_norm = nn.Identity(), nn.Identity()
    >>> layer = WatchedLayer("attn", attn, AttentionInfo(2, 4, 0.5, None))
    >>> capture = AttentionCapture([layer], step=0, device=torch.device("cpu"), max_queries=None)
    >>> capture.arm()
    >>> _ = attn.q_norm(torch.randn(3, 2, 5, 4)), attn.k_norm(torch.randn(3, 2, 5, 4))
    >>> capture.disarm()
    >>> sorted(step_metrics(capture.layers, capture.sums))[:2]
    ['attention/all/collapsed_frac', 'attention/all/entropy_mean']
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_mrs.attention_stats import (
    FIGURE_NAMES, AttentionSums, aggregate_figures, attention_figures, attention_sums,
)
from lightning_mrs.callbacks.capture import Warn, apply_flat, no_warning, sums_dtype, to_host
from lightning_mrs.callbacks.tb_layout import ATTENTION
from lightning_mrs.swap import AttentionInfo

__all__ = ["AttentionCapture", "WatchedLayer", "step_metrics"]

Reduce = Callable[[Tensor, str], Tensor]  # (flat tensor, "sum" | "max") -> reduced over ranks
_NORM_FIGURES = ("q_norm_mean", "k_norm_mean")


@dataclass
class WatchedLayer:
    """An attention layer under watch: its qualified name, the module and its ``AttentionInfo``."""

    name: str
    module: nn.Module
    info: AttentionInfo


class AttentionCapture:
    """The per-layer sums of logging step ``step``, and the hooks that collect them.

    Args:
        layers: the layers to watch (names unique, ``q_norm``/``k_norm`` modules not shared).
        step: the logging step the figures will be logged at.
        device: where the sums accumulate (the module's device).
        max_queries: queries sampled per layer call (``None``: all), see
            :func:`~lightning_mrs.attention_stats.query_sample`.
        collapse_threshold: a row is collapsed when its largest weight exceeds this.
        warn: ``warn(key, message)`` for problems met in a hook (a statistic never breaks
            training); ``key`` lets the caller warn once per key.

    Attributes:
        sums: layer name -> the sums so far.
        stepped: an optimizer step happened since the capture opened.
    """

    def __init__(self, layers: list[WatchedLayer], step: int, device: torch.device, max_queries: Optional[int],
                 collapse_threshold: float = 0.99, warn: Warn = no_warning) -> None:
        self.layers = layers
        self.step = step
        self.max_queries = max_queries
        self.collapse_threshold = collapse_threshold
        self._warn = warn
        self.sums = {layer.name: AttentionSums.zeros(layer.info.num_heads, dtype=sums_dtype(device), device=device)
                     for layer in layers}
        self.stepped = False
        self._pending: dict[str, dict[str, Tensor]] = {}
        self._handles: list[Any] = []

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def arm(self) -> None:
        """Register the hooks (for one training forward). Idempotent."""
        if self._handles:
            return
        self._pending = {layer.name: {} for layer in self.layers}
        for layer in self.layers:
            for role, attr in zip(("q", "k"), layer.info.qk_attrs):  # q_norm/k_norm, Phi's q_layernorm/k_layernorm
                norm = getattr(layer.module, attr)
                self._handles.append(norm.register_forward_hook(partial(self._hook, layer, role)))

    def disarm(self) -> None:
        """Remove every hook and drop any unpaired q or k. Idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._pending = {}

    def close(self) -> None:
        """End the capture (the logging step is over or dropped): :meth:`disarm`."""
        self.disarm()

    def _hook(self, layer: WatchedLayer, role: str, module: nn.Module, args: Any, output: Any) -> None:
        pending = self._pending.get(layer.name)
        if pending is None or not isinstance(output, Tensor):
            return
        pending[role] = output  # a reference only: q and k live on in the layer anyway
        if len(pending) < 2:
            return
        q, k = pending.pop("q"), pending.pop("k")
        info = layer.info
        try:
            new = attention_sums(q, k, info.scale, layout=info.layout, num_heads=info.num_heads, head_dim=info.head_dim,
                                 max_queries=self.max_queries, collapse_threshold=self.collapse_threshold)
            total = self.sums[layer.name]
            self.sums[layer.name] = total + new.to(total.entropy)
        except Exception as err:  # noqa: BLE001 - a statistic must never break training
            self._warn(f"hook:{layer.name}", f"AttentionMonitor: layer {layer.name!r} ({type(layer.module).__name__}) "
                       f"is not monitored on this step: {err}")

    def reduced(self, reduce: Reduce) -> dict[str, AttentionSums]:
        """The sums over ranks: one ``reduce(flat, "sum")`` for every added field, one
        ``reduce(flat, "max")`` for every ``logit_max``."""
        summed = {(name, f): getattr(s, f) for name, s in self.sums.items() for f in AttentionSums.summed()}
        added = apply_flat(summed, lambda flat: reduce(flat, "sum"))
        largest = apply_flat({name: s.logit_max for name, s in self.sums.items()}, lambda flat: reduce(flat, "max"))
        return {name: AttentionSums(**{f: added[(name, f)] for f in AttentionSums.summed()}, logit_max=largest[name])
                for name in self.sums}


def step_metrics(layers: Sequence[WatchedLayer], sums: Mapping[str, AttentionSums]) -> dict[str, float]:
    """``z-layers/attention/<layer>/<stat>`` and ``attention/all/<stat>`` of one logging step.

    Figures are computed on the sums' device and copied to the host once. A layer that
    captured no query on this step is left out; ``q_norm_mean``/``k_norm_mean`` are given
    for layers with a QK-norm only.
    """
    on_device: dict[tuple[str, str], Tensor] = {}
    for layer in layers:
        on_device.update({(layer.name, stat): v for stat, v in attention_figures(sums[layer.name]).items()})
        on_device[layer.name, "queries"] = sums[layer.name].queries
    if not on_device:
        return {}
    host = to_host(on_device, torch.float64)  # the one device-to-host copy
    rows: dict[str, dict[str, Tensor]] = {}
    for layer in layers:
        if host[layer.name, "queries"].item() <= 0:
            continue  # not called on this step
        skip = () if layer.info.qk_norm is not None else _NORM_FIGURES
        rows[layer.name] = {stat: host[layer.name, stat] for stat in FIGURE_NAMES if stat not in skip}
    metrics = {ATTENTION.tag(name, stat): v.item() for name, row in rows.items() for stat, v in row.items()}
    metrics.update({ATTENTION.tag("all", stat): v.item() for stat, v in aggregate_figures(list(rows.values())).items()})
    return metrics
