"""Inputs where a plausible wrong kernel gives a wrong answer that the random inputs of
:mod:`helpers.checks` let pass, and the tight comparisons that catch it.

* :func:`near_eps`: pairs of magnitude ``sqrt(eps)`` (one group made of them only) and exact
  zero pairs beside normal ones. A kernel that drops ``eps`` from ``r = sqrt(u^2 + v^2 + eps)``
  gets ``S`` of an all-tiny group 30 % low (``sqrt(2)`` against 1), and ``S`` of a group with
  zero pairs ``~1e-4`` low, past float32's tolerance.
* :func:`past_half_range`: a pair of 300s beside normal pairs: ``300^2 = 90,000`` is past
  float16's 65,504, so a formula that squares float16 without the float32 upcast gets ``inf``.
* :func:`check_tight`: ``(y, dx, dw)`` of a path equal to the float64 reference rounded once
  to the dtype: what every kernel achieves (they compute in float32 and round at the end), so
  that a dropped term of ``dx`` or a second rounding fails where ``10 x`` the dtype's tolerance
  (0.3 absolute for bfloat16) would pass it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from helpers.checks import Norm, grads, make_inputs
from helpers.reference import mrs_norm_ref

EPS = 1e-6  # mrs_norm's default: sqrt(eps) = 1e-3
#: the relative error of one rounding to each dtype, float32's sums included (a few ulps of it)
ULP = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _pairs(x: Tensor, channel_dim: int) -> Tensor:
    """``x`` as ``(..., P, 2)`` with the channels last (a view when possible; shares memory here
    because the callers build a fresh float64 tensor)."""
    moved = x.movedim(channel_dim, -1)
    return moved.unflatten(-1, (-1, 2))


def near_eps(shape: tuple[int, ...], channel_dim: int, memory_format: Optional[torch.memory_format],
             dtype: torch.dtype, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """``(x, w, g)`` of ``dtype``: every 4th pair exactly 0, every 4th + 1 of magnitude about
    ``sqrt(eps)``, the others ~3; the whole first sample (dim 0) at ``sqrt(eps)``. ``g`` leans on
    ``x`` so that both terms of ``dx`` count."""
    x, w, gy = make_inputs(shape, channel_dim, None, torch.float64, seed=seed)
    pairs = _pairs(x, channel_dim)  # (..., P, 2)
    unit = pairs / pairs.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    pairs[..., 0::4, :] = 0.0
    pairs[..., 1::4, :] = unit[..., 1::4, :] * EPS**0.5 * 1.3
    x[0] = x[0] / 3 * EPS**0.5  # magnitudes ~sqrt(eps) through the whole first sample
    g = x / x.abs().amax() + gy
    return _cast(x, memory_format, dtype), w.to(dtype), g.to(dtype)


def past_half_range(shape: tuple[int, ...], channel_dim: int, memory_format: Optional[torch.memory_format],
                    dtype: torch.dtype, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """``(x, w, g)``: every 3rd pair ``(300, -300)`` (its square sum past float16's range), the
    rest ~3."""
    x, w, gy = make_inputs(shape, channel_dim, None, torch.float64, seed=seed)
    pairs = _pairs(x, channel_dim)
    pairs[..., 0::3, 0] = 300.0
    pairs[..., 0::3, 1] = -300.0
    g = x / x.abs().amax() + gy
    return _cast(x, memory_format, dtype), w.to(dtype), g.to(dtype)


def _cast(x: Tensor, memory_format: Optional[torch.memory_format], dtype: torch.dtype) -> Tensor:
    x = x.to(dtype)
    return x.contiguous(memory_format=memory_format) if memory_format is not None else x


def _close(got: Tensor, ref: Tensor, dtype: torch.dtype, what: str) -> None:
    """Within two roundings of ``dtype``, relative to the largest value of each sample (dim 0):
    a sample of ``sqrt(eps)`` pairs has gradients a thousand times the others'."""
    ulp = ULP[dtype]
    for n, (a, b) in enumerate(zip(got.double(), ref)):
        torch.testing.assert_close(a, b, rtol=2 * ulp, atol=2 * ulp * b.abs().max().item(),
                                   msg=lambda m: f"{what} of sample {n}: {m}")


def check_tight(fn: Norm, x: Tensor, w: Tensor, g: Tensor, channel_dim: int, spatial: bool) -> None:
    """``fn``'s ``(y, dx, dw)`` equal the float64 reference rounded once to ``x``'s (``w``'s)
    dtype, to two roundings' error (:func:`_close`); zero pairs give exact zeros."""
    y, dx, dw = grads(fn, x, w, g)
    ref = grads(lambda a, b: mrs_norm_ref(a, b, EPS, channel_dim, spatial), x.double(), w.double(), g.double())
    assert torch.isfinite(y).all() and torch.isfinite(dx).all() and torch.isfinite(dw).all()
    assert torch.equal(y[x == 0], torch.zeros_like(y[x == 0]))
    _close(y, ref[0], x.dtype, "y")
    _close(dx, ref[1], x.dtype, "dx")
    _close(dw[None], ref[2][None], w.dtype, "dw")
