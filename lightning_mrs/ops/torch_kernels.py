"""The fused MRSNorm's forward and backward as plain torch bodies: the ``torch`` backend (float64,
tiny and meta tensors, no compiler), compiled as they are by :mod:`.inductor_kernels`. They take
the canonical 3-d views of :mod:`.layout`, one ``S`` per ``(a, l)`` or (``spatial``) per ``a``:

* ``*_last``: ``(A, L, C)`` with the channels contiguous (tokens, NHWC). The partner of a
  channel is read with two shifted contiguous loads (``x[c+1]``/``x[c-1]``) and an even-
  channel mask, which Inductor vectorises; strided ``0::2``/``1::2`` views here would be
  scalar code, and a trailing dim of size 2 worse still.
* ``*_first``: ``(A, C, L)`` with the positions contiguous (NCHW). Here the strided even/odd
  views ``x3[:, 0::2]``/``x3[:, 1::2]`` are whole rows of ``L`` and vectorise along ``L``.

The backward recomputes the pair magnitudes from ``x``. The forward returns ``r_sum = P * S``
(the reduction's own output) rather than ``1/S``, which would be one more kernel between the
reduction and the normalisation and stop Inductor from fusing them.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_mrs.ops.layout import Layout
from lightning_mrs.ops.validation import compute_dtype

__all__ = ["BODIES", "backward", "forward", "per_channel"]

_DW_SPLIT = 8  # rows summed together before the column reduction of dw (see _col_sum)


def per_channel(w: Optional[Tensor]) -> Optional[Tensor]:
    """The per-phasor gain ``(P,)`` as a per-channel one ``(C,)``, built eagerly (tiny): a
    contiguous load in the bodies, where an index ``c // 2`` inside them would defeat
    vectorisation."""
    return None if w is None else w.repeat_interleave(2)


def _col_sum(t: Tensor) -> Tensor:
    """``t.sum(0)`` for a ``(R, C)`` tensor, in two stages.

    A direct dim-0 reduction walks each column down all R rows (one page per row: TLB
    misses, no prefetch; ~8x slower on the CPU). Summing blocks of ``_DW_SPLIT`` adjacent
    rows first reads memory in order. The split is written with a floor so that it holds
    for any (dynamic) R.
    """
    rows = t.shape[0]
    if rows < _DW_SPLIT:  # no full block: an empty (0, 8, C) view fails to lower in Inductor
        return t.sum(0)  # (C,)
    main = (rows // _DW_SPLIT) * _DW_SPLIT
    head = t[:main].view(rows // _DW_SPLIT, _DW_SPLIT, t.shape[1]).sum(1).sum(0)  # (C,)
    return head + t[main:].sum(0)  # (C,)


def _group_sum(r: Tensor, spatial: bool, inner: int) -> Tensor:
    """Sum of the pair magnitudes ``r`` (A, ., .) over each group, kept as (A, 1|., 1|.).

    Per sample the sum runs row by row (over dim ``inner``, then over the rows): one
    reduction over all ``P*L`` values is longer than Inductor's 4096-element chunk and
    gets its cascade-summation helper in the hot loop (~15 % slower forward, 1 thread);
    the two-stage sum is as accurate and is still fused with the normalisation, sample by
    sample.
    """
    if not spatial:
        return r.sum(dim=inner, keepdim=True)
    return r.sum(dim=inner, keepdim=True).sum(dim=3 - inner, keepdim=True)


def _sample_sums(gf: Tensor, xf: Tensor, w2: Optional[Tensor], inv_s: Tensor,
                 pos_dim: int) -> tuple[Tensor, Optional[Tensor]]:
    """Per-sample ``c = sum w g x`` and ``dw2 = sum_a (1/S_a) sum g x``, from one pass.

    Like GroupNorm's backward: per (sample, channel) sums ``gx = sum_l g x`` (one read of
    ``g`` and ``x``, sample by sample, so the dx pass that follows finds them in cache),
    from which both reductions are tiny.
    """
    gx = (gf * xf).sum(dim=pos_dim)  # (A, C)
    c = (gx * w2.to(gx.dtype) if w2 is not None else gx).sum(1)  # (A,)
    dw2 = (gx * inv_s.view(-1, 1)).sum(0) if w2 is not None else None  # (C,)
    return c.view(-1, 1, 1), dw2


# --- channels innermost: x3 is (A, L, C) with stride 1 along C (tokens, NHWC) -------------
def _fwd_last(x3: Tensor, w2: Optional[Tensor], even_mask: Tensor, eps: float,
              spatial: bool) -> tuple[Tensor, Tensor]:
    xf = x3.to(compute_dtype(x3.dtype))  # (A, L, C)
    nxt = F.pad(xf[..., 1:], (0, 1))  # (A, L, C): x[c+1]
    r = torch.sqrt(xf * xf + nxt * nxt + eps) * even_mask  # r of pair c/2 on even c, else 0
    n_pairs = (x3.shape[2] // 2) * (x3.shape[1] if spatial else 1)
    r_sum = _group_sum(r, spatial, inner=2)  # (A, 1|L, 1) = P * S
    y = xf * (n_pairs / r_sum)
    if w2 is not None:
        y = y * w2.to(xf.dtype)  # (C,) per-channel gain, precomputed: contiguous loads
    return y.to(x3.dtype), r_sum


def _bwd_last(x3: Tensor, w2: Optional[Tensor], even_mask: Tensor, r_sum: Tensor, g3: Tensor, eps: float,
              spatial: bool) -> tuple[Tensor, Optional[Tensor]]:
    compute = r_sum.dtype  # the forward's compute dtype (float32 for half inputs)
    xf, gf = x3.to(compute), g3.to(compute)  # (A, L, C)
    nxt = F.pad(xf[..., 1:], (0, 1))  # x[c+1]
    prv = F.pad(xf[..., :-1], (1, 0))  # x[c-1]
    partner = nxt * even_mask + prv * (1 - even_mask)  # the other channel of c's phasor
    rinv = torch.rsqrt(xf * xf + partner * partner + eps)  # (A, L, C), recomputed
    gw = gf * w2.to(compute) if w2 is not None else gf
    n_pairs = (x3.shape[2] // 2) * (x3.shape[1] if spatial else 1)
    inv_s = n_pairs / r_sum  # (A, 1|L, 1)
    # c = sum_k w g x per group; dS/dx_k = x_k / (P r_k), so dx = (w g - c x / (P S r)) / S
    if spatial:
        c, dw2 = _sample_sums(gf, xf, w2, inv_s, pos_dim=1)
    else:
        c = (gw * xf).sum(dim=2, keepdim=True)  # (A, L, 1)
        dw2 = _col_sum((gf * xf * inv_s).flatten(0, 1)) if w2 is not None else None  # (C,)
    k = c * inv_s * inv_s / n_pairs
    dx = gw * inv_s - k * (xf * rinv)  # (A, L, C)
    dw = None if w2 is None else dw2.view(-1, 2).sum(1)  # (P,)
    return dx.to(x3.dtype), dw


# --- channels strided: x3 is (A, C, L) (NCHW); vectorised along the positions L ---------
def _fwd_first(x3: Tensor, w2: Optional[Tensor], eps: float, spatial: bool) -> tuple[Tensor, Tensor]:
    xf = x3.to(compute_dtype(x3.dtype))  # (A, C, L)
    even, odd = xf[:, 0::2], xf[:, 1::2]  # (A, P, L) strided views
    r = torch.sqrt(even * even + odd * odd + eps)  # (A, P, L)
    n_pairs = (x3.shape[1] // 2) * (x3.shape[2] if spatial else 1)
    r_sum = _group_sum(r, spatial, inner=2 if spatial else 1)  # (A, 1, L|1) = P * S
    y = xf * (n_pairs / r_sum)
    if w2 is not None:
        y = y * w2.to(xf.dtype).unsqueeze(1)  # (C, 1)
    return y.to(x3.dtype), r_sum


def _bwd_first(x3: Tensor, w2: Optional[Tensor], r_sum: Tensor, g3: Tensor, eps: float,
               spatial: bool) -> tuple[Tensor, Optional[Tensor]]:
    compute = r_sum.dtype  # the forward's compute dtype (float32 for half inputs)
    xf, gf = x3.to(compute), g3.to(compute)  # (A, C, L)
    even, odd = xf[:, 0::2], xf[:, 1::2]  # (A, P, L)
    rinv = torch.rsqrt(even * even + odd * odd + eps)  # (A, P, L), recomputed
    rinv2 = rinv.unsqueeze(2).expand(-1, -1, 2, -1).flatten(1, 2)  # (A, C, L)
    gw = gf * w2.to(compute).unsqueeze(1) if w2 is not None else gf
    n_pairs = (x3.shape[1] // 2) * (x3.shape[2] if spatial else 1)
    inv_s = n_pairs / r_sum  # (A, 1, L|1)
    if spatial:
        # Per (sample, channel) sums of g x / S in one pass (GroupNorm's structure); both
        # c / S and dw come from this small (A, C) tensor. Scaling by 1/S inside the pass
        # rather than after it measured ~25 % faster (1 thread, CPU time).
        gxs = (gf * xf * inv_s).sum(dim=2)  # (A, C)
        cs = (gxs * w2.to(compute) if w2 is not None else gxs).sum(1).view(-1, 1, 1)  # c / S
        k = cs * inv_s / n_pairs  # (A, 1, 1)
        dw2 = gxs.sum(0) if w2 is not None else None  # (C,)
    else:
        c = (gw * xf).sum(dim=1, keepdim=True)  # (A, 1, L)
        dw2 = (gf * xf * inv_s).sum(dim=(0, 2)) if w2 is not None else None  # (C,)
        k = c * inv_s * inv_s / n_pairs
    dx = gw * inv_s - k * (xf * rinv2)  # (A, C, L)
    dw = None if w2 is None else dw2.view(-1, 2).sum(1)  # (P,)
    return dx.to(x3.dtype), dw


BODIES: dict[str, Callable[..., tuple[Tensor, Optional[Tensor]]]] = {
    "fwd_last": _fwd_last, "bwd_last": _bwd_last, "fwd_first": _fwd_first, "bwd_first": _bwd_first,
}
_MASKS: dict[tuple[int, torch.dtype, torch.device], Tensor] = {}  # (C, dtype, device) -> mask


def _even_mask(x3: Tensor) -> Tensor:
    """``(C,)`` 1 on even channels, 0 on odd ones, in the compute dtype (cached)."""
    key = (x3.shape[2], compute_dtype(x3.dtype), x3.device)
    mask = _MASKS.get(key)
    if mask is None:
        mask = (torch.arange(key[0], device=x3.device) % 2 == 0).to(key[1])  # (C,)
        _MASKS[key] = mask
    return mask


Runner = Callable[..., tuple[Tensor, Optional[Tensor]]]  # (body name, *args) -> outputs


def _eager(name: str, *args: object) -> tuple[Tensor, Optional[Tensor]]:
    return BODIES[name](*args)


def forward(x3: Tensor, w: Optional[Tensor], eps: float, layout: Layout,
            run: Runner = _eager) -> tuple[Tensor, Optional[Tensor]]:
    """``(y3, r_sum)`` through the body of ``layout``, executed by ``run`` (``w``: the
    per-phasor gain ``(P,)`` or ``None``; ``r_sum``: ``P * S`` per group, float32 or float64)."""
    w2 = per_channel(w)  # (C,)
    if layout.last:
        return run("fwd_last", x3, w2, _even_mask(x3), eps, layout.spatial)
    return run("fwd_first", x3, w2, eps, layout.spatial)


def backward(x3: Tensor, w: Optional[Tensor], r_sum: Tensor, g3: Tensor, eps: float, layout: Layout,
             run: Runner = _eager) -> tuple[Tensor, Optional[Tensor]]:
    """``(dx3, dw)`` through the body of ``layout``, executed by ``run`` (``dw``: ``(P,)`` or ``None``)."""
    w2 = per_channel(w)  # (C,)
    if layout.last:
        return run("bwd_last", x3, w2, _even_mask(x3), r_sum, g3, eps, layout.spatial)
    return run("bwd_first", x3, w2, r_sum, g3, eps, layout.spatial)
