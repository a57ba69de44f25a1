"""The kernels' view of an input: any layout as a 3-d tensor, and the way back.

Every kernel sees one of two canonical shapes, with one ``S`` per ``(a, l)``
(``spatial=False``) or per ``a`` (``spatial=True``):

* ``(A, L, C)`` when the channels have stride 1 (tokens, NHWC, ``channels_last``,
  a permuted view with the channels last): the ``last`` kernels;
* ``(A, C, L)`` otherwise (NCHW, a channels-first view of any memory format).

The mapping moves the channel dim (to the end, or next to the batch dim for
``spatial=True``, or nowhere), then reshapes: a view for every dense layout, a copy for
odd strides (slices, expanded dims). It is always a *logical* mapping, so it is right for
any strides; only the cost of the reshape depends on them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["Canonical", "DispatchKey", "Layout", "like"]


class Layout(NamedTuple):
    """What a kernel must know about a canonical view."""

    last: bool  # (A, L, C), channels contiguous; else (A, C, L)
    spatial: bool  # one S per a (all l together); else one per (a, l)


class Canonical(NamedTuple):
    """How tensors shaped like one input map to the kernels' 3-d view and back.

    Example:
        >>> import torch
        >>> x = torch.randn(2, 8, 4, 4).permute(0, 2, 3, 1)  # channels last, as a view
        >>> can = Canonical.of(x, channel_dim=3, spatial=True)
        >>> can.layout, tuple(can.view(x).shape)
        (Layout(last=True, spatial=True), (2, 16, 8))
        >>> bool((can.restore(can.view(x)) == x).all())
        True
    """

    channel_dim: int  # of the input, non-negative
    moved_to: int  # where the channel dim sits in the view before the reshape
    moved_shape: tuple[int, ...]  # the input's shape after that move
    shape3: tuple[int, int, int]  # (A, L, C) if layout.last else (A, C, L)
    layout: Layout

    @staticmethod
    def of(x: Tensor, channel_dim: int, spatial: bool) -> "Canonical":
        """The mapping for ``x`` (``channel_dim >= 0``; ``spatial`` needs it off dim 0)."""
        shape = tuple(x.shape)
        channels = shape[channel_dim]
        numel = math.prod(shape)
        last = x.stride(channel_dim) == 1 and x.ndim > 1
        if last:
            moved_to = x.ndim - 1
        else:
            moved_to = 1 if spatial else channel_dim
        moved = list(shape)
        moved.insert(moved_to, moved.pop(channel_dim))
        if spatial:
            groups = shape[0]
        else:
            groups = numel // channels if last else math.prod(shape[:channel_dim])
        positions = numel // (groups * channels) if groups * channels else 0
        shape3 = (groups, positions, channels) if last else (groups, channels, positions)
        return Canonical(channel_dim, moved_to, tuple(moved), shape3, Layout(last, spatial))

    def view(self, t: Tensor) -> Tensor:
        """``t`` (shaped like the input) as the 3-d view; a copy only for odd strides."""
        return t.movedim(self.channel_dim, self.moved_to).reshape(self.shape3)

    def is_dense(self, x: Tensor) -> bool:
        """The view of ``x`` is contiguous and needs no copy (what the C++ kernels take)."""
        return x.movedim(self.channel_dim, self.moved_to).is_contiguous()

    def restore(self, t3: Tensor) -> Tensor:
        """A 3-d kernel result back in the input's shape (the strides follow ``t3``'s)."""
        return t3.reshape(self.moved_shape).movedim(self.moved_to, self.channel_dim)


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
