"""The op as ``torch.library`` ops: what ``torch.compile`` sees of MRSNorm.

Inside ``torch.compile``, :func:`lightning_mrs.mrs_norm` (and so every module) calls
:func:`compiled_mrs_norm`: an autograd Function that Dynamo traces (no graph break) over two
ops, whose fake kernels tell AOTAutograd and Inductor the outputs' shapes, dtypes and strides:

* for contiguous channels-last CPU tokens, the calls an eager ``mrs_norm`` runs as
  :class:`~lightning_mrs.ops.plan.RowsPlan` (asked of :func:`~lightning_mrs.ops.dispatch.plan_for`
  when tracing, by :func:`_runs_rows`), ``torch.ops.lightning_mrs.rows_forward`` and
  ``rows_backward``: C++ operators that run the same row kernels with no Python on the way
  (:mod:`.cpu_torch_ops`; where they cannot be built, the general ops below);
* for every other call, ``torch.ops.lightning_mrs.mrs_norm_forward`` and
  ``mrs_norm_backward_kernels``, whose Python bodies call the plan an eager call of the same
  kind runs: the hand-written C++ kernels on the CPU, the Triton kernels on CUDA.

What the backward needs saved is only ``x``, the weight and ``P * S`` per group. The choice of
the C++ operators is made once, when tracing, and kept in the graph (a kernel set chosen later
with :func:`lightning_mrs.ops.cpu_kernels.using` still applies: they read the set in use). Dynamo
also hands a graph traced for one module to another of the same class and shapes, so setting
``LIGHTNING_MRS_CPU_TORCH_OPS`` later takes effect after ``torch._dynamo.reset()``.

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
    ctx.rows = False  # the general backward; _CompiledMRSNorm sets it for the C++ row operators


def _grads(ctx: Any, g: Tensor, backward_op: Any) -> tuple[Optional[Tensor], ...]:
    """The inputs' gradients from what :func:`_setup_context` saved, by ``backward_op`` (one of the
    two backward ops: they run the same body) or, for the row operators, ``rows_backward``."""
    x, weight, r_sum = ctx.saved_tensors
    need_w = weight is not None and ctx.needs_input_grad[1]
    if ctx.rows:
        dx, dw = torch.ops.lightning_mrs.rows_backward.default(g, x, weight, r_sum, ctx.config[0], need_w)
    else:
        dx, dw = backward_op(g, x, weight, r_sum, *ctx.config, need_w)
    return (dx if ctx.needs_input_grad[0] else None), (dw if need_w else None), None, None, None, None


class _CompiledMRSNorm(torch.autograd.Function):
    """What Dynamo traces: the forward op, and the backward op in the backward graph (``rows``:
    the C++ row operators, else the general ops)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Optional[Tensor], eps: float, channel_dim: int, spatial: bool,
                backend: str, rows: bool) -> Tensor:
        if rows:
            out = torch.ops.lightning_mrs.rows_forward.default(x, weight, eps)
        else:
            out = torch.ops.lightning_mrs.mrs_norm_forward.default(x, weight, eps, channel_dim, spatial, backend)
        _setup_context(ctx, (x, weight, eps, channel_dim, spatial, backend), out)
        ctx.rows = rows
        return out[0]

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Optional[Tensor], ...]:
        return *_grads(ctx, g, torch.ops.lightning_mrs.mrs_norm_backward_kernels.default), None  # rows: None


@torch.compiler.assume_constant_result  # evaluated once when tracing, its answer kept in the graph
def _runs_rows(dtype: torch.dtype, ndim: int, weight: Optional[tuple], channel_dim: int, spatial: bool,
               backend: str) -> bool:
    """Whether an eager call on a contiguous plain CPU tensor of ``dtype`` with ``ndim`` dims, its
    channels in ``channel_dim``, runs :class:`~lightning_mrs.ops.plan.RowsPlan`, and the C++ row
    operators can stand in for it. Asked of :func:`~lightning_mrs.ops.dispatch.plan_for` itself,
    on a probe of that kind: the one router decides (``weight``: ``None`` or its dtype and
    whether it is a contiguous plain tensor or parameter; ``eps``, which the caller checked,
    decides nothing and is left out: Dynamo may trace it as a symbolic float)."""
    from lightning_mrs.ops import cpu_torch_ops
    from lightning_mrs.ops.plan import RowsPlan

    if channel_dim != ndim - 1 or spatial:  # elsewhere the layout may depend on the sizes
        return False
    w = None
    if weight is not None:
        w_dtype, w_plain = weight
        if not w_plain:
            return False
        w = torch.ones(1, dtype=w_dtype)  # (P,) of the probe's C = 2
    probe = torch.zeros((1,) * (ndim - 1) + (2,), dtype=dtype)
    return isinstance(plan_for(probe, w, 1e-6, channel_dim, spatial, backend), RowsPlan) and cpu_torch_ops.load()


def compiled_mrs_norm(x: Tensor, weight: Optional[Tensor], eps: float, channel_dim: int, spatial: bool,
                      backend: str) -> Tensor:
    """MRSNorm as ``torch.compile`` records it (``channel_dim >= 0``, arguments checked by the caller)."""
    rows = (
        type(x) is Tensor and x.device.type == "cpu" and x.is_contiguous()
        and _runs_rows(x.dtype, x.dim(), None if weight is None else (
            # bool(): a constant under dynamic shapes too (Dynamo guards on it)
            weight.dtype, type(weight) in (Tensor, torch.nn.Parameter) and bool(weight.is_contiguous())
            and weight.device.type == "cpu"), channel_dim, spatial, backend)
    )
    return _CompiledMRSNorm.apply(x, weight, eps, channel_dim, spatial, backend, rows)


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
