"""The op as two ``torch.library`` custom ops: what ``torch.compile`` sees of MRSNorm.

Inside ``torch.compile``, :func:`lightning_mrs.mrs_norm` (and so every module) calls
``torch.ops.lightning_mrs.mrs_norm``: Dynamo records one node (no graph break), its fake
kernel tells AOTAutograd and Inductor the outputs' shapes, dtypes and strides, and its
registered autograd formula puts ``torch.ops.lightning_mrs.mrs_norm_backward`` into the
backward graph. When the compiled graph runs, both call the plan an eager call of the same
kind runs (:func:`lightning_mrs.ops.dispatch.plan_for`): the hand-written C++ kernels on the
CPU, the Triton kernels on CUDA, and what the backward needs saved is only ``x``, the weight
and ``P * S`` per group.

Why not let Inductor compile the formula: it reads a channel's partner with stride-2 loads and
the per-phasor weight with an index ``c // 2``, and emits scalar loops for them (no SIMD); on
a compiled Llama training step that cost x1.07-1.13 of the model's own ``LlamaRMSNorm``
(``docs/performance-lm.md#torchcompile``). The custom op is opaque to Inductor's fusion (a
residual add before it stays its own kernel), which costs less than the scalar loops saved.

Outputs: ``y`` with the strides of ``torch.empty_like(x)`` (the fake kernel's promise), and
``r_sum`` flattened to ``(groups,)`` in the compute dtype; the backward op returns ``dx`` like
``x`` and ``dw`` like the weight (an empty tensor when no weight gradient is asked for: an op
cannot return ``None``). Double backward through a compiled region is not supported.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_mrs.ops.dispatch import plan_for
from lightning_mrs.ops.validation import compute_dtype

__all__ = ["mrs_norm_backward_op", "mrs_norm_op"]


def _groups(x: Tensor, channel_dim: int, spatial: bool) -> Any:
    """Groups of one ``S`` each (symbolic under dynamic shapes)."""
    return x.shape[0] if spatial else x.numel() // x.shape[channel_dim]


def _as_promised(t: Tensor, x: Tensor) -> Tensor:
    """``t`` (shaped like ``x``) with the strides of ``torch.empty_like(x)``, as the fake
    kernels promise: Inductor checks them, and plans may differ on size-1 dims or, for inputs
    with gaps, on the whole layout."""
    promised = torch.empty_like(x, device="meta").stride()
    if t.stride() == promised:
        return t
    if all(a == b or n == 1 for a, b, n in zip(t.stride(), promised, t.shape)):
        return t.as_strided(t.shape, promised)  # the same memory: only size-1 dims differ
    return torch.empty_like(x, dtype=t.dtype).copy_(t)


@torch.library.custom_op("lightning_mrs::mrs_norm", mutates_args=())
def mrs_norm_op(x: Tensor, weight: Optional[Tensor], eps: float, channel_dim: int, spatial: bool,
                backend: str) -> tuple[Tensor, Tensor]:
    """``(y, r_sum)`` of MRSNorm (``channel_dim >= 0``, arguments checked by the caller)."""
    plan = plan_for(x, weight, eps, channel_dim, spatial, backend, "mrs_norm")
    y, r_sum = plan.forward(x, weight, eps)
    return (y if plan.like_x else _as_promised(y, x)), r_sum.reshape(-1)


@mrs_norm_op.register_fake
def _(x: Tensor, weight: Optional[Tensor], eps: float, channel_dim: int, spatial: bool,
      backend: str) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), x.new_empty(_groups(x, channel_dim, spatial), dtype=compute_dtype(x.dtype))


@torch.library.custom_op("lightning_mrs::mrs_norm_backward", mutates_args=())
def mrs_norm_backward_op(grad: Tensor, x: Tensor, weight: Optional[Tensor], r_sum: Tensor, eps: float,
                         channel_dim: int, spatial: bool, backend: str,
                         need_weight_grad: bool) -> tuple[Tensor, Tensor]:
    """``(dx, dw)`` of :func:`mrs_norm_op` for the upstream gradient ``grad``."""
    plan = plan_for(x, weight, eps, channel_dim, spatial, backend, "mrs_norm")
    dx, dw = plan.backward(x, weight, r_sum.view(plan.rsum_shape), grad, eps, need_weight_grad)
    return (dx if plan.like_x else _as_promised(dx, x)), (dw if dw is not None else x.new_empty(0))


@mrs_norm_backward_op.register_fake
def _(grad: Tensor, x: Tensor, weight: Optional[Tensor], r_sum: Tensor, eps: float, channel_dim: int,
      spatial: bool, backend: str, need_weight_grad: bool) -> tuple[Tensor, Tensor]:
    dw = torch.empty_like(weight) if need_weight_grad and weight is not None else x.new_empty(0)
    return torch.empty_like(x), dw


def _setup_context(ctx: Any, inputs: tuple, output: tuple[Tensor, Tensor]) -> None:
    x, weight, eps, channel_dim, spatial, backend = inputs
    ctx.save_for_backward(x, weight, output[1])  # r_sum = P * S: one value per group
    ctx.config = (eps, channel_dim, spatial, backend)


def _backward(ctx: Any, g: Tensor, _g_rsum: Optional[Tensor]) -> tuple[Optional[Tensor], ...]:
    x, weight, r_sum = ctx.saved_tensors
    need_w = weight is not None and ctx.needs_input_grad[1]
    dx, dw = mrs_norm_backward_op(g, x, weight, r_sum, *ctx.config, need_w)
    return (dx if ctx.needs_input_grad[0] else None), (dw if need_w else None), None, None, None, None


mrs_norm_op.register_autograd(_backward, setup_context=_setup_context)
