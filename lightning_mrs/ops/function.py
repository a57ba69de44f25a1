"""The fused MRSNorm: an autograd Function that saves only ``x`` and one scale per group.

The reference formula (:mod:`lightning_mrs.ops.reference`) leaves autograd to save every
intermediate (``x^2``, ``r``, ``S``, ``x/S``...) and runs one kernel per op.
:class:`MRSNormFunction` saves the input and ``P * S`` per group, and calls one forward and
one backward kernel (``docs/method.md#the-fused-forward-and-backward``) of the backend chosen by
:mod:`lightning_mrs.ops.dispatch`, on the canonical 3-d view of the input
(:mod:`lightning_mrs.ops.layout`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_mrs.ops.dispatch import get_backend
from lightning_mrs.ops.layout import Canonical, canonical_of, like
from lightning_mrs.ops.reference import mrs_norm_reference

__all__ = ["MRSNormFunction", "fused_mrs_norm"]


def _per_channel(weight: Optional[Tensor]) -> Optional[Tensor]:
    # Per-channel gain (C,), built eagerly (tiny): a contiguous load in the kernels, where an
    # index c // 2 inside them would defeat vectorisation.
    return None if weight is None else weight.repeat_interleave(2)


def _fresh(view: Tensor) -> Tensor:
    """The same memory as ``view`` in a tensor that is not a view (no ``_base``).

    A custom Function must not return a view created inside it (autograd then forbids
    in-place ops on it), and a view taken outside makes every in-place op on the result go
    through CopySlices (two full copies of the gradient per op in the backward).
    """
    out = view.new_empty(0)
    return out.set_(view.untyped_storage(), view.storage_offset(), view.size(), view.stride())


class MRSNormFunction(torch.autograd.Function):
    """MRSNorm with a hand-written backward that needs only ``x`` and one scale per group.

    ``apply(x, weight, eps, channel_dim, spatial, backend, canonical)`` with ``channel_dim >= 0``,
    ``backend`` a name of :data:`lightning_mrs.ops.dispatch.BACKENDS` and ``canonical`` the
    input's :class:`~lightning_mrs.ops.layout.Canonical` (kept for the backward). The output is a fresh
    tensor, not a view of the kernel's buffer, so in-place ops on it (``relu_``,
    ``out += identity``) need no CopySlices copies in the backward. Double backward
    (``create_graph=True``) recomputes the forward with the reference formula, so
    gradgradcheck works too.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Optional[Tensor], eps: float, channel_dim: int, spatial: bool,
                backend: str, canonical: Canonical) -> Tensor:
        w2 = _per_channel(weight)
        y3, r_sum = get_backend(backend).forward(canonical.view(x), w2, eps, canonical.layout)
        ctx.save_for_backward(x, weight, r_sum)  # r_sum = P * S: one value per group
        ctx.config = (eps, channel_dim, spatial, backend, canonical)
        ctx.weight2 = w2  # (C,): the weight the forward used, not rebuilt in the backward
        y = canonical.restore(y3)
        if canonical.relayout:
            # the view was a copy (one S per sample, channels mid-memory): give y x's layout back
            return torch.empty_like(x).copy_(y)
        return _fresh(y)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Optional[Tensor], ...]:
        x, weight, r_sum = ctx.saved_tensors
        eps, channel_dim, spatial, backend, canonical = ctx.config
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if torch.is_grad_enabled():  # create_graph=True: a differentiable backward
            dx, dw = _differentiable_grads(x, weight, g, eps, channel_dim, spatial, need_x, need_w)
            return dx, dw, None, None, None, None, None
        dx3, dw = get_backend(backend).backward(
            canonical.view(x), ctx.weight2, r_sum, canonical.view(like(g, x)), eps, canonical.layout
        )
        dx = canonical.restore(dx3) if need_x else None
        dw = dw.to(weight.dtype) if need_w else None
        return dx, dw, None, None, None, None, None


def _differentiable_grads(x: Tensor, weight: Optional[Tensor], g: Tensor, eps: float, channel_dim: int,
                          spatial: bool, need_x: bool, need_w: bool) -> tuple[Optional[Tensor], Optional[Tensor]]:
    inputs = [t for t, need in ((x, need_x), (weight, need_w)) if need]
    with torch.enable_grad():
        y = mrs_norm_reference(x, weight, eps, channel_dim, spatial)
        grads = iter(torch.autograd.grad(y, inputs, g, create_graph=True, allow_unused=True))
    return (next(grads) if need_x else None), (next(grads) if need_w else None)


def fused_mrs_norm(x: Tensor, weight: Optional[Tensor], eps: float, channel_dim: int, spatial: bool,
                   backend: str, canonical: Optional[Canonical] = None) -> Tensor:
    """MRSNorm through :class:`MRSNormFunction` with one backend (no checks: the arguments
    come from :func:`lightning_mrs.mrs_norm`, or from tests forcing a backend)."""
    if canonical is None:
        canonical = canonical_of(x, channel_dim, spatial)
    return MRSNormFunction.apply(x, weight, eps, channel_dim, spatial, backend, canonical)
