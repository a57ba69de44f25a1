"""The kernels' view of an input: any layout as a 3-d tensor, and the way back.

Every kernel sees ``(A, L, C)`` when the channels have stride 1 (tokens, NHWC, a permuted view
with the channels last; the ``last`` kernels) or ``(A, C, L)`` otherwise (NCHW), with one ``S``
per ``(a, l)`` or (``spatial``) per ``a``. The mapping permutes the dims in memory order (with one
``S`` per sample, the batch dim first), then reshapes: every dense layout is a view, except one
``S`` per sample with the channels neither innermost nor next to the batch dim, or the batch dim
not outermost; those, and odd strides (slices, expanded dims), are copied. The mapping is
logical, right for any strides; only the reshape's cost depends on them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["Canonical", "DispatchKey", "Layout", "is_dense", "like"]


class Layout(NamedTuple):
    """What a kernel must know about a canonical view."""

    last: bool  # (A, L, C), channels contiguous; else (A, C, L)
    spatial: bool  # one S per a (all l together); else one per (a, l)


def _memory_order(x: Tensor, dims: Iterable[int]) -> list[int]:
    """``dims`` of ``x`` from the outermost to the innermost in memory (ties keep their order)."""
    return sorted(dims, key=lambda d: -x.stride(d))


def is_dense(x: Tensor) -> bool:
    """``x`` is a permutation of a contiguous tensor (no gaps, no overlaps; size-1 dims aside)."""
    return x.permute(_memory_order(x, range(x.ndim))).is_contiguous()


class Canonical(NamedTuple):
    """How tensors shaped like one input map to the kernels' 3-d view and back.

    Example:
        >>> import torch
        >>> x = torch.randn(2, 4, 4, 8).permute(0, 3, 1, 2)  # NCHW, stored as NHWC
        >>> canonical = Canonical.of(x, channel_dim=1, spatial=True)
        >>> canonical.layout, tuple(canonical.view(x).shape), canonical.dense
        (Layout(last=True, spatial=True), (2, 16, 8), True)
        >>> bool((canonical.restore(canonical.view(x)) == x).all())
        True
    """

    order: tuple[int, ...]  # the input's dims in the order of the view, outermost first
    permuted_shape: tuple[int, ...]  # the input's shape in that order
    shape3: tuple[int, int, int]  # (A, L, C) if layout.last else (A, C, L)
    layout: Layout
    dense: bool = False  # the view of the input is contiguous, no copy (what the C++ kernels take)
    relayout: bool = False  # the view is a copy of a dense input: results go back into its layout

    @staticmethod
    def of(x: Tensor, channel_dim: int, spatial: bool) -> "Canonical":
        """The mapping for ``x`` (``channel_dim >= 0``; ``spatial`` needs it off dim 0)."""
        shape = tuple(x.shape)
        channels = shape[channel_dim]
        numel = math.prod(shape)
        last = x.stride(channel_dim) == 1 and x.ndim > 1
        if spatial:  # one S per sample: the batch dim outermost, the channels beside it or innermost
            rest = _memory_order(x, [d for d in range(1, x.ndim) if d != channel_dim])
            order = [0, *rest, channel_dim] if last else [0, channel_dim, *rest]
            groups = shape[0]
        elif last:  # one S per position, channels innermost: all other dims are rows
            order = [*_memory_order(x, [d for d in range(x.ndim) if d != channel_dim]), channel_dim]
            groups = numel // channels
        else:  # one S per position: the dims outside the channels in memory are A, those inside L
            order = _memory_order(x, range(x.ndim))
            groups = math.prod(shape[d] for d in order[: order.index(channel_dim)])
        positions = numel // (groups * channels) if groups * channels else 0
        shape3 = (groups, positions, channels) if last else (groups, channels, positions)
        dense = x.permute(order).is_contiguous()
        relayout = not dense and is_dense(x)
        return Canonical(tuple(order), tuple(shape[d] for d in order), shape3, Layout(last, spatial), dense, relayout)

    def view(self, t: Tensor) -> Tensor:
        """``t`` (shaped like the input) as the 3-d view; a copy only where no view exists."""
        return t.permute(self.order).reshape(self.shape3)

    def restore(self, t3: Tensor) -> Tensor:
        """A 3-d kernel result back in the input's shape (the strides follow ``t3``'s)."""
        inverse = [self.order.index(d) for d in range(len(self.order))]
        return t3.reshape(self.permuted_shape).permute(inverse)


def like(g: Tensor, x: Tensor) -> Tensor:
    """``g`` with the strides of ``x`` where ``x`` is dense, so that the gradient's view has
    ``x``'s layout (one compiled kernel per layout, not per gradient layout)."""
    if g.stride() == x.stride():
        return g
    out = torch.empty_like(x, dtype=g.dtype)  # x's strides when x is dense, else contiguous
    return g if out.stride() == g.stride() else out.copy_(g)


class DispatchKey(NamedTuple):
    """What the choice of a kernel depends on (see :mod:`lightning_mrs.ops.dispatch`)."""

    device_type: str  # "cpu", "cuda", "meta", ...
    dtype: torch.dtype
    layout: Layout
    dense: bool  # the canonical view is contiguous (no copy was needed)
    large: bool  # worth a compiled kernel (at least COMPILE_MIN_NUMEL elements)
