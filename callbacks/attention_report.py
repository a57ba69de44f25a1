"""``AttentionMonitor``'s capture of one logging step, and which figures a layer logs.

An :class:`AttentionCapture` exists while a logging step runs. :meth:`~AttentionCapture.arm`
registers a forward hook on the ``q_norm`` and ``k_norm`` of each watched layer (the monitor
disarms right after the training forward, so validation and backward recomputation are never
captured). Once a layer's hooks have seen both its q and k, the pair is reduced at once to
:class:`~lightning_mrs.attention_stats.AttentionSums` (nothing is kept beyond the call); calls,
micro-batches and ranks add up. The figures are :data:`~lightning_mrs.attention_stats.FIGURES`,
``q_norm_mean``/``k_norm_mean`` for layers with a QK-norm only (:func:`figures_of`).

Example:
    >>> import torch
    >>> from torch import nn
    >>> from lightning_mrs.attention_stats import FIGURES
    >>> from lightning_mrs.callbacks.capture import layer_metrics
    >>> from lightning_mrs.callbacks.tb_layout import ATTENTION
    >>> from lightning_mrs.swap import AttentionInfo
    >>> attn = nn.Module()
    >>> attn.q_norm, attn.k_norm = nn.Identity(), nn.Identity()
    >>> layer = WatchedLayer("attn", attn, AttentionInfo(2, 4, 0.5, None))
    >>> capture = AttentionCapture([layer], step=0, device=torch.device("cpu"), max_queries=None)
    >>> capture.arm()
    >>> _ = attn.q_norm(torch.randn(3, 2, 5, 4)), attn.k_norm(torch.randn(3, 2, 5, 4))
    >>> capture.disarm()
    >>> sorted(layer_metrics(ATTENTION.tag, [layer], capture.sums, FIGURES, "queries", figures_of))[:2]
    ['attention/all/collapsed_frac', 'attention/all/entropy_mean']
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_mrs.attention_stats import FIGURES, AttentionSums, attention_sums
from lightning_mrs.callbacks.capture import Layer, LayerCapture, Warn, no_warning
from lightning_mrs.swap import AttentionInfo

__all__ = ["AttentionCapture", "WatchedLayer", "figures_of"]

_NORM_FIGURES = ("q_norm_mean", "k_norm_mean")


@dataclass
class WatchedLayer(Layer):
    """An attention layer under watch: its qualified name, the module and its ``AttentionInfo``."""

    info: AttentionInfo


def figures_of(layer: WatchedLayer) -> tuple[str, ...]:
    """The figures ``layer`` logs: ``q_norm_mean``/``k_norm_mean`` only with a QK-norm."""
    return tuple(f for f in FIGURES if layer.info.qk_norm is not None or f not in _NORM_FIGURES)


class AttentionCapture(LayerCapture[WatchedLayer]):
    """The per-layer sums of logging step ``step`` and the hooks that collect them (the arguments of
    :class:`~lightning_mrs.callbacks.capture.LayerCapture`, and ``max_queries``: queries sampled per
    layer call, ``None`` all, see :func:`~lightning_mrs.attention_stats.query_sample`;
    ``collapse_threshold``: a row is collapsed when its largest weight exceeds this)."""

    owner = "AttentionMonitor"

    def __init__(self, layers: list[WatchedLayer], step: int, device: torch.device, max_queries: Optional[int],
                 collapse_threshold: float = 0.99, warn: Warn = no_warning) -> None:
        super().__init__(layers, step, device, warn)
        self.max_queries, self.collapse_threshold = max_queries, collapse_threshold
        self._pending: dict[str, dict[str, Tensor]] = {}

    def _zeros(self, layer: WatchedLayer, **kwargs: Any) -> AttentionSums:
        return AttentionSums.zeros(layer.info.num_heads, **kwargs)

    def _hooks(self, layer: WatchedLayer) -> list[Any]:
        self._pending[layer.name] = {}  # q or k of an earlier forward is dropped
        return [getattr(layer.module, attr).register_forward_hook(partial(self._hook, layer, role))
                for role, attr in zip(("q", "k"), layer.info.qk_attrs)]  # q_norm/k_norm, Phi's q_layernorm/...

    def disarm(self) -> None:
        super().disarm()
        self._pending = {}

    def _hook(self, layer: WatchedLayer, role: str, module: nn.Module, args: Any, output: Any) -> None:
        pending = self._pending.get(layer.name)
        if pending is None or not isinstance(output, Tensor):
            return
        pending[role] = output  # a reference only: q and k live on in the layer anyway
        if len(pending) == 2:
            q, k, info = pending.pop("q"), pending.pop("k"), layer.info
            self.add(layer, lambda: attention_sums(
                q, k, info.scale, layout=info.layout, num_heads=info.num_heads, head_dim=info.head_dim,
                max_queries=self.max_queries, collapse_threshold=self.collapse_threshold))
