"""The MRSNorm op: the single source of truth for the maths (see ``shared/PAPER.md``).

Channels are paired as adjacent phasors ``z_i = (x[2i], x[2i+1])``. Each phasor's
magnitude is ``r_i = sqrt(x[2i]^2 + x[2i+1]^2 + eps)`` (root first), the scale of a group
is the plain mean ``S = mean_i r_i`` (then mean), and ``y[2i:2i+2] = w_i * z_i / S``.

Where the mean is taken:

* ``channel_dim=-1`` (channels-last, tokens / NHWC): one ``S`` per position, mean over the
  ``P = C / 2`` phasors of the last dim. Drop-in for ``F.layer_norm(x, (C,))``.
* ``channel_dim=1`` (channels-first ``(N, C, *spatial)``): ``spatial=False`` gives one ``S``
  per (sample, position), ``spatial=True`` one ``S`` per sample, shared over all phasors at
  all positions (like ``GroupNorm(1, C)``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_mrs.fused import BACKENDS, fused_mrs_norm, resolve_backend

__all__ = ["mrs_norm", "mrs_scale", "check_mrs_input", "phasor_channel_dim"]

_HALF_DTYPES = (torch.float16, torch.bfloat16)


def phasor_channel_dim(x: Tensor, channel_dim: int, caller: str) -> int:
    """``channel_dim`` of ``x`` as a non-negative index, checked to hold an even width.

    Raises:
        ValueError: a 0-d tensor, an out-of-range dim or an odd channel count, naming
            ``caller`` and the fix.
    """
    if x.ndim == 0:
        raise ValueError(f"{caller} expects a tensor with a channel dimension, got a 0-d tensor.")
    if not -x.ndim <= channel_dim < x.ndim:
        raise ValueError(
            f"{caller}: channel_dim={channel_dim} is out of range for a {x.ndim}-d input of "
            f"shape {tuple(x.shape)}."
        )
    cd = channel_dim % x.ndim
    channels = x.shape[cd]
    if channels % 2:
        raise ValueError(
            f"{caller} pairs adjacent channels into phasors, so the channel dim must be even; "
            f"got {channels} channels (dim {cd} of shape {tuple(x.shape)}). Pad or project "
            "to an even width."
        )
    return cd


def check_mrs_input(
    x: Tensor, weight: Optional[Tensor], eps: float, channel_dim: int, spatial: bool
) -> int:
    """Validate the arguments of :func:`mrs_norm`; return the normalised channel dim.

    Raises:
        ValueError: a non-floating tensor, an odd or absent channel dim, a weight of the wrong
            shape, or a non-positive ``eps``; the message names the fix.
    """
    if not x.is_floating_point():
        raise ValueError(
            f"mrs_norm expects a floating-point tensor, got dtype {x.dtype}; "
            "convert the input first, e.g. x.float()."
        )
    cd = phasor_channel_dim(x, channel_dim, "mrs_norm")
    channels = x.shape[cd]
    if spatial and x.ndim < 2:
        raise ValueError(
            "mrs_norm(spatial=True) shares S over all dims but the batch dim (0), so it needs "
            f"at least 2 dims; got shape {tuple(x.shape)}."
        )
    if weight is not None and tuple(weight.shape) != (channels // 2,):
        raise ValueError(
            f"mrs_norm: weight must hold one value per phasor, shape ({channels // 2},) for "
            f"{channels} channels; got shape {tuple(weight.shape)}."
        )
    if not eps > 0:
        raise ValueError(f"mrs_norm: eps must be > 0 (it keeps zeros finite), got {eps}.")
    return cd


def _pairs(x: Tensor, cd: int) -> tuple[Tensor, Tensor]:
    """Even and odd channels of ``x`` as strided views (no copy, any memory format)."""
    pairs = x.unflatten(cd, (-1, 2))  # (..., P, 2, ...)
    return pairs.select(cd + 1, 0), pairs.select(cd + 1, 1)  # (..., P, ...) each


def _mean_dims(ndim: int, cd: int, spatial: bool) -> tuple[int, ...]:
    return tuple(range(1, ndim)) if spatial else (cd,)


def _scale(xf: Tensor, cd: int, eps: float, spatial: bool) -> Tensor:
    """``S = mean_i sqrt(x[2i]^2 + x[2i+1]^2 + eps)`` per group, size 1 along the mean dims."""
    even, odd = _pairs(xf, cd)  # (..., P, ...)
    r = torch.sqrt(even * even + odd * odd + eps)  # (..., P, ...) phasor magnitudes
    return r.mean(dim=_mean_dims(xf.ndim, cd, spatial), keepdim=True)  # (..., 1, ...)


def mrs_scale(
    x: Tensor, eps: float = 1e-6, *, channel_dim: int = -1, spatial: bool = False
) -> Tensor:
    """The ensemble scale ``S`` of :func:`mrs_norm`, in fp32 for half inputs.

    Returns a tensor that broadcasts against ``x``: size 1 along the channel dim (and along
    every non-batch dim when ``spatial=True``).
    """
    cd = check_mrs_input(x, None, eps, channel_dim, spatial)
    xf = x.float() if x.dtype in _HALF_DTYPES else x
    return _scale(xf, cd, eps, spatial)


def mrs_norm(
    x: Tensor,
    weight: Optional[Tensor] = None,
    eps: float = 1e-6,
    *,
    channel_dim: int = -1,
    spatial: bool = False,
    backend: str = "auto",
) -> Tensor:
    """Mean Root Square normalisation of ``x`` (phasor normalisation).

    Args:
        x: input of any floating dtype; fp16/bf16 are computed in fp32 and returned in their
            own dtype.
        weight: optional per-phasor gain of shape ``(C // 2,)``.
        eps: added inside each phasor's root, keeps zeros finite (must be > 0).
        channel_dim: the dim that holds the ``C`` (even) channels; ``-1`` for channels-last,
            ``1`` for channels-first.
        spatial: share one ``S`` per sample over all dims but the first.
        backend: ``"auto"`` (default) picks the fastest implementation available: a fused
            autograd Function saving only ``x`` and ``1/S``, with hand-written one-pass CPU
            kernels (built once per machine), Inductor-compiled kernels (CPU/GPU, compiled
            on first use) or Triton kernels (CUDA); the plain formula under
            ``torch.compile``. ``"eager"`` is this module's pure-torch formula (the
            reference); ``"function"``, ``"cpp"``, ``"inductor"`` and ``"triton"`` force one
            implementation (see :mod:`lightning_mrs.fused`).

    Returns:
        A tensor of the shape, dtype and memory format of ``x``.

    Example:
        >>> x = torch.randn(4, 16, 64)
        >>> y = mrs_norm(x, torch.ones(32))
        >>> y.shape
        torch.Size([4, 16, 64])
    """
    cd = check_mrs_input(x, weight, eps, channel_dim, spatial)
    if backend != "eager":
        if backend not in BACKENDS:
            raise ValueError(
                f"mrs_norm: unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}."
            )
        impl = resolve_backend(x, cd, spatial, backend)
        if impl != "eager":
            return fused_mrs_norm(x, weight, eps, cd, spatial, impl)
    xf = x.float() if x.dtype in _HALF_DTYPES else x
    inv_s = _scale(xf, cd, eps, spatial).reciprocal()  # (..., 1, ...)
    if weight is not None:
        # (C,) gain broadcast along the channel dim: each phasor's weight on both its channels
        w = weight.to(xf.dtype).repeat_interleave(2)  # (C,)
        w = w.view((-1,) + (1,) * (x.ndim - 1 - cd))  # (C, 1, ..., 1)
        y = xf * inv_s * w
    else:
        y = xf * inv_s
    return y.to(x.dtype)
