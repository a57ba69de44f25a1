"""Experimental baselines that compute a norm *in the input's dtype*: the paper's half-precision setting.

Every shipped norm (``nn.RMSNorm``, transformers' ``LlamaRMSNorm``, :class:`~lightning_mrs.MRSNorm`)
computes a float16 or bfloat16 input in float32 inside, so a large channel never overflows its
statistics. The paper's failure mode ("``sum(x^2)`` ... in mixed precision leads to numerical
explosion") needs a norm that squares in half precision. These two layers reproduce that setting;
they are baselines for stress tests (swap targets ``"rms-half"`` and ``"mrs-half"``), **not layers
to train with**:

* :class:`RMSNormHalf`: ``y = w * x * rsqrt(mean(x^2) + eps)`` with ``x^2``, the mean and the
  scale in the input's dtype (the mean is accumulated as torch's ``mean`` does: in float32 on the
  CPU, then rounded). In float16 a channel with ``|x| >= 256`` squares to Inf, the scale becomes
  0 and the whole token comes out as zeros (an Inf input: NaN).
* :class:`MRSNormHalf`: MRSNorm (``docs/method.md``) in the input's dtype, each phasor magnitude
  ``r_i = sqrt(x[2i]^2 + x[2i+1]^2 + eps)`` computed as ``hypot(x[2i], hypot(x[2i+1], sqrt(eps)))``,
  which has no intermediate overflow (and no NaN gradient at a zero pair), the mean of the
  magnitudes as torch's ``mean`` does. In float16 it breaks only where a magnitude itself passes
  65504, i.e. near float16's maximum.

Both are channels-last (the last dim holds the ``C`` channels), drop-ins for ``nn.RMSNorm(C)``
and :class:`~lightning_mrs.MRSNorm`; in float32 and float64 they compute what those compute.

Example:
    >>> x = torch.full((1, 32), 300.0, dtype=torch.float16)  # every square overflows float16
    >>> RMSNormHalf(32)(x).abs().max().item(), round(MRSNormHalf(32)(x)[0, 0].item(), 3)
    (0.0, 0.707)
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

from lightning_mrs.modules import _MRSNormBase

__all__ = ["MRSNormHalf", "RMSNormHalf"]


def _check(layer: nn.Module, x: Tensor) -> None:
    """A channels-last floating input with the layer's channel count, or a ``ValueError``/``TypeError`` naming it."""
    name, c = type(layer).__name__, layer.num_channels
    if x.ndim == 0 or x.shape[-1] != c:
        raise ValueError(f"{name}({c}): expected the last dim to hold {c} channels, got input of shape "
                         f"{tuple(x.shape)}. This layer is channels-last.")
    if not x.is_floating_point():
        raise TypeError(f"{name}({c}): expected a floating-point input, got {x.dtype}.")


class RMSNormHalf(nn.RMSNorm):
    """RMSNorm over the last dim with ``x^2``, their mean and the scale in the input's dtype.

    ``y = w * x * rsqrt(mean_c(x_c^2) + eps)``: an ``nn.RMSNorm(C)`` (same weight, same state dict)
    without its upcast. An experimental baseline (module docstring): in float16 a token with a channel
    past ``|x| = 256`` comes out as zeros.

    Example:
        >>> RMSNormHalf(6)(torch.randn(2, 5, 6)).shape
        torch.Size([2, 5, 6])
    """

    def __init__(self, num_channels: int, eps: float = 1e-6, affine: bool = True,
                 device: Optional[torch.device | str] = None, dtype: Optional[torch.dtype] = None) -> None:
        if isinstance(num_channels, bool) or not isinstance(num_channels, int) or num_channels < 1:
            raise ValueError(f"RMSNormHalf: num_channels must be a positive int, got {num_channels!r}.")
        if not isinstance(eps, (int, float)) or not eps > 0:
            raise ValueError(f"RMSNormHalf: eps must be > 0 (it keeps zeros finite), got {eps}.")
        super().__init__(num_channels, eps, elementwise_affine=affine, device=device, dtype=dtype)
        self.num_channels = num_channels
        self.affine = affine

    def forward(self, x: Tensor) -> Tensor:
        _check(self, x)
        y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps)  # (..., C), all in x.dtype
        return y if self.weight is None else y * self.weight.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_channels}, eps={self.eps}, affine={self.affine}"


class MRSNormHalf(_MRSNormBase):
    """MRSNorm over the last dim computed in the input's dtype, magnitudes by ``hypot`` (no overflow).

    ``r_i = sqrt(x[2i]^2 + x[2i+1]^2 + eps)``, ``S = mean_i r_i``, ``y[2i:2i+2] = w_i x[2i:2i+2] / S``
    (``docs/method.md``), with :class:`~lightning_mrs.MRSNorm`'s constructor and one weight per phasor.
    An experimental baseline (module docstring): in float16 it breaks only where a phasor's magnitude
    passes 65504.

    Example:
        >>> MRSNormHalf(6)(torch.randn(2, 5, 6)).shape
        torch.Size([2, 5, 6])
    """

    def forward(self, x: Tensor) -> Tensor:
        _check(self, x)
        pairs = x.unflatten(-1, (-1, 2))  # (..., P, 2)
        floor = torch.full((), math.sqrt(self.eps), dtype=x.dtype, device=x.device)
        # sqrt(a^2 + b^2 + eps) as hypot(a, hypot(b, sqrt(eps))): no square is formed, the inner
        # hypot is >= sqrt(eps) > 0, so neither the value nor its gradient has a 0/0 at a zero pair
        r = torch.hypot(pairs[..., 0], torch.hypot(pairs[..., 1], floor))  # (..., P) in x.dtype
        y = x / r.mean(-1, keepdim=True)  # (..., C)
        if self.weight is not None:
            y = y * self.weight.to(x.dtype).repeat_interleave(2)  # each phasor's weight on its two channels
        return y
