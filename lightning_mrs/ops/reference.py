"""The MRSNorm formula in plain torch: the reference every kernel is checked against.

Channels are paired as adjacent phasors ``z_i = (x[2i], x[2i+1])``. Each phasor's
magnitude is ``r_i = sqrt(x[2i]^2 + x[2i+1]^2 + eps)`` (root first), the scale of a group
is the plain mean ``S = mean_i r_i`` (then mean), and ``y[2i:2i+2] = w_i * z_i / S``
(``docs/method.md``). Differentiable by autograd; works on any device and layout, inside
``torch.compile``, under tracing, on meta tensors and in TorchScript (the modules' scripted
forward calls it: lists rather than tuples of dims, no global tuples). Imports nothing else
of the op.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from lightning_mrs.ops.validation import compute_dtype

__all__ = ["mrs_norm_reference", "mrs_scale_reference"]


def _pairs(x: Tensor, channel_dim: int) -> tuple[Tensor, Tensor]:
    """Even and odd channels of ``x`` as strided views (no copy, any memory format)."""
    pairs = x.unflatten(channel_dim, (-1, 2))  # (..., P, 2, ...)
    return pairs.select(channel_dim + 1, 0), pairs.select(channel_dim + 1, 1)  # (..., P, ...)


def _scale(xf: Tensor, eps: float, channel_dim: int, spatial: bool) -> Tensor:
    even, odd = _pairs(xf, channel_dim)  # (..., P, ...)
    r = (even * even + odd * odd + eps).sqrt()  # (..., P, ...) phasor magnitudes
    dims = list(range(1, xf.ndim)) if spatial else [channel_dim]
    return r.mean(dim=dims, keepdim=True)  # (..., 1, ...)


def mrs_scale_reference(x: Tensor, eps: float, channel_dim: int, spatial: bool) -> Tensor:
    """``S`` per group in :func:`compute_dtype`, with size 1 along the averaged dims.

    ``channel_dim`` must be non-negative and hold an even width (see
    :mod:`lightning_mrs.ops.validation`).
    """
    return _scale(x.to(compute_dtype(x.dtype)), eps, channel_dim, spatial)


def mrs_norm_reference(
    x: Tensor, weight: Optional[Tensor], eps: float, channel_dim: int, spatial: bool
) -> Tensor:
    """``w_i * z_i / S`` computed in :func:`compute_dtype`, returned in ``x``'s dtype."""
    xf = x.to(compute_dtype(x.dtype))
    y = xf / _scale(xf, eps, channel_dim, spatial)  # (..., C, ...)
    if weight is not None:
        # each phasor's weight on both of its channels, broadcast along the channel dim
        w = weight.to(xf.dtype).repeat_interleave(2)  # (C,)
        y = y * w.view([-1] + [1] * (x.ndim - 1 - channel_dim))  # (C, 1, ..., 1)
    return y.to(x.dtype)
