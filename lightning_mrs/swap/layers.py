"""Layers the swap builds besides MRSNorm: channels-first baselines and the norm+act holder.

* :class:`LayerNorm2d`: LayerNorm over dim 1 of ``(N, C, *spatial)`` at each position (the
  ``target="layer"`` replacement of ConvNeXt-style LayerNorm2d).
* :class:`RMSNorm2d`: RMSNorm over dim 1, per position or (``spatial=True``) per sample
  (the ``target="rms"`` replacement of channels-first norms).
* :class:`OffsetRMSNorm`: RMSNorm whose weight is an offset from a constant, ``rms(x) * (offset + w)``
  (the ``target="rms"`` replacement of Gemma's norms: it stores ``w`` as Gemma's checkpoints
  do, so the swapped model saves in the family's convention, as Liger's ``offset=1.0``).
* :class:`NormAct`: the replacement of timm's fused norm+act layers (``BatchNormAct2d``...):
  ``act(drop(norm(x)))`` with the old ``drop``/``act`` modules kept as they were.

These are plain ``nn.Module`` s (not ``nn.LayerNorm`` subclasses) so nobody mistakes them for
channels-last layers.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_mrs.ops.validation import compute_dtype

__all__ = ["LayerNorm2d", "NormAct", "OffsetRMSNorm", "RMSNorm2d"]


class _ChannelsFirstNorm(nn.Module):
    """Parameters, input check and affine step of the channels-first layers.

    Its constructor, defaults included, is :class:`LayerNorm2d`'s (which adds none of its own);
    :class:`RMSNorm2d` has no bias.
    """

    def __init__(
        self,
        num_channels: int,
        eps: float = 1e-6,
        affine: bool = True,
        bias: bool = True,
        device: Optional[torch.device | str] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        self.num_channels = num_channels
        self.eps = eps
        self.affine = affine
        dd = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.ones(num_channels, **dd)) if affine else None
        self.bias = nn.Parameter(torch.zeros(num_channels, **dd)) if affine and bias else None

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def _check(self, x: Tensor) -> None:
        if x.ndim < 2 or x.shape[1] != self.num_channels:
            raise ValueError(
                f"{type(self).__name__}({self.num_channels}): expected (N, {self.num_channels}, "
                f"*spatial), got shape {tuple(x.shape)}."
            )

    def extra_repr(self) -> str:
        return f"{self.num_channels}, eps={self.eps}, affine={self.affine}"

    def _affine(self, y: Tensor) -> Tensor:
        shape = (-1,) + (1,) * (y.ndim - 2)  # (C, 1, ..., 1) broadcast over positions
        if self.weight is not None:
            y = y * self.weight.to(y.dtype).view(shape)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype).view(shape)
        return y


class LayerNorm2d(_ChannelsFirstNorm):
    """LayerNorm over the channels of ``(N, C, *spatial)`` tensors, at each position.

    Example:
        >>> LayerNorm2d(6)(torch.randn(2, 6, 5, 5)).shape
        torch.Size([2, 6, 5, 5])
    """

    def forward(self, x: Tensor) -> Tensor:
        self._check(x)
        y = F.layer_norm(x.movedim(1, -1), (self.num_channels,), None, None, self.eps)
        return self._affine(y.movedim(-1, 1))  # (N, C, *spatial)


class RMSNorm2d(_ChannelsFirstNorm):
    """RMSNorm over dim 1 of ``(N, C, *spatial)``; half inputs are computed in fp32.

    Args:
        spatial: ``False``: one RMS per (sample, position) over the channels; ``True``: one
            RMS per sample over all channels and positions (the RMS analogue of
            ``GroupNorm(1, C)``).

    Example:
        >>> RMSNorm2d(6, spatial=True)(torch.randn(2, 6, 5, 5)).shape
        torch.Size([2, 6, 5, 5])
    """

    def __init__(
        self,
        num_channels: int,
        eps: float = 1e-6,
        affine: bool = True,
        spatial: bool = False,
        device: Optional[torch.device | str] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__(num_channels, eps, affine, False, device, dtype)
        self.spatial = spatial

    def forward(self, x: Tensor) -> Tensor:
        self._check(x)
        xf = x.to(compute_dtype(x.dtype))
        dims = tuple(range(1, x.ndim)) if self.spatial else (1,)
        y = xf * torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + self.eps)  # (N, C, *spatial)
        return self._affine(y).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, spatial={self.spatial}"


class OffsetRMSNorm(nn.Module):
    """RMSNorm over the last dim with the weight stored as an offset: ``rms(x) * (offset + w)``.

    Half-precision inputs are computed in fp32 and returned in their dtype (as Gemma's norms do).

    Args:
        normalized_shape: ``C``, the size of the last dim.
        eps: added to the mean square.
        affine: a learnable ``weight`` (initialised to 0: the scale starts at ``offset``).
        offset: the constant the weight is added to (Gemma: 1).

    Example:
        >>> norm = OffsetRMSNorm(6)
        >>> torch.allclose(norm(torch.ones(2, 6)), torch.ones(2, 6))  # w = 0: scale 1
        True
    """

    def __init__(
        self,
        normalized_shape: int,
        eps: float = 1e-6,
        affine: bool = True,
        offset: float = 1.0,
        device: Optional[torch.device | str] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        self.normalized_shape = (int(normalized_shape),)
        self.eps = eps
        self.offset = float(offset)
        self.weight = nn.Parameter(torch.zeros(self.normalized_shape, device=device, dtype=dtype)) if affine else None

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.zeros_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        xf = x.to(compute_dtype(x.dtype))
        y = F.rms_norm(xf, self.normalized_shape, None, self.eps)  # (..., C)
        if self.weight is not None:
            y = y * (self.offset + self.weight.to(xf.dtype))
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape[0]}, eps={self.eps}, affine={self.weight is not None}, offset={self.offset:g}"


class NormAct(nn.Module):
    """A swapped fused norm+act layer: ``act(drop(norm(x)))``.

    timm's ``BatchNormAct2d``, ``GroupNormAct``, ``LayerNormAct(2d)``, ``RmsNormAct(2d)`` and
    ``FrozenBatchNormAct2d`` apply their own ``drop`` and ``act`` after the norm. The swap
    moves those very modules here, next to the new ``norm``, so the activation (and
    dropout/drop-block) keeps working and the state dict reads ``<name>.norm.weight``.

    Example:
        >>> from lightning_mrs import MRSNorm2d
        >>> layer = NormAct(MRSNorm2d(8, spatial=True), act=nn.ReLU())
        >>> bool((layer(torch.randn(2, 8, 4, 4)) >= 0).all())
        True
    """

    def __init__(self, norm: nn.Module, drop: Optional[nn.Module] = None, act: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.norm = norm
        self.drop = drop if drop is not None else nn.Identity()
        self.act = act if act is not None else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.drop(self.norm(x)))

