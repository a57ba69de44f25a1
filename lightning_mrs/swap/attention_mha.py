"""``nn.MultiheadAttention`` rebuilt with a QK-norm hook (``q_norm`` / ``k_norm``), and the hook itself.

``nn.MultiheadAttention`` (torchvision's ViT uses it too) computes its queries and keys inside one
fused call, so nothing can be put between the projection and the logits. :class:`QKMultiheadAttention`
subclasses it and re-states its forward with ``q = q_norm(q)``, ``k = k_norm(k)`` on the per-head
``(B, heads, N, head_dim)`` tensors right before the logits. :meth:`_QKHook.from_module` wraps an
existing module around *the same* parameter and buffer objects (same names, so state dicts keep
their keys; isinstance checks against the original class still hold). Needs only torch; the
torchvision classes (Swin, MaxViT) are in :mod:`lightning_mrs.swap.attention_torchvision`.

Example:
    >>> mha = nn.MultiheadAttention(8, 2, batch_first=True)
    >>> qk = QKMultiheadAttention.from_module(mha)
    >>> qk.in_proj_weight is mha.in_proj_weight, type(qk.q_norm).__name__
    (True, 'Identity')
"""

from __future__ import annotations

from typing import Optional, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["QKMultiheadAttention"]

_M = TypeVar("_M", bound=nn.Module)


class _QKHook:
    """``from_module``: the same module, of the QK class, with ``q_norm = k_norm = Identity``."""

    @classmethod
    def from_module(cls: type[_M], module: nn.Module) -> _M:
        new = cls.__new__(cls)
        new.__dict__.update(module.__dict__)  # hooks dicts are shared: handles still remove them
        for key in ("_parameters", "_buffers", "_modules"):
            new.__dict__[key] = type(module.__dict__[key])(module.__dict__[key])  # own dicts, same tensors
        new.q_norm = nn.Identity()
        new.k_norm = nn.Identity()
        return new


class QKMultiheadAttention(_QKHook, nn.MultiheadAttention):
    """``nn.MultiheadAttention`` with ``q_norm``/``k_norm`` on the per-head queries and keys.

    Same constructor, parameters and call as ``nn.MultiheadAttention`` (``batch_first``,
    unbatched inputs, ``kdim``/``vdim``, ``key_padding_mask``, ``attn_mask`` (bool or float,
    2-D or per head), ``need_weights``, ``average_attn_weights``, ``is_causal``); not
    ``bias_k``/``bias_v`` nor ``add_zero_attn`` (see :meth:`unsupported`).

    ``_qkv_same_embed_dim`` is kept ``False``: ``nn.TransformerEncoderLayer`` checks it before
    taking its fused inference path, which reads ``in_proj_weight`` directly and would skip
    ``q_norm``/``k_norm``. The forward reads the layout from ``in_proj_weight`` (``None`` when
    q, k and v have their own projections).

    Example:
        >>> attn = QKMultiheadAttention(8, 2, batch_first=True)
        >>> attn(torch.randn(3, 5, 8), torch.randn(3, 7, 8), torch.randn(3, 7, 8))[1].shape
        torch.Size([3, 5, 7])
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.q_norm = nn.Identity()
        self.k_norm = nn.Identity()
        self._qkv_same_embed_dim = False

    @classmethod
    def from_module(cls, module: nn.Module) -> "QKMultiheadAttention":
        new = super().from_module(module)
        new._qkv_same_embed_dim = False
        return new

    @staticmethod
    def unsupported(module: nn.MultiheadAttention) -> Optional[str]:
        """Why ``module`` cannot be rebuilt, or ``None``."""
        if module.bias_k is not None or module.add_zero_attn:
            return "nn.MultiheadAttention with bias_k/bias_v or add_zero_attn is not supported (extra key rows)"
        return None

    def _reset_parameters(self) -> None:
        self._qkv_same_embed_dim = self.in_proj_weight is not None  # what torch's init reads
        super()._reset_parameters()
        self._qkv_same_embed_dim = False

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Optional[Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Optional[Tensor]]:
        if self.bias_k is not None or self.add_zero_attn:
            raise ValueError(f"{type(self).__name__}: {self.unsupported(self)}.")
        # the layout's Python branches run in fx-wrapped functions: symbolic_trace records one node for each
        q_in, k_in, v_in, key_padding_mask = _batch_first(query, key, value, key_padding_mask, self.batch_first)
        H, D = self.num_heads, self.head_dim
        if self.in_proj_weight is not None:
            w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        b_q, b_k, b_v = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None, None, None)
        q = F.linear(q_in, w_q, b_q).unflatten(-1, (H, D)).transpose(1, 2)  # (B, H, L, D)
        k = F.linear(k_in, w_k, b_k).unflatten(-1, (H, D)).transpose(1, 2)  # (B, H, S, D)
        v = F.linear(v_in, w_v, b_v).unflatten(-1, (H, D)).transpose(1, 2)  # (B, H, S, D)
        q, k = self.q_norm(q), self.k_norm(k)
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint (as nn.MultiheadAttention).")
        causal = is_causal and key_padding_mask is None and not need_weights  # torch then trusts the hint
        mask = None if causal else _merged_mask(attn_mask, key_padding_mask, H, q)
        dropout_p = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            logits = (q * self.scale) @ k.transpose(-2, -1)  # (B, H, L, S)
            weights = (logits if mask is None else logits + mask).softmax(dim=-1)
            if dropout_p > 0.0:
                weights = F.dropout(weights, p=dropout_p)
            out = weights @ v  # (B, H, L, D)
            if average_attn_weights:
                weights = weights.mean(dim=1)  # (B, L, S)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal)
        out = self.out_proj(out.transpose(1, 2).flatten(-2))  # (B, L, E)
        return _caller_layout(out, weights, query, self.batch_first)


@torch.fx.wrap
def _batch_first(query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor], batch_first: bool,
                 ) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """The inputs as ``(B, L, E)`` (and the padding mask as ``(B, S)``), from any layout
    ``nn.MultiheadAttention`` takes. Wrapped by ``torch.fx.wrap`` (it branches on ``query.dim()``):
    one node in a traced graph, as torch's own ``nn.MultiheadAttention`` is one leaf module."""
    if query.dim() != 3:  # unbatched (L, E) -> (1, L, E)
        kpm = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
        return query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0), kpm
    if not batch_first:  # (L, B, E) -> (B, L, E)
        return query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), key_padding_mask
    return query, key, value, key_padding_mask


@torch.fx.wrap
def _caller_layout(out: Tensor, weights: Optional[Tensor], query: Tensor, batch_first: bool,
                   ) -> tuple[Tensor, Optional[Tensor]]:
    """``(out, weights)`` back in the caller's layout (the one ``query`` came in); fx-wrapped as :func:`_batch_first`."""
    if query.dim() != 3:
        return out.squeeze(0), None if weights is None else weights.squeeze(0)
    return (out if batch_first else out.transpose(0, 1)), weights


@torch.fx.wrap
def _merged_mask(attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor], heads: int, like: Tensor,
                 ) -> Optional[Tensor]:
    """One additive float mask broadcastable to ``(B, heads, L, S)``, as torch merges ``attn_mask``
    (bool or float, 2-D or per head) and ``key_padding_mask``; fx-wrapped (it branches on their shapes)."""
    batch, dtype = like.shape[0], like.dtype
    kpm = F._canonical_mask(key_padding_mask, "key_padding_mask", F._none_or_dtype(attn_mask), "attn_mask", dtype)
    mask = F._canonical_mask(attn_mask, "attn_mask", None, "", dtype, check_other=False)
    if mask is not None:
        mask = mask.view(batch, heads, *mask.shape[-2:]) if mask.dim() == 3 else mask  # (B|1, H|1, L, S)
    if kpm is not None:
        kpm = kpm.view(batch, 1, 1, -1)  # (B, 1, 1, S)
        mask = kpm if mask is None else mask + kpm
    return mask
