"""torchvision attention modules rebuilt with a QK-norm hook (``q_norm`` / ``k_norm``).

Swin's ``ShiftedWindowAttention`` and ``ShiftedWindowAttentionV2`` and MaxViT's
``RelativePositionalMultiHeadAttention`` (and ``nn.MultiheadAttention``, torchvision's ViT's,
rebuilt in :mod:`lightning_mrs.swap.attention_mha`) compute
their queries and keys inside one fused call, so nothing can be put between the projection
and the logits. Each class here subclasses the module it replaces and re-states its forward
with ``q = q_norm(q)``, ``k = k_norm(k)`` on the per-head ``(B, heads, N, head_dim)`` tensors
right before the logits. :meth:`from_module` wraps an existing module around *the same*
parameter and buffer objects (same names, so state dicts keep their keys; isinstance checks
against the original class still hold). While both norms are ``nn.Identity`` the output is the
original's up to float rounding (``tests/swap/test_attention_torchvision.py``).

This module imports torchvision's models (about 2 s), so :mod:`lightning_mrs.swap.attention`
imports it only when a swap looks for attention layers, and only where torchvision is installed. :data:`REPLACEMENTS` maps each
original class (exactly: a subclass may have its own forward) to its QK class.

Example:
    >>> from torchvision.models import swin_t
    >>> attn = swin_t().features[1][0].attn
    >>> qk = QKShiftedWindowAttention.from_module(attn)
    >>> qk.qkv is attn.qkv, type(qk.q_norm).__name__
    (True, 'Identity')
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.models import maxvit, swin_transformer as swin

from lightning_mrs.swap.attention_mha import QKMultiheadAttention, _QKHook

__all__ = ["QKMultiheadAttention", "QKRelativePositionalMultiHeadAttention", "QKShiftedWindowAttention",
           "QKShiftedWindowAttentionV2", "REPLACEMENTS"]

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


@torch.fx.wrap
def _window_attention(module: _WindowQK, x: Tensor, bias: Tensor, logit_scale: Optional[Tensor]) -> Tensor:
    """``module._attend``, one node in a ``torch.fx`` graph: the padding and the shift depend on the
    input's height and width (Python branches fx cannot trace), so it is wrapped by ``torch.fx.wrap``
    as torchvision wraps its own ``shifted_window_attention``. The graph passes the module itself
    (a ``get_attr`` node), and the call runs its ``q_norm``/``k_norm`` eagerly, forward and backward."""
    return module._attend(x, bias, logit_scale)


class QKShiftedWindowAttention(_WindowQK, swin.ShiftedWindowAttention):
    """Swin V1's window attention with ``q_norm``/``k_norm`` (logit scale ``head_dim**-0.5``)."""

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5

    def forward(self, x: Tensor) -> Tensor:
        return _window_attention(self, x, self.get_relative_position_bias(), None)


class QKShiftedWindowAttentionV2(_WindowQK, swin.ShiftedWindowAttentionV2):
    """Swin V2's cosine window attention with ``q_norm``/``k_norm`` before its L2
    normalisation (which already bounds the logits; a QK-norm there adds per-phasor weights)."""

    scale = None  # learned: exp(clamp(logit_scale)) per head, on cosine similarities

    def forward(self, x: Tensor) -> Tensor:
        return _window_attention(self, x, self.get_relative_position_bias(), self.logit_scale)


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
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)  # unpacked, not iterated: torch.fx traces it
        q, k, v = (t.reshape(B, G, P, H, DH).permute(0, 1, 3, 2, 4).reshape(B * G, H, P, DH)
                   for t in (q, k, v))  # (B*G, H, P, DH) each
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
