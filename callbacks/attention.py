"""``AttentionMonitor``: logit size, softmax entropy and collapse of every attention layer, live.

The paper's claim for phasor attention (``docs/method.md#phasor-attention-qk-norm``) is that a
QK-norm keeps large-magnitude outliers from saturating the softmax ("softmax collapse"). This
monitor shows it during training: on logging steps only, it captures the per-head queries and
keys that enter each attention layer's logits (hooks on the layer's ``q_norm``/``k_norm``, see
:mod:`lightning_mrs.swap.attention`), recomputes the logits of a bounded sample of queries
(fused attention never materialises them) and logs their size, the softmax entropy and the
share of collapsed attention rows (:mod:`lightning_mrs.attention_stats` defines every figure).

The hooks (:class:`~lightning_mrs.callbacks.attention_report.AttentionCapture`) watch the training
forward only; under DDP ``logit_max`` takes ``ReduceOp.MAX`` and the sums add (``entropy_min`` is
taken over the per-head sums after that, so it is the global batch's). The life cycle is
:class:`~lightning_mrs.callbacks.monitor_base.LoggingStepMonitor`'s; this module adds what is watched.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

import lightning.pytorch as pl
from torch import nn
from typing_extensions import override

from lightning_mrs.attention_stats import FIGURES, LAYOUTS
from lightning_mrs.callbacks.attention_report import AttentionCapture, WatchedLayer, figures_of
from lightning_mrs.callbacks.capture import display_name
from lightning_mrs.callbacks.monitor_base import LoggingStepMonitor, check_count, check_fraction
from lightning_mrs.callbacks.tb_layout import ATTENTION
from lightning_mrs.swap import AttentionInfo, iter_attention_layers

__all__ = ["AttentionMonitor"]

_ROPE_CLASSES = ("EvaAttention", "AttentionRope", "Gemma4Attention")  # rotary embedding after q_norm/k_norm


def _skip_reason(info: AttentionInfo) -> Optional[str]:
    """Why an attention layer cannot be monitored (``None`` when it can)."""
    if info.scale is None:
        return "its logit scale is learned per head (cosine attention), so the logits cannot be recomputed"
    if info.layout not in LAYOUTS:
        return f"its q/k layout {info.layout!r} is not one of {list(LAYOUTS)}"
    return None


def _unseen_terms(module: nn.Module, info: AttentionInfo) -> Optional[str]:
    """What the layer adds to ``scale * q . k`` that the monitor does not recompute."""
    if info.unseen is not None:
        return info.unseen
    terms = []
    if (getattr(module, "relative_position_bias_table", None) is not None
            or getattr(module, "rel_pos", None) is not None or getattr(module, "use_rel_pos", False)):
        terms.append("a relative position bias")
    if getattr(module, "rope", None) is not None or type(module).__name__ in _ROPE_CLASSES:
        terms.append("rotary embeddings (when the model passes them)")
    return " and ".join(terms) or None


class AttentionMonitor(LoggingStepMonitor[WatchedLayer, AttentionCapture]):
    """Log the logits and softmax of every attention layer as ``z-layers/attention/<layer>/<stat>``.

    Per layer, from the per-head queries and keys that enter the logits (the outputs of the
    layer's ``q_norm``/``k_norm``: after the QK-norm where there is one) and, for each sampled
    query, all keys of the same sample and head (see :mod:`lightning_mrs.attention_stats`):

    * ``logit_max``: the largest ``|q . k|`` times the layer's own logit scale (``1/sqrt(d)``
      for most);
    * ``entropy_mean``: the softmax entropy (nats) of each attention row, averaged over heads
      and queries; ``entropy_min``: the same mean for the lowest head;
    * ``collapsed_frac``: the share of attention rows (queries x heads) whose largest weight
      exceeds ``collapse_threshold``;
    * layers with a QK-norm only: ``q_norm_mean`` and ``k_norm_mean``, the mean L2 norm of the
      per-head query vectors (the sampled queries) and key vectors (the keys they attend to)
      *after* the QK-norm, as they enter the logits.

    ``attention/all/<stat>``: the worst layer's ``logit_max`` and ``collapsed_frac``, the mean
    over layers of the rest. Under DDP the sums are summed over ranks and ``logit_max`` takes
    the maximum, so the figures are those of the global batch (each rank samples its own
    queries). A head is one softmax: timm's differential attention has two per head.

    Limits: attention masks, additive position biases (Swin, MaxViT, relpos ViT, SAM) and
    rotary embeddings applied after ``k_norm`` (EVA, rope ViTs, Gemma 4) are not part of the
    recomputed logits (a warning names such layers); ViT-style models have none of them.
    Layers with a learned per-head logit scale (Swin V2) are skipped with a warning. Only
    what ``iter_attention_layers`` covers is monitored: timm's attention as it is,
    torch/torchvision attention once rebuilt (``expose_attention`` or a QK-norm swap), and
    Hugging Face transformers attention with a QK-norm of its own (Qwen3, Gemma 3, OLMo 2) or
    once its q/k projections are wrapped (``expose_attention`` or a QK-norm swap; Llama, GPT-2...):
    there q and k are read before the rotary embedding and the causal mask (a warning says so;
    ``docs/transformers-attention.md``).

    Args:
        log_every_n_steps: capture on the batches Lightning logs at with this interval;
            ``None`` uses the Trainer's ``log_every_n_steps``, and then the figures line up
            with ``self.log``'s.
        max_queries: queries sampled per layer call and rank (evenly spaced over samples and
            positions, the same on every step; see
            :func:`~lightning_mrs.attention_stats.query_sample`); ``None`` takes every query.
        collapse_threshold: a row is collapsed when its largest weight exceeds this; in (0, 1).
        include: a regex; only attention layers whose name matches (``re.search``) are monitored.
        dashboard: write the TensorBoard custom-scalars layout ("Attention").

    Example:
        >>> import lightning.pytorch as pl
        >>> from lightning_mrs.callbacks import AttentionMonitor
        >>> trainer = pl.Trainer(callbacks=[AttentionMonitor(max_queries=128)])  # doctest: +SKIP
    """

    owner, board, figures_table, seen, forward_only = "AttentionMonitor", ATTENTION, FIGURES, "queries", True
    _figures_of = staticmethod(figures_of)

    def __init__(
        self,
        log_every_n_steps: Optional[int] = None,
        *,
        max_queries: Optional[int] = 256,
        collapse_threshold: float = 0.99,
        include: Optional[str] = None,
        dashboard: bool = True,
    ) -> None:
        super().__init__(log_every_n_steps, include=include, dashboard=dashboard)
        check_count(self.owner, "max_queries", max_queries)
        check_fraction(self.owner, "collapse_threshold", collapse_threshold, "a softmax weight")
        self.max_queries = max_queries
        self.collapse_threshold = float(collapse_threshold)

    @override
    def _discover(self, pl_module: pl.LightningModule) -> list[WatchedLayer]:
        found = list(iter_attention_layers(pl_module))
        # a q_norm/k_norm module that two hooks would share (within a layer or across layers)
        def norms(module: nn.Module, info: AttentionInfo) -> list[nn.Module]:
            return [getattr(module, attr) for attr in info.qk_attrs]  # q_norm/k_norm (Phi: q_layernorm/k_layernorm)

        uses = Counter(id(m) for _, module, info in found for m in norms(module, info))
        layers, skipped, unseen = [], [], []
        for name, module, info in found:
            name = display_name(name)
            if not self._included(name):
                continue
            reason = _skip_reason(info)
            if reason is None and any(uses[id(m)] > 1 for m in norms(module, info)):
                reason = ("its q_norm or k_norm module is shared (with k_norm or another layer), so hooks cannot "
                          "tell q from k")
            if reason is not None:
                skipped.append(f"{name or 'root'} ({type(module).__name__}: {reason})")
                continue
            layers.append(WatchedLayer(name, module, info))
            terms = _unseen_terms(module, info)
            if terms is not None:
                unseen.append(f"{name or 'root'} ({terms})")
        if unseen:
            self._warn_once("unseen:" + ";".join(unseen), (
                "AttentionMonitor: these layers add terms to scale * q.k that the monitor does not recompute, so "
                "their figures are those of scale * q.k alone: " + "; ".join(unseen) + "."))
        return self._found(layers, skipped, "attention layer", (
            "timm ViT/DeiT/EVA... attention, or torch/torchvision/transformers attention after "
            "lightning_mrs.swap.expose_attention(model) or a QK-norm swap"))

    @override
    def _open_capture(self, layers: list[WatchedLayer], step: int, pl_module: pl.LightningModule) -> AttentionCapture:
        return AttentionCapture(layers, step, pl_module.device, self.max_queries, self.collapse_threshold,
                                self._warn_once)
