"""The fast path of the common case: tokens on the CPU, straight into the C++ row kernels.

A language model calls its norms on small tensors (a few tokens of a few thousand channels;
one token at a time when decoding), where the kernel itself takes a microsecond or two and
the general path's Python work around it is all there is (``docs/performance-lm.md`` has
the profile). That work - the canonical view and its way back, the dispatch key, the
general autograd Function, the per-channel weight - is the same answer every time for one
case: a contiguous tensor with the channels last and one ``S`` per row, on the CPU, in
float32, bfloat16 or float16, with a weight (if any) of the right width on the CPU. For it,
:func:`try_rows` calls the kernels directly:

* without autograd (``torch.inference_mode``, ``torch.no_grad``, or no input that requires a
  gradient): one kernel call, no Function, no saved ``S``;
* with autograd: :class:`RowsFunction`, which saves what :class:`~.function.MRSNormFunction`
  saves (``x``, the weight, ``P * S`` per row) and calls one kernel each way.

Everything else returns ``None`` and takes the general path, whose checks
(:mod:`.validation`) raise the errors: :func:`try_rows` only accepts inputs that would pass
them, so no error is skipped. The choice of the kernel is still the dispatch table's
(:func:`.dispatch.resolve_rows`): when ``auto`` would not run the ``cpp`` backend
(``LIGHTNING_MRS_CPU_KERNELS=0``, no compiler) there is no fast path.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_mrs.ops import cpu_kernels
from lightning_mrs.ops.dispatch import compile_min_numel, resolve_rows
from lightning_mrs.ops.function import _differentiable_grads

__all__ = ["RowsFunction", "try_rows"]

_DTYPES = frozenset((torch.float32, torch.bfloat16, torch.float16))  # what the C++ kernels take
_WEIGHT_TYPES = (Tensor, torch.nn.Parameter)  # not a tensor subclass (DTensor...): general path


class RowsFunction(torch.autograd.Function):
    """MRSNorm of a contiguous channels-last CPU tensor with the C++ row kernels:
    ``apply(x, weight, eps)``, one ``S`` per row of the last dim. Double backward
    (``create_graph=True``) recomputes the forward with the reference formula, as
    :class:`~lightning_mrs.ops.function.MRSNormFunction` does."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Optional[Tensor], eps: float) -> Tensor:
        channels = x.shape[-1]
        y, r_sum = cpu_kernels.rows_forward(x, weight, eps, x.numel() // channels, 1, channels)
        ctx.save_for_backward(x, weight, r_sum)  # r_sum = P * S: one float32 per row
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Optional[Tensor], Optional[Tensor], None]:
        x, weight, r_sum = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if torch.is_grad_enabled():  # create_graph=True: a differentiable backward
            dx, dw = _differentiable_grads(x, weight, g, ctx.eps, x.ndim - 1, False, need_x, need_w)
            return dx, dw, None
        g = g.contiguous()  # (..., C)
        if g.dtype != x.dtype:  # a hook or a loss may hand back another dtype
            g = g.to(x.dtype)
        channels = x.shape[-1]
        dx, dw = cpu_kernels.rows_backward(x, weight, r_sum, g, ctx.eps, x.numel() // channels, 1, channels, need_w)
        return (dx if need_x else None), (None if dw is None else dw.to(weight.dtype)), None


def try_rows(x: Tensor, weight: Optional[Tensor], eps: float, channel_dim: int, spatial: bool,
             backend: str) -> Optional[Tensor]:
    """:func:`lightning_mrs.mrs_norm` of ``x`` through the C++ row kernels, or ``None`` when
    the input is not the common case (then the general path runs, with every check)."""
    # cheapest tests first; each costs tens of nanoseconds, and their sum is this path's cost
    if torch.compiler.is_compiling():  # the plain formula inside a graph: see mrs_norm
        return None
    if (
        backend != "auto" or spatial or type(x) is not Tensor or not x.is_cpu or x.dtype not in _DTYPES
        or not x.is_contiguous()
    ):
        return None
    ndim = x.dim()  # 1-d: which_backend's key (the canonical view) is not the rows one
    if ndim < 2 or (channel_dim != -1 and channel_dim != ndim - 1):
        return None
    channels = x.shape[-1]
    numel = x.numel()
    if channels % 2 or numel == 0 or not eps > 0:
        return None
    if weight is not None and not (
        weight.is_cpu and weight.dim() == 1 and 2 * weight.shape[0] == channels and weight.dtype in _DTYPES
        and weight.is_contiguous() and type(weight) in _WEIGHT_TYPES
    ):
        return None
    if torch._C._is_tracing() or resolve_rows(x.dtype, numel >= compile_min_numel()) != cpu_kernels.NAME:
        return None  # tracing: the plain formula is what a trace can record
    if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)):
        return RowsFunction.apply(x, weight, eps)
    return cpu_kernels.rows_forward(x, weight, eps, numel // channels, 1, channels, with_rsum=False)[0]
