"""MRSNorm modules: thin, drop-in wrappers around :func:`lightning_mrs.mrs_norm`.

Exportable three ways: ``torch.export`` and ``torch.jit.trace`` record the reference formula
(:func:`lightning_mrs.mrs_norm` runs it while tracing), and ``torch.jit.script`` compiles a
forward that calls it directly (TorchScript cannot compile the argument checks or the
kernels' dispatch: a scripted model runs the plain formula, and a wrong input fails with
torch's own shape error rather than the module's message).

``torch.fx.symbolic_trace`` (and what is built on it: torchvision's and timm's
``create_feature_extractor``, fx quantization) records each forward as one call of
:func:`_mrs_norm_layer`, a function wrapped by ``torch.fx.wrap`` as timm wraps its own
untraceable functions: the traced graph runs it unchanged, the shape check and the kernels
included, and ``torch.jit.script`` of the traced graph compiles its reference-formula branch.
"""

# no ``from __future__ import annotations``: fx copies ``forward``'s annotations into a traced
# graph's code, where TorchScript must resolve them (a string "Tensor" it cannot)
from typing import Optional

import torch
from torch import Tensor, nn

from lightning_mrs.ops.mrs_norm import normalize
from lightning_mrs.ops.reference import mrs_norm_reference

__all__ = ["MRSNorm", "MRSNorm2d"]


def _layer_repr(caller: str, eps: float, affine: bool, channel_dim: int, spatial: bool) -> str:
    """The module's ``repr`` (``MRSNorm(8, eps=1e-06, affine=True)``) from ``caller`` (``MRSNorm(8)``)."""
    more = f", spatial={spatial}" if channel_dim == 1 else ""
    return f"{caller[:-1]}, eps={eps}, affine={affine}{more})"


@torch.fx.wrap
def _mrs_norm_layer(x: Tensor, weight: Optional[Tensor], eps: float, channel_dim: int, spatial: bool,
                   num_channels: int, backend: str, caller: str) -> Tensor:
    """The forward of :class:`MRSNorm` (``channel_dim=-1``) and :class:`MRSNorm2d` (``channel_dim=1``).

    A module-level function wrapped by ``torch.fx.wrap`` (what timm's ``register_notrace_function``
    and torchvision's ``roi_align`` do): ``torch.fx.symbolic_trace`` records one call of it instead
    of tracing the shape check (Python control flow on ``x.shape``, which fx cannot trace), and the
    traced ``GraphModule`` runs it as it is, the check and the kernels included. TorchScript
    compiles only the first branch, the reference formula, so a scripted module or a scripted fx
    graph runs the plain formula.

    Raises:
        ValueError: ``x`` does not hold ``num_channels`` channels on ``channel_dim``, naming the layer.
    """
    if torch.jit.is_scripting():  # TorchScript compiles only this branch: the reference formula
        return mrs_norm_reference(x, weight, eps, x.ndim - 1 if channel_dim == -1 else channel_dim, spatial)
    if channel_dim == -1:
        if x.ndim == 0 or x.shape[-1] != num_channels:
            raise ValueError(
                f"{_layer_repr(caller, eps, weight is not None, channel_dim, spatial)}: expected the last dim "
                f"to hold {num_channels} channels, got input of shape {tuple(x.shape)}. MRSNorm is "
                "channels-last; use MRSNorm2d for (N, C, *spatial) tensors."
            )
    elif x.ndim < 2 or x.shape[1] != num_channels:
        raise ValueError(
            f"{_layer_repr(caller, eps, weight is not None, channel_dim, spatial)}: expected input of shape "
            f"(N, {num_channels}, *spatial), got {tuple(x.shape)}. MRSNorm2d is channels-first; use MRSNorm "
            "for channels-last tensors."
        )
    return normalize(x, weight, eps, channel_dim, spatial, backend, caller)


class _MRSNormBase(nn.Module):
    """Shared constructor: ``num_channels`` first, one weight per phasor, no bias."""

    #: Implementation of :func:`lightning_mrs.mrs_norm` (``"auto"``: fused kernels;
    #: ``"eager"``: the reference formula). Set per instance, e.g. ``norm.backend = "eager"``.
    backend: str = "auto"

    def __init__(
        self,
        num_channels: int,
        eps: float = 1e-6,
        affine: bool = True,
        device: Optional[torch.device | str] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        if isinstance(num_channels, bool) or not isinstance(num_channels, int) or num_channels < 1:
            raise ValueError(f"{name}: num_channels must be a positive even int, got {num_channels!r}.")
        if num_channels % 2:
            raise ValueError(
                f"{name}({num_channels}): MRSNorm pairs adjacent channels into 2-D phasors, so "
                "num_channels must be even. Use an even width (e.g. "
                f"{num_channels + 1}), or keep a LayerNorm/RMSNorm for this layer."
            )
        if not eps > 0:
            raise ValueError(f"{name}: eps must be > 0 (it keeps zeros finite), got {eps}.")
        self._caller = f"{name}({num_channels})"  # names the layer in error messages
        self.num_channels = num_channels
        self.num_phasors = num_channels // 2
        self.eps = eps
        self.affine = affine
        if affine:
            self.weight = nn.Parameter(torch.empty(self.num_phasors, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_channels}, eps={self.eps}, affine={self.affine}"


class MRSNorm(_MRSNormBase):
    """MRSNorm over the last dim (channels-last): a drop-in for ``nn.LayerNorm(C)``.

    One scale ``S`` per position; ``C // 2`` learnable phasor weights, no bias.

    Example:
        >>> norm = MRSNorm(768)
        >>> norm(torch.randn(2, 197, 768)).shape
        torch.Size([2, 197, 768])
    """

    def forward(self, x: Tensor) -> Tensor:
        if torch.jit.is_scripting():  # TorchScript compiles only this branch: the reference formula
            return mrs_norm_reference(x, self.weight, self.eps, x.ndim - 1, False)
        return _mrs_norm_layer(x, self.weight, self.eps, -1, False, self.num_channels, self.backend, self._caller)


class MRSNorm2d(_MRSNormBase):
    """MRSNorm over dim 1 of ``(N, C, *spatial)`` tensors (any number of spatial dims).

    Args:
        spatial: ``False`` gives one ``S`` per (sample, position), like ConvNeXt's
            LayerNorm2d; ``True`` one ``S`` per sample over all phasors and positions, like
            ``GroupNorm(1, C)``.

    Example:
        >>> norm = MRSNorm2d(64, spatial=True)
        >>> norm(torch.randn(8, 64, 32, 32)).shape
        torch.Size([8, 64, 32, 32])
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
        self.spatial = spatial
        super().__init__(num_channels, eps, affine, device, dtype)

    def forward(self, x: Tensor) -> Tensor:
        if torch.jit.is_scripting():  # TorchScript compiles only this branch: the reference formula
            return mrs_norm_reference(x, self.weight, self.eps, 1, self.spatial)
        return _mrs_norm_layer(x, self.weight, self.eps, 1, self.spatial, self.num_channels, self.backend, self._caller)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, spatial={self.spatial}"
