"""Dynamic erf (Derf), the second norm-free baseline: ``y = w * erf(alpha * x + s) + b``, swap target ``"derf"``.

Chen, Lu, Zhu, Sun, Liu, "Stronger Normalization-Free Transformers" (arXiv:2512.10938) search point-wise
functions to replace a norm layer and find ``erf(alpha * x + s)`` the best: DyT's element-wise form with
``erf`` (the Gaussian CDF rescaled to (-1, 1)) for ``tanh`` and a learnable shift ``s`` inside it. ``alpha``
and ``s`` are one learnable scalar each per layer (the official ``Dynamic_erf``: ``alpha_init_value=0.5``,
``shift_init_value=0.0``), ``w``, ``b`` the per-channel affine of the norm it replaces.

Everything but the function itself is DyT's (:mod:`lightning_mrs.swap.dyt`): :class:`Derf` is channels-last
(the replacement of LayerNorm, RMSNorm, every transformers ``*RMSNorm``), :class:`Derf2d` channels-first
(BatchNorm, GroupNorm, ConvNeXt's ``LayerNorm2d``); a swap carries the old per-channel scale into ``w`` and the
old bias into ``b`` exactly as for DyT; float16/bfloat16 inputs are computed in float32 and returned in their
dtype; ``eps`` is accepted and ignored. Its output is bounded by ``|w| + |b|`` whatever its input.

Example:
    >>> norm = Derf(4)
    >>> norm(torch.tensor([[0.0, 1.0, -2.0, 1e4]]))  # erf(0.5 x): bounded by |w| + |b| = 1
    tensor([[ 0.0000,  0.5205, -0.8427,  1.0000]], grad_fn=<AddBackward0>)
"""

# no ``from __future__ import annotations``: fx copies ``forward``'s annotations into a traced graph
import math
from typing import Optional

import torch
from torch import Tensor

from lightning_mrs.ops.validation import compute_dtype
from lightning_mrs.swap.dyt import PointwiseNorm, apply_affine, check_input

__all__ = ["DEFAULT_ALPHA0", "DEFAULT_SHIFT0", "Derf", "Derf2d", "derf"]

#: the paper's initial ``alpha`` and shift (the official ``Dynamic_erf``: ``alpha_init_value=0.5``,
#: ``shift_init_value=0.0``)
DEFAULT_ALPHA0, DEFAULT_SHIFT0 = 0.5, 0.0


@torch.fx.wrap
def derf(x: Tensor, alpha: Tensor, shift: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
         channel_dim: int = -1) -> Tensor:
    """``weight * erf(alpha * x + shift) + bias``, ``weight``/``bias`` per channel along ``channel_dim``.

    The single source of the two modules' forward (one ``torch.fx`` node). float16/bfloat16 are
    computed in float32 and returned in ``x``'s dtype.

    Args:
        x: any floating tensor, its channels on ``channel_dim`` (``-1`` or ``1``).
        alpha, shift: one-element tensors.
        weight, bias: ``(C,)`` or ``None``.

    Example:
        >>> derf(torch.zeros(1, 2), torch.tensor([0.5]), torch.tensor([0.0]), torch.ones(2), torch.full((2,), 2.0))
        tensor([[2., 2.]])
    """
    cd = compute_dtype(x.dtype)
    y = torch.erf(alpha.to(cd) * x.to(cd) + shift.to(cd))
    return apply_affine(y, weight, bias, channel_dim).to(x.dtype)


@torch.fx.wrap
def _derf_layer(x: Tensor, alpha: Tensor, shift: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                channel_dim: int, num_channels: int, name: str) -> Tensor:
    """The modules' forward: one ``torch.fx`` node; scriptable (without the check, as ``layers.py``'s)."""
    if not torch.jit.is_scripting():
        check_input(x, channel_dim, num_channels, name)
    return derf(x, alpha, shift, weight, bias, channel_dim)


class Derf(PointwiseNorm):
    """Dynamic erf over a channels-last input ``(..., C)``: ``w * erf(alpha * x + s) + b``.

    Args:
        num_channels: ``C``, the size of the last dim.
        eps: accepted for a norm's signature, unused (Derf divides by nothing).
        affine: a per-channel ``weight`` (ones) and, with ``bias``, a ``bias`` (zeros).
        bias: a bias besides the weight (none where the replaced norm had none).
        alpha0: the initial ``alpha``, a learnable scalar (:data:`DEFAULT_ALPHA0`, the paper's 0.5).
        shift0: the initial shift ``s``, a learnable scalar (:data:`DEFAULT_SHIFT0`, the paper's 0).

    Example:
        >>> Derf(6)(torch.randn(2, 5, 6)).shape
        torch.Size([2, 5, 6])
        >>> Derf(6, bias=False, shift0=-0.1)
        Derf(6, affine=True, bias=False, alpha0=0.5, shift0=-0.1)
    """

    #: the constructor's defaults of the initial scalars (a swap's report names them)
    DEFAULTS = {"alpha0": DEFAULT_ALPHA0, "shift0": DEFAULT_SHIFT0}

    def __init__(self, num_channels: int, eps: float = 1e-6, affine: bool = True, bias: bool = True,
                 alpha0: float = DEFAULT_ALPHA0, shift0: float = DEFAULT_SHIFT0,
                 device: Optional[torch.device | str] = None, dtype: Optional[torch.dtype] = None) -> None:
        if isinstance(shift0, bool) or not isinstance(shift0, (int, float)) or not math.isfinite(shift0):
            raise ValueError(f"{type(self).__name__}({num_channels}): shift0 must be a finite float, got {shift0!r}.")
        super().__init__(num_channels, affine, bias, alpha0, device, dtype, shift=shift0)

    def forward(self, x: Tensor) -> Tensor:
        return _derf_layer(x, self.alpha, self.shift, self.weight, self.bias, self.channel_dim, self.num_channels,
                           self._name)


class Derf2d(Derf):
    """Dynamic erf over a channels-first input ``(N, C, *spatial)``, ``w``/``b`` per channel (dim 1).

    The same parameters and state dict as :class:`Derf`.

    Example:
        >>> Derf2d(6)(torch.randn(2, 6, 4, 4)).shape
        torch.Size([2, 6, 4, 4])
    """

    _CHANNEL_DIM = 1
