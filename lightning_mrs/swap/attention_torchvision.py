"""torch/torchvision attention modules rebuilt with a QK-norm hook (``q_norm`` / ``k_norm``).

``nn.MultiheadAttention`` (torchvision's ViT), Swin's ``ShiftedWindowAttention`` and
``ShiftedWindowAttentionV2`` and MaxViT's ``RelativePositionalMultiHeadAttention`` compute
their queries and keys inside one fused call, so nothing can be put between the projection
and the logits. Each class here subclasses the module it replaces and re-states its forward
with ``q = q_norm(q)``, ``k = k_norm(k)`` on the per-head ``(B, heads, N, head_dim)`` tensors
right before the logits. :meth:`from_module` wraps an existing module around *the same*
parameter and buffer objects (same names, so state dicts keep their keys; isinstance checks
against the original class still hold). While both norms are ``nn.Identity`` the output is the
original's up to float rounding (``tests/swap/test_attention_torchvision.py``).

This module imports torchvision's models (about 2 s), so :mod:`lightning_mrs.swap.attention`
imports it only when a swap looks for attention layers. :data:`REPLACEMENTS` maps each
original class (exactly: a subclass may have its own forward) to its QK class.

Example:
    >>> mha = nn.MultiheadAttention(8, 2, batch_first=True)
    >>> qk = QKMultiheadAttention.from_module(mha)
    >>> qk.in_proj_weight is mha.in_proj_weight, type(qk.q_norm).__name__
    (True, 'Identity')
"""

from __future__ import annotations

import math
from typing import Optional, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.models import maxvit, swin_transformer as swin

__all__ = ["QKMultiheadAttention", "QKRelativePositionalMultiHeadAttention", "QKShiftedWindowAttention",
           "QKShiftedWindowAttentionV2", "REPLACEMENTS"]

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

    def _masks(self, attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor], batch: int, dtype: torch.dtype,
               ) -> Optional[Tensor]:
        """One additive float mask broadcastable to ``(B, heads, L, S)``, as torch merges them."""
        kpm = F._canonical_mask(key_padding_mask, "key_padding_mask", F._none_or_dtype(attn_mask), "attn_mask", dtype)
        mask = F._canonical_mask(attn_mask, "attn_mask", None, "", dtype, check_other=False)
        if mask is not None:
            mask = mask.view(batch, self.num_heads, *mask.shape[-2:]) if mask.dim() == 3 else mask  # (B|1, H|1, L, S)
        if kpm is not None:
            kpm = kpm.view(batch, 1, 1, -1)  # (B, 1, 1, S)
            mask = kpm if mask is None else mask + kpm
        return mask

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
        batched = query.dim() == 3
        if not batched:  # (L, E) -> (1, L, E)
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
        elif not self.batch_first:  # (L, B, E) -> (B, L, E)
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        B, L, E = query.shape
        H, D = self.num_heads, self.head_dim
        if self.in_proj_weight is not None:
            w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        b_q, b_k, b_v = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None, None, None)
        q = F.linear(query, w_q, b_q).view(B, L, H, D).transpose(1, 2)  # (B, H, L, D)
        k = F.linear(key, w_k, b_k).view(B, key.shape[1], H, D).transpose(1, 2)  # (B, H, S, D)
        v = F.linear(value, w_v, b_v).view(B, value.shape[1], H, D).transpose(1, 2)  # (B, H, S, D)
        q, k = self.q_norm(q), self.k_norm(k)
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint (as nn.MultiheadAttention).")
        causal = is_causal and key_padding_mask is None and not need_weights  # torch then trusts the hint
        mask = None if causal else self._masks(attn_mask, key_padding_mask, B, q.dtype)
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
            weights = weights if batched else weights.squeeze(0)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal)
        out = self.out_proj(out.transpose(1, 2).reshape(B, L, E))  # (B, L, E)
        if not batched:
            out = out.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights


def _shift_mask(pad_h: int, pad_w: int, window: list[int], shift: list[int], like: Tensor) -> Tensor:
    """Swin's mask that keeps shifted windows from attending across the roll seam:
    ``(num_windows, Ws*Ws, Ws*Ws)``, 0 within a region, -100 across (as torchvision)."""
    regions = like.new_zeros((pad_h, pad_w))
    count = 0
    for h in ((0, -window[0]), (-window[0], -shift[0]), (-shift[0], None)):
        for w in ((0, -window[1]), (-window[1], -shift[1]), (-shift[1], None)):
            regions[h[0]:h[1], w[0]:w[1]] = count
            count += 1
    regions = regions.view(pad_h // window[0], window[0], pad_w // window[1], window[1])
    regions = regions.permute(0, 2, 1, 3).reshape(-1, window[0] * window[1])  # (nW, Ws*Ws)
    mask = regions.unsqueeze(1) - regions.unsqueeze(2)
    return mask.masked_fill(mask != 0, -100.0).masked_fill(mask == 0, 0.0)


class _WindowQK(_QKHook):
    """torchvision's ``shifted_window_attention`` with ``q_norm``/``k_norm`` on the per-window,
    per-head ``(B*nW, heads, Ws*Ws, head_dim)`` queries and keys."""

    num_heads: int
    qkv: nn.Linear
    proj: nn.Linear

    @property
    def head_dim(self) -> int:
        return self.qkv.in_features // self.num_heads

    def _attend(self, x: Tensor, bias: Tensor, logit_scale: Optional[Tensor]) -> Tensor:
        window, heads = self.window_size, self.num_heads
        B, H, W, C = x.shape
        x = F.pad(x, (0, 0, 0, (window[1] - W % window[1]) % window[1], 0, (window[0] - H % window[0]) % window[0]))
        _, pad_h, pad_w, _ = x.shape
        shift = [0 if window[i] >= (pad_h, pad_w)[i] else self.shift_size[i] for i in range(2)]
        if sum(shift) > 0:
            x = torch.roll(x, shifts=(-shift[0], -shift[1]), dims=(1, 2))
        num_windows = (pad_h // window[0]) * (pad_w // window[1])
        x = x.view(B, pad_h // window[0], window[0], pad_w // window[1], window[1], C)
        x = x.permute(0, 1, 3, 2, 4, 5).reshape(B * num_windows, window[0] * window[1], C)  # (B*nW, T, C)
        qkv_bias = self.qkv.bias
        if logit_scale is not None and qkv_bias is not None:  # V2: no key bias
            qkv_bias = torch.cat([qkv_bias[: C], torch.zeros_like(qkv_bias[C: 2 * C]), qkv_bias[2 * C:]])
        qkv = F.linear(x, self.qkv.weight, qkv_bias).reshape(x.size(0), x.size(1), 3, heads, C // heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (B*nW, heads, T, head_dim) each
        q, k = self.q_norm(q), self.k_norm(k)
        if logit_scale is not None:  # V2: cosine attention with a learned per-head temperature
            attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
            attn = attn * torch.clamp(logit_scale, max=math.log(100.0)).exp()
        else:
            attn = (q * (C // heads) ** -0.5) @ k.transpose(-2, -1)  # (B*nW, heads, T, T)
        attn = attn + bias
        if sum(shift) > 0:
            mask = _shift_mask(pad_h, pad_w, window, shift, x)  # (nW, T, T)
            attn = attn.view(B, num_windows, heads, x.size(1), x.size(1)) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, heads, x.size(1), x.size(1))
        attn = F.dropout(attn.softmax(dim=-1), p=self.attention_dropout, training=self.training)
        x = (attn @ v).transpose(1, 2).reshape(x.size(0), x.size(1), C)
        x = F.dropout(F.linear(x, self.proj.weight, self.proj.bias), p=self.dropout, training=self.training)
        x = x.view(B, pad_h // window[0], pad_w // window[1], window[0], window[1], C)
        x = x.permute(0, 1, 3, 2, 4, 5).reshape(B, pad_h, pad_w, C)
        if sum(shift) > 0:
            x = torch.roll(x, shifts=(shift[0], shift[1]), dims=(1, 2))
        return x[:, :H, :W, :].contiguous()  # (B, H, W, C)


class QKShiftedWindowAttention(_WindowQK, swin.ShiftedWindowAttention):
    """Swin V1's window attention with ``q_norm``/``k_norm`` (logit scale ``head_dim**-0.5``)."""

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5

    def forward(self, x: Tensor) -> Tensor:
        return self._attend(x, self.get_relative_position_bias(), None)


class QKShiftedWindowAttentionV2(_WindowQK, swin.ShiftedWindowAttentionV2):
    """Swin V2's cosine window attention with ``q_norm``/``k_norm`` before its L2
    normalisation (which already bounds the logits; a QK-norm there adds per-phasor weights)."""

    scale = None  # learned: exp(clamp(logit_scale)) per head, on cosine similarities

    def forward(self, x: Tensor) -> Tensor:
        return self._attend(x, self.get_relative_position_bias(), self.logit_scale)


class QKRelativePositionalMultiHeadAttention(_QKHook, maxvit.RelativePositionalMultiHeadAttention):
    """MaxViT's block/grid attention with ``q_norm``/``k_norm`` on ``(B*G, heads, P, head_dim)``.

    The logit scale is ``feat_dim**-0.5`` (torchvision scales by the full width, not the head
    width), applied after ``k_norm``.
    """

    @property
    def num_heads(self) -> int:
        return self.n_heads

    @property
    def scale(self) -> float:
        return self.scale_factor

    def forward(self, x: Tensor) -> Tensor:
        B, G, P, _ = x.shape
        H, DH = self.n_heads, self.head_dim
        q, k, v = (t.reshape(B, G, P, H, DH).permute(0, 1, 3, 2, 4).reshape(B * G, H, P, DH)
                   for t in self.to_qkv(x).chunk(3, dim=-1))  # (B*G, H, P, DH) each
        q, k = self.q_norm(q), self.k_norm(k)
        attn = (q @ (k * self.scale_factor).transpose(-2, -1)).view(B, G, H, P, P)
        attn = F.softmax(attn + self.get_relative_positional_bias(), dim=-1)
        out = attn.view(B * G, H, P, P) @ v  # (B*G, H, P, DH)
        return self.merge(out.view(B, G, H, P, DH).permute(0, 1, 3, 2, 4).reshape(B, G, P, H * DH))


#: exact original class -> its QK class
REPLACEMENTS: dict[type, type] = {
    nn.MultiheadAttention: QKMultiheadAttention,
    swin.ShiftedWindowAttention: QKShiftedWindowAttention,
    swin.ShiftedWindowAttentionV2: QKShiftedWindowAttentionV2,
    maxvit.RelativePositionalMultiHeadAttention: QKRelativePositionalMultiHeadAttention,
}
