"""Experimental baselines that compute a norm *in the input's dtype*: the paper's half-precision setting.

Every shipped norm (``nn.RMSNorm``, transformers' ``LlamaRMSNorm``, :class:`~lightning_mrs.MRSNorm`)
computes a float16 or bfloat16 input in float32 inside, so a large channel never overflows its
statistics. The paper's failure mode ("``sum(x^2)`` ... in mixed precision leads to numerical
explosion") needs a norm that computes in half precision. Whether such a norm overflows is a property
of its *arithmetic*, not of its formula, so there are four baselines: each formula computed naively
(the squares formed in the input's dtype, as a straightforward half kernel does) and computed safely
(no intermediate overflow). They are stress-test baselines (swap targets ``"rms-half"``,
``"mrs-half"``, ``"rms-half-safe"``, ``"mrs-half-safe"``), **not layers to train with**:

* :class:`RMSNormHalf` (``rms-half``): ``y = w * x * rsqrt(mean(x^2) + eps)`` with ``x^2``, the mean
  and the scale in the input's dtype. In float16 a channel with ``|x| >= 256`` squares to Inf
  (``256^2 = 65536`` rounds past 65504), the scale becomes 0, the token comes out all zeros.
* :class:`MRSNormHalf` (``mrs-half``): MRSNorm (``docs/method.md``) as its formula reads,
  ``r_i = sqrt(x[2i]^2 + x[2i+1]^2 + eps)``, every step in the input's dtype. It breaks at the very
  same place: from ``|x| = 256`` a magnitude is Inf, so is ``S``, and the token comes out all zeros.
* :class:`RMSNormHalfSafe` (``rms-half-safe``): RMSNorm with the care BLAS ``nrm2`` takes: each token
  divided by its largest ``|x|`` before squaring (exact in real arithmetic), so no square exceeds 1.
* :class:`MRSNormHalfSafe` (``mrs-half-safe``): each magnitude as
  ``hypot(x[2i], hypot(x[2i+1], sqrt(eps)))``, which forms no square.

The safe two break only where the result itself leaves float16: a phasor magnitude past 65504 for
MRSNorm; for RMSNorm never (its scale is at most ``max|x|``). In every mean the accumulation is torch's
(float32 on the CPU, then rounded to the input's dtype). What the formula changes is not whether the
denominator overflows but how much of it one outlier takes (``docs/outliers.md``). All four are
channels-last (the last dim holds the ``C`` channels), drop-ins for ``nn.RMSNorm(C)`` and
:class:`~lightning_mrs.MRSNorm`; in float32 and float64 they compute what those compute.

Example:
    >>> x = torch.full((1, 32), 300.0, dtype=torch.float16)  # every square overflows float16
    >>> [norm(32)(x).abs().max().item() for norm in (RMSNormHalf, MRSNormHalf)]
    [0.0, 0.0]
    >>> round(RMSNormHalfSafe(32)(x)[0, 0].item(), 3), round(MRSNormHalfSafe(32)(x)[0, 0].item(), 3)
    (1.0, 0.707)
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

from lightning_mrs.modules import _MRSNormBase

__all__ = ["MRSNormHalf", "MRSNormHalfSafe", "RMSNormHalf", "RMSNormHalfSafe"]


def _check(x: Tensor, name: str, c: int) -> None:
    """A channels-last floating input with the layer's channel count ``c``, or a ``ValueError``/``TypeError``
    naming the layer (plain arguments, not the layer: a traced graph holds them as constants)."""
    if x.ndim == 0 or x.shape[-1] != c:
        raise ValueError(f"{name}({c}): expected the last dim to hold {c} channels, got input of shape "
                         f"{tuple(x.shape)}. This layer is channels-last.")
    if not x.is_floating_point():
        raise TypeError(f"{name}({c}): expected a floating-point input, got {x.dtype}.")


# torch.fx.symbolic_trace records the check as one call (run when the graph runs) instead of tracing its branches
torch.fx.wrap("_check")


class RMSNormHalf(nn.RMSNorm):
    """RMSNorm over the last dim with ``x^2``, their mean and the scale in the input's dtype (naive).

    ``y = w * x * rsqrt(mean_c(x_c^2) + eps)``: an ``nn.RMSNorm(C)`` (same weight, same state dict)
    without its upcast. An experimental baseline (module docstring): in float16 a token with a channel
    at ``|x| >= 256`` comes out as zeros.

    Example:
        >>> RMSNormHalf(6)(torch.randn(2, 5, 6)).shape
        torch.Size([2, 5, 6])
    """

    def __init__(self, num_channels: int, eps: float = 1e-6, affine: bool = True,
                 device: Optional[torch.device | str] = None, dtype: Optional[torch.dtype] = None) -> None:
        name = type(self).__name__
        if isinstance(num_channels, bool) or not isinstance(num_channels, int) or num_channels < 1:
            raise ValueError(f"{name}: num_channels must be a positive int, got {num_channels!r}.")
        if not isinstance(eps, (int, float)) or not eps > 0:
            raise ValueError(f"{name}: eps must be > 0 (it keeps zeros finite), got {eps}.")
        super().__init__(num_channels, eps, elementwise_affine=affine, device=device, dtype=dtype)
        self.num_channels = num_channels
        self.affine = affine

    def _normalised(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps)  # (..., C), all in x.dtype

    def forward(self, x: Tensor) -> Tensor:
        _check(x, type(self).__name__, self.num_channels)
        y = self._normalised(x)
        return y if self.weight is None else y * self.weight.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_channels}, eps={self.eps}, affine={self.affine}"


class RMSNormHalfSafe(RMSNormHalf):
    """RMSNorm over the last dim in the input's dtype, each token scaled by its ``max|x|`` before squaring.

    ``x * rsqrt(mean(x^2) + eps) == (x/s) * rsqrt(mean((x/s)^2) + (sqrt(eps)/s)^2)`` for any ``s > 0``;
    with ``s = max(max_c |x_c|, sqrt(eps))`` every square is at most 1 (BLAS ``nrm2``'s scaling), so
    nothing overflows. ``s`` is detached: the output does not depend on it, so the gradient is that of
    the formula. Same parameters and state dict as :class:`RMSNormHalf`.

    Example:
        >>> x = torch.tensor([[1000.0, 0.0]], dtype=torch.float16)
        >>> RMSNormHalfSafe(2)(x)
        tensor([[1.4141, 0.0000]], dtype=torch.float16, grad_fn=<MulBackward0>)
    """

    def _normalised(self, x: Tensor) -> Tensor:
        floor = math.sqrt(self.eps)
        s = x.detach().abs().amax(-1, keepdim=True).clamp_min(floor)  # (..., 1): a zero token is scaled by sqrt(eps)
        u = x / s  # |u| <= 1
        return u * torch.rsqrt((u * u).mean(-1, keepdim=True) + (floor / s) ** 2)  # (floor/s)^2 <= 1: no underflow trap


class MRSNormHalf(_MRSNormBase):
    """MRSNorm over the last dim as its formula reads, every step in the input's dtype (naive).

    ``r_i = sqrt(x[2i]^2 + x[2i+1]^2 + eps)``, ``S = mean_i r_i``, ``y[2i:2i+2] = w_i x[2i:2i+2] / S``
    (``docs/method.md``), with :class:`~lightning_mrs.MRSNorm`'s constructor and one weight per phasor.
    An experimental baseline (module docstring): in float16 a channel at ``|x| >= 256`` squares to Inf,
    so do ``r_i`` and ``S``, and the token comes out as zeros, as :class:`RMSNormHalf`'s does.

    Example:
        >>> MRSNormHalf(6)(torch.randn(2, 5, 6)).shape
        torch.Size([2, 5, 6])
    """

    def _magnitudes(self, pairs: Tensor) -> Tensor:
        sq = pairs * pairs  # (..., P, 2) in x.dtype: Inf from |x| = 256 in float16
        return torch.sqrt(sq[..., 0] + sq[..., 1] + self.eps)  # (..., P)

    def forward(self, x: Tensor) -> Tensor:
        _check(x, type(self).__name__, self.num_channels)
        r = self._magnitudes(x.unflatten(-1, (-1, 2)))  # (..., P) in x.dtype
        y = x / r.mean(-1, keepdim=True)  # (..., C)
        if self.weight is not None:
            y = y * self.weight.to(x.dtype).repeat_interleave(2)  # each phasor's weight on its two channels
        return y


class MRSNormHalfSafe(MRSNormHalf):
    """MRSNorm over the last dim in the input's dtype, magnitudes by ``hypot`` (no intermediate overflow).

    ``r_i = hypot(x[2i], hypot(x[2i+1], sqrt(eps)))`` equals ``sqrt(x[2i]^2 + x[2i+1]^2 + eps)`` without
    forming a square; the inner ``hypot`` is at least ``sqrt(eps) > 0``, so neither the value nor its
    gradient has a 0/0 at a zero pair. In float16 it breaks only where a phasor's magnitude itself passes
    65504. Same parameters and state dict as :class:`MRSNormHalf`.

    Example:
        >>> x = torch.tensor([[1000.0, 0.0]], dtype=torch.float16)
        >>> MRSNormHalfSafe(2)(x)
        tensor([[1., 0.]], dtype=torch.float16, grad_fn=<MulBackward0>)
    """

    def _magnitudes(self, pairs: Tensor) -> Tensor:
        b = pairs[..., 1]  # (..., P)
        return torch.hypot(pairs[..., 0], torch.hypot(b, b.new_full((), math.sqrt(self.eps))))
