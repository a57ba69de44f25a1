"""Dynamic Tanh (DyT), the norm-free baseline: ``y = w * tanh(alpha * x) + b``, swap target ``"dyt"``.

Zhu, Chen, He, LeCun, Liu, "Transformers without Normalization" (CVPR 2025, arXiv:2503.10622) replace
every norm layer by an element-wise ``tanh`` with one learnable scalar ``alpha`` per layer and the
per-channel affine ``w``, ``b`` of the norm it replaces. It computes no statistic, so its output is
bounded by ``|w| + |b|`` whatever its input: the natural third answer, beside RMSNorm and MRSNorm, to
"which layer keeps a pure-float16 run alive".

* :class:`DyT` is channels-last (``(..., C)``: tokens), the replacement of ``nn.LayerNorm``, ``nn.RMSNorm``,
  every transformers ``*RMSNorm`` and timm's ``LayerNorm``/``RmsNorm``;
* :class:`DyT2d` is channels-first (``(N, C, *spatial)``), the replacement of BatchNorm, GroupNorm,
  InstanceNorm and ConvNeXt's ``LayerNorm2d``/``RmsNorm2d`` (per position or per sample makes no
  difference: DyT is element-wise).

The initialisation is the paper's, taken from the official code (github.com/jiachenzhu/DyT):
``alpha = alpha0``, ``w = 1``, ``b = 0``, with ``alpha0 = 0.5`` by default (``dynamic_tanh.py``'s
``alpha_init_value=0.5``, the value of its non-LLM models). For LLaMA the official training
commands (``other_tasks/LLaMA/README.md``) set ``alpha0`` per model size, falling as the model grows,
larger for the DyT in front of attention (``attn_alpha_init_value``) than for the one in front of the
FFN and the final one (``ffn_``/``dec_alpha_init_value``): :data:`LLAMA_ALPHA0`. The official LLaMA layer has no bias
(``w * tanh(alpha * x)``, replacing RMSNorm), and so does a swapped layer whose source had none.
The official LLaMA model also multiplies the embeddings by a learnable scalar initialised to
``sqrt(d_model)``; a norm swap does not add it.

A swap carries the old affine over where it means the same: the old per-channel scale becomes ``w``
(LayerNorm's, RMSNorm's and BatchNorm's weight; Gemma's ``1 + w``; an MRS phasor weight on both its
channels) and the old bias ``b`` (none where the source has none). BatchNorm's running statistics have
no counterpart and are dropped.

float16 and bfloat16 inputs are computed in float32 and returned in their dtype, as every shipped norm
here; ``eps`` is accepted (the drop-in signature) and ignored: nothing is divided.

Example:
    >>> norm = DyT(4)
    >>> norm(torch.tensor([[0.0, 1.0, -2.0, 1e4]]))  # tanh(0.5 x): bounded by |w| + |b| = 1
    tensor([[ 0.0000,  0.4621, -0.7616,  1.0000]], grad_fn=<AddBackward0>)
"""

# no ``from __future__ import annotations``: fx copies ``forward``'s annotations into a traced graph
from typing import Optional

import torch
from torch import Tensor, nn

from lightning_mrs.ops.validation import compute_dtype, positive_number

__all__ = ["DEFAULT_ALPHA0", "DyT", "DyT2d", "LLAMA_ALPHA0", "PointwiseNorm", "apply_affine", "check_input", "dyt"]

#: the paper's default initial ``alpha`` (``alpha_init_value=0.5`` in the official ``dynamic_tanh.py``)
DEFAULT_ALPHA0 = 0.5
#: the paper's LLaMA 2 ``alpha0``, (in front of attention, the others: in front of the FFN and the final
#: norm), by model: the official ``other_tasks/LLaMA/README.md`` (``--attn_alpha_init_value``,
#: ``--ffn_alpha_init_value``, ``--dec_alpha_init_value``); widths 4096, 5120, 8192, 8192
LLAMA_ALPHA0 = {"7b": (0.8, 0.2), "13b": (0.6, 0.15), "34b": (0.2, 0.05), "70b": (0.2, 0.05)}


def apply_affine(y: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], channel_dim: int) -> Tensor:
    """``y * weight + bias`` with ``weight``/``bias`` ``(C,)`` per channel along ``channel_dim`` (``-1`` or ``1``),
    in ``y``'s dtype: the tail every point-wise norm here shares (DyT, :mod:`lightning_mrs.swap.derf`)."""
    shape = [-1] + [1] * (y.ndim - 2) if channel_dim == 1 else [-1]  # (C, 1, ..., 1) or (C,)
    if weight is not None:
        y = y * weight.to(y.dtype).view(shape)
    if bias is not None:
        y = y + bias.to(y.dtype).view(shape)
    return y


@torch.fx.wrap
def dyt(x: Tensor, alpha: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
        channel_dim: int = -1) -> Tensor:
    """``weight * tanh(alpha * x) + bias``, ``weight``/``bias`` per channel along ``channel_dim``.

    The single source of the two modules' forward (one ``torch.fx`` node). float16/bfloat16 are
    computed in float32 and returned in ``x``'s dtype.

    Args:
        x: any floating tensor, its channels on ``channel_dim`` (``-1`` or ``1``).
        alpha: a one-element tensor.
        weight, bias: ``(C,)`` or ``None``.

    Example:
        >>> dyt(torch.zeros(2, 3), torch.tensor([0.5]), torch.ones(3), torch.full((3,), 2.0))
        tensor([[2., 2., 2.],
                [2., 2., 2.]])
    """
    cd = compute_dtype(x.dtype)
    return apply_affine(torch.tanh(alpha.to(cd) * x.to(cd)), weight, bias, channel_dim).to(x.dtype)


def check_input(x: Tensor, channel_dim: int, num_channels: int, name: str) -> None:
    """``x`` is a floating input with ``num_channels`` channels on ``channel_dim``, or an error naming the layer
    (``name``: its class, ``<Name>`` channels-last and ``<Name>2d`` channels-first)."""
    if channel_dim == -1 and (x.ndim == 0 or x.shape[-1] != num_channels):
        raise ValueError(f"{name}({num_channels}): expected the last dim to hold {num_channels} channels, got input "
                         f"of shape {tuple(x.shape)}. {name} is channels-last; use {name}2d for (N, C, *spatial) "
                         "tensors.")
    if channel_dim == 1 and (x.ndim < 2 or x.shape[1] != num_channels):
        raise ValueError(f"{name}({num_channels}): expected (N, {num_channels}, *spatial), got shape {tuple(x.shape)}. "
                         f"{name} is channels-first; use {name.removesuffix('2d')} for (..., C) tensors.")
    if not x.is_floating_point():
        raise TypeError(f"{name}({num_channels}): expected a floating-point input, got {x.dtype}.")


@torch.fx.wrap
def _dyt_layer(x: Tensor, alpha: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], channel_dim: int,
               num_channels: int, name: str) -> Tensor:
    """The modules' forward: one ``torch.fx`` node; scriptable (without the check, as ``layers.py``'s)."""
    if not torch.jit.is_scripting():
        check_input(x, channel_dim, num_channels, name)
    return dyt(x, alpha, weight, bias, channel_dim)


class PointwiseNorm(nn.Module):
    """What DyT and Derf share as drop-ins for a norm: ``C`` first, ``eps`` accepted and unused, the per-channel
    affine (``affine``, ``bias``), learnable scalars (``alpha`` and any the subclass names) with their initial
    values, ``device``/``dtype``, ``reset_parameters`` and ``extra_repr``. A subclass defines ``forward``.

    Args:
        num_channels: ``C``.
        affine: a per-channel ``weight`` (ones) and, with ``bias``, a ``bias`` (zeros).
        bias: a bias besides the weight.
        alpha0: the initial ``alpha`` (a finite float > 0).
        scalars: the subclass's other learnable scalars: name -> initial value (checked by the subclass),
            each a one-element parameter ``name`` and an attribute ``<name>0``.
    """

    _CHANNEL_DIM = -1  # the 2d subclass: 1

    def __init__(self, num_channels: int, affine: bool, bias: bool, alpha0: float,
                 device: Optional[torch.device | str], dtype: Optional[torch.dtype], **scalars: float) -> None:
        super().__init__()
        name = type(self).__name__
        if isinstance(num_channels, bool) or not isinstance(num_channels, int) or num_channels < 1:
            raise ValueError(f"{name}: num_channels must be a positive int, got {num_channels!r}.")
        if not positive_number(alpha0):
            raise ValueError(f"{name}({num_channels}): alpha0 must be a finite float > 0, got {alpha0!r}.")
        self.num_channels = num_channels
        self.channel_dim = self._CHANNEL_DIM
        self.affine = affine
        self._name = name  # names the layer in error messages
        self._initial = {"alpha": float(alpha0), **{k: float(v) for k, v in scalars.items()}}
        dd = {"device": device, "dtype": dtype}
        for scalar, value in self._initial.items():
            setattr(self, f"{scalar}0", value)
            setattr(self, scalar, nn.Parameter(torch.empty(1, **dd)))
        self.weight = nn.Parameter(torch.empty(num_channels, **dd)) if affine else None
        self.bias = nn.Parameter(torch.empty(num_channels, **dd)) if affine and bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for scalar, value in self._initial.items():
            nn.init.constant_(getattr(self, scalar), value)
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        initial = ", ".join(f"{scalar}0={value:g}" for scalar, value in self._initial.items())
        return f"{self.num_channels}, affine={self.affine}, bias={self.bias is not None}, {initial}"


class DyT(PointwiseNorm):
    """Dynamic Tanh over a channels-last input ``(..., C)``: ``w * tanh(alpha * x) + b``.

    Args:
        num_channels: ``C``, the size of the last dim.
        eps: accepted for a norm's signature, unused (DyT divides by nothing).
        affine: a per-channel ``weight`` (ones) and, with ``bias``, a ``bias`` (zeros).
        bias: a bias besides the weight (the paper's LLaMA layer has none).
        alpha0: the initial ``alpha`` (a learnable scalar; :data:`DEFAULT_ALPHA0`, the paper's).

    Example:
        >>> DyT(6)(torch.randn(2, 5, 6)).shape
        torch.Size([2, 5, 6])
        >>> DyT(6, bias=False, alpha0=0.8)
        DyT(6, affine=True, bias=False, alpha0=0.8)
    """

    #: the constructor's defaults of the initial scalars (a swap's report names them)
    DEFAULTS = {"alpha0": DEFAULT_ALPHA0}

    def __init__(self, num_channels: int, eps: float = 1e-6, affine: bool = True, bias: bool = True,
                 alpha0: float = DEFAULT_ALPHA0, device: Optional[torch.device | str] = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__(num_channels, affine, bias, alpha0, device, dtype)

    def forward(self, x: Tensor) -> Tensor:
        return _dyt_layer(x, self.alpha, self.weight, self.bias, self.channel_dim, self.num_channels, self._name)


class DyT2d(DyT):
    """Dynamic Tanh over a channels-first input ``(N, C, *spatial)``, ``w``/``b`` per channel (dim 1).

    The same parameters and state dict as :class:`DyT`.

    Example:
        >>> DyT2d(6)(torch.randn(2, 6, 4, 4)).shape
        torch.Size([2, 6, 4, 4])
    """

    _CHANNEL_DIM = 1
