"""The op as ``torch.library`` ops: what ``torch.compile`` sees of MRSNorm.

Inside ``torch.compile``, :func:`lightning_mrs.mrs_norm` (and so every module) calls
:func:`compiled_mrs_norm`: an autograd Function that Dynamo traces (no graph break) over two
ops, ``torch.ops.lightning_mrs.mrs_norm_forward`` and ``mrs_norm_backward_kernels``, whose fake
kernels tell AOTAutograd and Inductor the outputs' shapes, dtypes and strides. When the
compiled graph runs, both call the plan an eager call of the same kind runs
(:func:`lightning_mrs.ops.dispatch.plan_for`): the hand-written C++ kernels on the CPU, the
Triton kernels on CUDA, and what the backward needs saved is only ``x``, the weight and
``P * S`` per group.

Why two plain ops under an autograd Function, and not one ``torch.library.custom_op`` with its
backward registered (what ran before): a ``custom_op`` runs its Python wrappers (the autograd
redispatch, ``_disable_dynamo``, the aliasing checks) on every call of the compiled graph. Inside
a compiled Llama training step those cost 86 us a forward and 106 us a backward call; these
ops, which have no autograd kernel of their own (the graph runs below autograd), 42 and 49 us
(``docs/performance-lm.md#the-compiled-llama-step``). The public ``custom_op``s,
``torch.ops.lightning_mrs.mrs_norm`` and ``mrs_norm_backward``, stay for direct callers and
``torch.library.opcheck``; they run the same bodies.

Why not let Inductor compile the formula: it reads a channel's partner with stride-2 loads and
the per-phasor weight with an index ``c // 2``, and emits scalar loops for them (no SIMD); on
a compiled Llama training step that cost x1.07-1.13 of the model's own ``LlamaRMSNorm``
(``docs/performance-lm.md#torchcompile``). The ops are opaque to Inductor's fusion (a residual
add before them stays its own kernel), which costs less than the scalar loops saved.

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

__all__ = ["compiled_mrs_norm", "mrs_norm_backward_op", "mrs_norm_op"]


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


def _forward(x: Tensor, weight: Optional[Tensor], eps: float, channel_dim: int, spatial: bool,
             backend: str) -> tuple[Tensor, Tensor]:
    """``(y, r_sum)`` of MRSNorm (``channel_dim >= 0``, arguments checked by the caller)."""
    plan = plan_for(x, weight, eps, channel_dim, spatial, backend, "mrs_norm")
    y, r_sum = plan.forward(x, weight, eps)
    # the row kernels' r_sum is already (groups,): no reshape call on the compiled graph's hot path
    return (y if plan.like_x else _as_promised(y, x)), (r_sum if r_sum.dim() == 1 else r_sum.reshape(-1))


def _forward_fake(x: Tensor, weight: Optional[Tensor], eps: float, channel_dim: int, spatial: bool,
                  backend: str) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), x.new_empty(_groups(x, channel_dim, spatial), dtype=compute_dtype(x.dtype))


def _backward(grad: Tensor, x: Tensor, weight: Optional[Tensor], r_sum: Tensor, eps: float, channel_dim: int,
              spatial: bool, backend: str, need_weight_grad: bool) -> tuple[Tensor, Tensor]:
    """``(dx, dw)`` of :func:`_forward` for the upstream gradient ``grad``."""
    plan = plan_for(x, weight, eps, channel_dim, spatial, backend, "mrs_norm")
    if plan.like_x:  # the row kernels: r_sum is their (groups,), dx from empty_like(x)
        dx, dw = plan.backward(x, weight, r_sum, grad, eps, need_weight_grad)
    else:
        dx, dw = plan.backward(x, weight, r_sum.view(plan.rsum_shape), grad, eps, need_weight_grad)
        dx = _as_promised(dx, x)
    return dx, (dw if dw is not None else x.new_empty(0))


def _backward_fake(grad: Tensor, x: Tensor, weight: Optional[Tensor], r_sum: Tensor, eps: float, channel_dim: int,
                   spatial: bool, backend: str, need_weight_grad: bool) -> tuple[Tensor, Tensor]:
    dw = torch.empty_like(weight) if need_weight_grad and weight is not None else x.new_empty(0)
    return torch.empty_like(x), dw


# --- what compiled graphs call: two plain ops (no autograd kernel) under an autograd Function ---
_LIB = torch.library.Library("lightning_mrs", "FRAGMENT")  # noqa: TOR901 - kept for the process's life
_LIB.define("mrs_norm_forward(Tensor x, Tensor? weight, float eps, int channel_dim, bool spatial, str backend) "
            "-> (Tensor, Tensor)")
_LIB.define("mrs_norm_backward_kernels(Tensor grad, Tensor x, Tensor? weight, Tensor r_sum, float eps, "
            "int channel_dim, bool spatial, str backend, bool need_weight_grad) -> (Tensor, Tensor)")
_LIB.impl("mrs_norm_forward", _forward, "CompositeExplicitAutograd")
_LIB.impl("mrs_norm_backward_kernels", _backward, "CompositeExplicitAutograd")
torch.library.register_fake("lightning_mrs::mrs_norm_forward", _forward_fake, lib=_LIB)
torch.library.register_fake("lightning_mrs::mrs_norm_backward_kernels", _backward_fake, lib=_LIB)


def _setup_context(ctx: Any, inputs: tuple, output: tuple[Tensor, Tensor]) -> None:
    x, weight, eps, channel_dim, spatial, backend = inputs
    ctx.save_for_backward(x, weight, output[1])  # r_sum = P * S: one value per group
    ctx.config = (eps, channel_dim, spatial, backend)


def _grads(ctx: Any, g: Tensor, backward_op: Any) -> tuple[Optional[Tensor], ...]:
    """The inputs' gradients from what :func:`_setup_context` saved, by ``backward_op`` (one of the
    two backward ops: they run the same body)."""
    x, weight, r_sum = ctx.saved_tensors
    need_w = weight is not None and ctx.needs_input_grad[1]
    dx, dw = backward_op(g, x, weight, r_sum, *ctx.config, need_w)
    return (dx if ctx.needs_input_grad[0] else None), (dw if need_w else None), None, None, None, None


class _CompiledMRSNorm(torch.autograd.Function):
    """What Dynamo traces: the forward op, and the backward op in the backward graph."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Optional[Tensor], eps: float, channel_dim: int, spatial: bool,
                backend: str) -> Tensor:
        out = torch.ops.lightning_mrs.mrs_norm_forward.default(x, weight, eps, channel_dim, spatial, backend)
        _setup_context(ctx, (x, weight, eps, channel_dim, spatial, backend), out)
        return out[0]

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Optional[Tensor], ...]:
        return _grads(ctx, g, torch.ops.lightning_mrs.mrs_norm_backward_kernels.default)


def compiled_mrs_norm(x: Tensor, weight: Optional[Tensor], eps: float, channel_dim: int, spatial: bool,
                      backend: str) -> Tensor:
    """MRSNorm as ``torch.compile`` records it (``channel_dim >= 0``, arguments checked by the caller)."""
    return _CompiledMRSNorm.apply(x, weight, eps, channel_dim, spatial, backend)


# --- the public custom ops: for direct callers and torch.library.opcheck, the same bodies ------
@torch.library.custom_op("lightning_mrs::mrs_norm", mutates_args=())
def mrs_norm_op(x: Tensor, weight: Optional[Tensor], eps: float, channel_dim: int, spatial: bool,
                backend: str) -> tuple[Tensor, Tensor]:
    """``(y, r_sum)`` of MRSNorm (``channel_dim >= 0``, arguments checked by the caller)."""
    return _forward(x, weight, eps, channel_dim, spatial, backend)


mrs_norm_op.register_fake(_forward_fake)


@torch.library.custom_op("lightning_mrs::mrs_norm_backward", mutates_args=())
def mrs_norm_backward_op(grad: Tensor, x: Tensor, weight: Optional[Tensor], r_sum: Tensor, eps: float,
                         channel_dim: int, spatial: bool, backend: str,
                         need_weight_grad: bool) -> tuple[Tensor, Tensor]:
    """``(dx, dw)`` of :func:`mrs_norm_op` for the upstream gradient ``grad``."""
    return _backward(grad, x, weight, r_sum, eps, channel_dim, spatial, backend, need_weight_grad)


mrs_norm_backward_op.register_fake(_backward_fake)


def _op_backward(ctx: Any, g: Tensor, _g_rsum: Optional[Tensor]) -> tuple[Optional[Tensor], ...]:
    return _grads(ctx, g, mrs_norm_backward_op)


mrs_norm_op.register_autograd(_op_backward, setup_context=_setup_context)
