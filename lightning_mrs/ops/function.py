"""The fused MRSNorm: an autograd Function that saves only ``x`` and one scale per group.

The reference formula (:mod:`lightning_mrs.ops.reference`) leaves autograd to save every
intermediate (``x^2``, ``r``, ``S``, ``x/S``...) and runs one kernel per op.
:class:`MRSNormFunction` saves the input and ``P * S`` per group, and calls one forward and
one backward kernel (``docs/method.md#the-fused-forward-and-backward``) through the plan of
the call (:mod:`lightning_mrs.ops.plan`): the C++ row kernels on the tensor itself, or a
backend's kernels on the canonical 3-d view of the input.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_mrs.ops.reference import mrs_norm_reference

__all__ = ["MRSNormFunction"]


class MRSNormFunction(torch.autograd.Function):
    """MRSNorm with a hand-written backward that needs only ``x`` and one scale per group.

    ``apply(x, weight, eps, plan)``, ``plan`` a :mod:`~lightning_mrs.ops.plan` plan resolved for
    these arguments (its ``forward``/``backward`` run the kernels; kept for the backward). The
    output is a fresh tensor, not a view of a kernel's buffer, so in-place ops on it
    (``relu_``, ``out += identity``) need no CopySlices copies in the backward. Double backward
    (``create_graph=True``) recomputes the forward with the reference formula, so gradgradcheck
    works too. (``torch.func`` transforms never reach it: the op runs the reference formula
    under them, see :mod:`lightning_mrs.ops.mrs_norm`.)
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Optional[Tensor], eps: float, plan: Any) -> Tensor:
        y, r_sum = plan.forward(x, weight, eps)
        ctx.save_for_backward(x, weight, r_sum)  # r_sum = P * S: one value per group
        ctx.eps, ctx.plan = eps, plan
        return y

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Optional[Tensor], Optional[Tensor], None, None]:
        x, weight, r_sum = ctx.saved_tensors
        plan = ctx.plan
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if torch.is_grad_enabled():  # create_graph=True: a differentiable backward
            dx, dw = differentiable_grads(x, weight, g, ctx.eps, plan.channel_dim, plan.spatial, need_x, need_w)
            return dx, dw, None, None
        dx, dw = plan.backward(x, weight, r_sum, g, ctx.eps, need_w)
        return (dx if need_x else None), dw, None, None


def differentiable_grads(x: Tensor, weight: Optional[Tensor], g: Tensor, eps: float, channel_dim: int,
                         spatial: bool, need_x: bool, need_w: bool) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """``(dx, dw)`` of the reference formula for ``g``, differentiable again (double backward)."""
    inputs = [t for t, need in ((x, need_x), (weight, need_w)) if need]
    with torch.enable_grad():
        y = mrs_norm_reference(x, weight, eps, channel_dim, spatial)
        grads = iter(torch.autograd.grad(y, inputs, g, create_graph=True, allow_unused=True))
    return (next(grads) if need_x else None), (next(grads) if need_w else None)
