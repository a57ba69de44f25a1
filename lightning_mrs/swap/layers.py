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

Each norm's forward calls a module-level function wrapped by ``torch.fx.wrap``, as
:class:`~lightning_mrs.MRSNorm` does (see :mod:`lightning_mrs.modules`): ``torch.fx`` records one
call of it instead of tracing its Python control flow on the input's shape and dtype, and the
function also compiles with ``torch.jit.script`` (the shape check is skipped there: a scripted
layer gets torch's own shape error).
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_mrs.ops.validation import compute_dtype

__all__ = ["LayerNorm2d", "NormAct", "OffsetRMSNorm", "RMSNorm2d"]


def _check_channels_first(x: Tensor, num_channels: int, caller: str) -> None:
    if x.ndim < 2 or x.shape[1] != num_channels:
        raise ValueError(f"{caller}: expected (N, {num_channels}, *spatial), got shape {tuple(x.shape)}.")


def _channel_affine(y: Tensor, weight: Optional[Tensor], bias: Optional[Tensor]) -> Tensor:
    shape = [-1] + [1] * (y.ndim - 2)  # (C, 1, ..., 1) broadcast over positions
    if weight is not None:
        y = y * weight.to(y.dtype).view(shape)
    if bias is not None:
        y = y + bias.to(y.dtype).view(shape)
    return y


@torch.fx.wrap
def _layer_norm_2d(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, num_channels: int,
                   caller: str) -> Tensor:
    """:class:`LayerNorm2d`'s forward (one ``torch.fx`` node; scriptable without the check)."""
    if not torch.jit.is_scripting():
        _check_channels_first(x, num_channels, caller)
    y = F.layer_norm(x.movedim(1, -1), [num_channels], None, None, eps)
    return _channel_affine(y.movedim(-1, 1), weight, bias)  # (N, C, *spatial)


@torch.fx.wrap
def _rms_norm_2d(x: Tensor, weight: Optional[Tensor], eps: float, spatial: bool, num_channels: int,
                 caller: str) -> Tensor:
    """:class:`RMSNorm2d`'s forward (one ``torch.fx`` node; scriptable without the check)."""
    if not torch.jit.is_scripting():
        _check_channels_first(x, num_channels, caller)
    xf = x.to(compute_dtype(x.dtype))
    dims = list(range(1, x.ndim)) if spatial else [1]
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + eps)  # (N, C, *spatial)
    return _channel_affine(y, weight, None).to(x.dtype)


@torch.fx.wrap
def _offset_rms_norm(x: Tensor, weight: Optional[Tensor], num_channels: int, eps: float, offset: float) -> Tensor:
    """:class:`OffsetRMSNorm`'s forward (one ``torch.fx`` node: it branches on the input's dtype)."""
    xf = x.to(compute_dtype(x.dtype))
    y = F.rms_norm(xf, [num_channels], None, eps)  # (..., C)
    if weight is not None:
        y = y * (offset + weight.to(xf.dtype))
    return y.to(x.dtype)


class _ChannelsFirstNorm(nn.Module):
    """Parameters and the name in error messages of the channels-first layers.

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
        self._caller = f"{type(self).__name__}({num_channels})"  # names the layer in error messages
        dd = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.ones(num_channels, **dd)) if affine else None
        self.bias = nn.Parameter(torch.zeros(num_channels, **dd)) if affine and bias else None

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return f"{self.num_channels}, eps={self.eps}, affine={self.affine}"


class LayerNorm2d(_ChannelsFirstNorm):
    """LayerNorm over the channels of ``(N, C, *spatial)`` tensors, at each position.

    Example:
        >>> LayerNorm2d(6)(torch.randn(2, 6, 5, 5)).shape
        torch.Size([2, 6, 5, 5])
    """

    def forward(self, x: Tensor) -> Tensor:
        return _layer_norm_2d(x, self.weight, self.bias, self.eps, self.num_channels, self._caller)


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
        return _rms_norm_2d(x, self.weight, self.eps, self.spatial, self.num_channels, self._caller)

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
        return _offset_rms_norm(x, self.weight, self.normalized_shape[0], self.eps, self.offset)

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

