"""``AttentionInfo``: what the swap and the attention monitor know of one covered attention layer.

Its own module so that the family adapters (:mod:`lightning_mrs.swap.attention_hf`) describe
layers without importing :mod:`lightning_mrs.swap.attention`, which loads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["AttentionInfo", "QK_ATTRS", "QK_ATTR_PAIRS", "is_qk_name"]

#: the attributes of a covered attention layer that hold its QK-norms (the ones the swap adds)
QK_ATTRS = ("q_norm", "k_norm")
#: every pair of names under which a layer may hold QK-norms of its own (transformers' Phi and
#: Persimmon: ``q_layernorm``/``k_layernorm``)
QK_ATTR_PAIRS = (QK_ATTRS, ("q_layernorm", "k_layernorm"), ("query_layernorm", "key_layernorm"))
_QK_SUFFIXES = tuple(f".{attr}" for pair in QK_ATTR_PAIRS for attr in pair)


def is_qk_name(name: str) -> bool:
    """``name`` is the dotted name of an attention layer's QK-norm (``<layer>.q_norm``, ``.k_layernorm``...)."""
    return name.endswith(_QK_SUFFIXES)


@dataclass(frozen=True)
class AttentionInfo:
    """One covered attention layer.

    Attributes:
        num_heads: heads of the queries that ``q_norm`` sees (timm's differential attention:
            twice the module's ``num_heads``; keys may have fewer heads under GQA).
        head_dim: the last dim of q and k (the QK-norm's width).
        scale: the factor of ``q . k`` in the logits; ``None`` when it is learned (Swin V2's
            cosine attention: ``exp(clamp(logit_scale))`` per head).
        qk_norm: the kind of ``q_norm`` (``"mrs"``, ``"rms"``, ``"layer"``... as
            :func:`~lightning_mrs.swap.norm_spec` names it), ``None`` for ``nn.Identity``.
        layout: the dims of the q/k tensors ``q_norm``/``k_norm`` see (``"BHND"``...;
            ``"BN(HD)"``: all heads in the last dim, OLMo 2's full-width QK-norms).
        cosine: q and k are L2-normalised after ``q_norm``/``k_norm`` (Swin V2).
        unseen: what the layer adds to ``scale * q . k`` after ``k_norm`` that hooks on the
            norms do not see (transformers layers: ``"rotary embeddings and the causal mask"``...).
        qk_attrs: the names of the layer's query and key norm children (``("q_norm", "k_norm")``;
            Phi's own: ``("q_layernorm", "k_layernorm")``).

    Example:
        >>> from torch import nn
        >>> from lightning_mrs import iter_attention_layers, swap_norms
        >>> model = nn.Sequential(nn.MultiheadAttention(16, 2))
        >>> _ = swap_norms(model, None, qk_norm="mrs")
        >>> [(name, info.num_heads, info.head_dim, info.qk_norm) for name, _, info in iter_attention_layers(model)]
        [('0', 2, 8, 'mrs')]
    """

    num_heads: int
    head_dim: int
    scale: Optional[float]
    qk_norm: Optional[str]
    layout: str = "BHND"
    cosine: bool = False
    unseen: Optional[str] = None
    qk_attrs: tuple[str, str] = QK_ATTRS
