"""The op as torch operators, and the one autograd Function over them
(``docs/development.md#life-of-a-call``).

* ``mrs_norm_fwd``/``mrs_norm_bwd``: the C++ kernels on the CPU (``cpu_kernels.cpp``, registered
  when :mod:`.cpu_kernels` builds them), the Triton kernels on CUDA (registered below);
* ``mrs_norm_fwd_fallback``/``mrs_norm_bwd_fallback``, the same with a ``backend`` last, for what
  those kernels do not cover: their body runs that backend on the canonical view of :mod:`.layout`.
  The pair is chosen before dispatch (:mod:`.dispatch`), so the C++ kernel stays the dispatcher's own.

One fake kernel per direction serves all four: ``y`` and ``dx`` with the strides of
``torch.empty_like(x)``, ``r_sum = P * S`` per group as ``(groups,)`` in the compute dtype, ``dw``
like the weight (empty when not asked for: an operator cannot return None).

No ``register_autograd``: a ``custom_op`` with its autograd in Python runs its wrappers on every
call of a compiled graph (83-106 us a call, ``docs/performance-lm.md#the-compiled-llama-step``).
Nor does Inductor get the formula: the phasor pairs are stride-2 loads and the weight an index
``c // 2``, scalar loops (x1.07-1.13 of ``LlamaRMSNorm``, ``docs/performance-lm.md#torchcompile``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_mrs.ops.dispatch import Route, get_backend, route_for
from lightning_mrs.ops.layout import Canonical, like
from lightning_mrs.ops.reference import mrs_norm_reference
from lightning_mrs.ops.validation import compute_dtype

__all__ = ["BWD", "FALLBACK_BWD", "FALLBACK_FWD", "FWD", "MRSNormFunction", "differentiable_grads", "fallback_bwd",
           "fallback_fwd"]

_LIB = torch.library.Library("lightning_mrs", "FRAGMENT")  # noqa: TOR901 - kept for the process's life
_ARGS = "Tensor x, Tensor? weight, float eps, int channel_dim, bool spatial"
_BWD_ARGS = "Tensor grad, Tensor x, Tensor? weight, Tensor r_sum, float eps, int channel_dim, bool spatial, " \
            "bool need_weight_grad"
_LIB.define(f"mrs_norm_fwd({_ARGS}) -> (Tensor, Tensor)")
_LIB.define(f"mrs_norm_bwd({_BWD_ARGS}) -> (Tensor, Tensor)")
_LIB.define(f"mrs_norm_fwd_fallback({_ARGS}, str backend) -> (Tensor, Tensor)")
_LIB.define(f"mrs_norm_bwd_fallback({_BWD_ARGS}, str backend) -> (Tensor, Tensor)")
FWD = torch.ops.lightning_mrs.mrs_norm_fwd.default
BWD = torch.ops.lightning_mrs.mrs_norm_bwd.default
FALLBACK_FWD = torch.ops.lightning_mrs.mrs_norm_fwd_fallback.default
FALLBACK_BWD = torch.ops.lightning_mrs.mrs_norm_bwd_fallback.default


def _fwd_fake(x: Tensor, weight: Optional[Tensor], eps: float, channel_dim: int, spatial: bool,
              backend: str = "") -> tuple[Tensor, Tensor]:
    groups = x.shape[0] if spatial else x.numel() // x.shape[channel_dim]  # symbolic under dynamic shapes
    return torch.empty_like(x), x.new_empty(groups, dtype=compute_dtype(x.dtype))


def _bwd_fake(grad: Tensor, x: Tensor, weight: Optional[Tensor], r_sum: Tensor, eps: float, channel_dim: int,
              spatial: bool, need_weight_grad: bool, backend: str = "") -> tuple[Tensor, Tensor]:
    dw = torch.empty_like(weight) if need_weight_grad and weight is not None else x.new_empty(0)
    return torch.empty_like(x), dw


for _name in ("mrs_norm_fwd", "mrs_norm_fwd_fallback"):
    torch.library.register_fake(f"lightning_mrs::{_name}", _fwd_fake, lib=_LIB)
for _name in ("mrs_norm_bwd", "mrs_norm_bwd_fallback"):
    torch.library.register_fake(f"lightning_mrs::{_name}", _bwd_fake, lib=_LIB)


# --- the Python kernels: a backend module on the canonical view --------------------------------
def _fresh(t: Tensor) -> Tensor:
    """The same memory as ``t`` in a tensor that is not a view: an operator's output must not be
    one, and the Function's output as a view would send in-place ops through CopySlices."""
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())


def _as_promised(t: Tensor, x: Tensor, canonical: Canonical) -> Tensor:
    """``t`` (shaped like ``x``) with the strides of ``torch.empty_like(x)``, as the fake kernels
    promise (Inductor checks them): ``x``'s own where it is dense, else the contiguous ones; the
    same memory where only size-1 dims differ, else a copy."""
    if canonical.dense or canonical.relayout:  # a permutation of a contiguous tensor
        promised = x.stride()
    else:
        promised, step = [], 1
        for n in reversed(x.shape):
            promised.insert(0, step)
            step *= max(n, 1)
        promised = tuple(promised)
    if t.stride() == promised:
        return _fresh(t)
    if all(a == b or n == 1 for a, b, n in zip(t.stride(), promised, t.shape)):
        return _fresh(t.as_strided(t.shape, promised))
    return torch.empty_like(x, dtype=t.dtype).copy_(t)


def _rsum_shape(canonical: Canonical) -> tuple[int, int, int]:
    a, _, l = canonical.shape3
    return (a, 1, l) if not (canonical.layout.last or canonical.layout.spatial) else (a, 1, 1)


def _kernels(x: Tensor, weight: Optional[Tensor], eps: float, channel_dim: int, spatial: bool,
             backend: str) -> tuple[Optional[str], Optional[Canonical]]:
    """``(name, view)`` of the backend that runs this call (``None``: the operator pair)."""
    route = route_for(x, weight, eps, channel_dim, spatial, backend)
    if route.kernel == "eager":  # asked for by a direct caller, or an empty input: the torch bodies
        return "torch", (Canonical.of(x, route.channel_dim, spatial) if x.numel() else None)
    return route.fallback, route.canonical


def _run_fwd(name: str, canonical: Canonical, x: Tensor, weight: Optional[Tensor],
             eps: float) -> tuple[Tensor, Tensor]:
    y3, r_sum = get_backend(name).forward(canonical.view(x), weight, eps, canonical.layout)
    return _as_promised(canonical.restore(y3), x, canonical), r_sum.reshape(-1)


def _run_bwd(name: str, canonical: Optional[Canonical], grad: Tensor, x: Tensor, weight: Optional[Tensor],
             r_sum: Tensor, eps: float, need_weight_grad: bool) -> tuple[Tensor, Tensor]:
    need_w = need_weight_grad and weight is not None
    if canonical is None:  # an empty input
        return torch.zeros_like(x), (torch.zeros_like(weight) if need_w else x.new_empty(0))  # type: ignore[arg-type]
    dx3, dw = get_backend(name).backward(canonical.view(x), weight, r_sum.view(_rsum_shape(canonical)),
                                         canonical.view(like(grad, x)), eps, canonical.layout)
    return _as_promised(canonical.restore(dx3), x, canonical), (dw.to(weight.dtype) if need_w else x.new_empty(0))  # type: ignore[union-attr]


def fallback_fwd(x: Tensor, weight: Optional[Tensor], eps: float, channel_dim: int, spatial: bool,
                 backend: str, route: Optional[Route] = None) -> tuple[Tensor, Tensor]:
    """The fallback forward operator's body (``route``: the eager router's, else looked up)."""
    name, canonical = (route.fallback, route.canonical) if route else _kernels(x, weight, eps, channel_dim, spatial,
                                                                                backend)
    if name is None:  # a compiled graph's guess on a layout the operator pair covers after all
        return FWD(x, weight, eps, channel_dim, spatial)
    if canonical is None:  # an empty input
        return torch.empty_like(x), x.new_zeros(x.shape[0] if spatial else 0, dtype=compute_dtype(x.dtype))
    return _run_fwd(name, canonical, x, weight, eps)


def fallback_bwd(grad: Tensor, x: Tensor, weight: Optional[Tensor], r_sum: Tensor, eps: float, channel_dim: int,
                 spatial: bool, need_weight_grad: bool, backend: str,
                 route: Optional[Route] = None) -> tuple[Tensor, Tensor]:
    """The fallback backward operator's body."""
    name, canonical = (route.fallback, route.canonical) if route else _kernels(x, weight, eps, channel_dim, spatial,
                                                                                backend)
    if name is None:
        return BWD(grad, x, weight, r_sum, eps, channel_dim, spatial, need_weight_grad)
    return _run_bwd(name, canonical, grad, x, weight, r_sum, eps, need_weight_grad)


def _cuda_fwd(x: Tensor, weight: Optional[Tensor], eps: float, channel_dim: int, spatial: bool) -> tuple[Tensor, Tensor]:
    return _run_fwd("triton", route_for(x, weight, eps, channel_dim, spatial, "triton").canonical, x, weight, eps)


def _cuda_bwd(grad: Tensor, x: Tensor, weight: Optional[Tensor], r_sum: Tensor, eps: float, channel_dim: int,
              spatial: bool, need_weight_grad: bool) -> tuple[Tensor, Tensor]:
    canonical = route_for(x, weight, eps, channel_dim, spatial, "triton").canonical
    return _run_bwd("triton", canonical, grad, x, weight, r_sum, eps, need_weight_grad)


_LIB.impl("mrs_norm_fwd", _cuda_fwd, "CUDA")
_LIB.impl("mrs_norm_bwd", _cuda_bwd, "CUDA")
_LIB.impl("mrs_norm_fwd_fallback", fallback_fwd, "CompositeExplicitAutograd")
_LIB.impl("mrs_norm_bwd_fallback", fallback_bwd, "CompositeExplicitAutograd")


# --- the one autograd Function ------------------------------------------------------------------
class MRSNormFunction(torch.autograd.Function):
    """MRSNorm with a hand-written backward that needs only ``x`` and one scale per group.

    ``apply(x, weight, eps, channel_dim, spatial, fallback, route)``: ``fallback`` ``None`` runs the
    operator pair, a backend name the fallback pair (:mod:`.dispatch` decides); eagerly the
    fallback pair's bodies are called directly, with the router's ``route``. Eager calls and
    ``torch.compile`` alike run it; ``torch.func`` transforms never reach it (the router runs the
    reference formula under them, see :mod:`lightning_mrs.ops.mrs_norm`).
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Optional[Tensor], eps: float, channel_dim: int, spatial: bool,
                fallback: Optional[str], route: Optional[Route] = None) -> Tensor:
        if fallback is None:
            y, r_sum = FWD(x, weight, eps, channel_dim, spatial)
        elif torch.compiler.is_compiling():  # the graph records the fallback operator
            y, r_sum = FALLBACK_FWD(x, weight, eps, channel_dim, spatial, fallback)
        else:  # eagerly its body, without the dispatcher's round trip through Python
            y, r_sum = fallback_fwd(x, weight, eps, channel_dim, spatial, fallback, route)
        ctx.save_for_backward(x, weight, r_sum)  # r_sum = P * S: one value per group
        ctx.config = (eps, channel_dim, spatial, fallback, route)
        return y

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Optional[Tensor], ...]:
        x, weight, r_sum = ctx.saved_tensors
        eps, channel_dim, spatial, fallback, route = ctx.config
        need_x, need_w = ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1]
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():  # create_graph=True
            dx, dw = differentiable_grads(x, weight, g, eps, channel_dim, spatial, need_x, need_w)
        elif fallback is None:
            dx, dw = BWD(g, x, weight, r_sum, eps, channel_dim, spatial, need_w)
        elif torch.compiler.is_compiling():
            dx, dw = FALLBACK_BWD(g, x, weight, r_sum, eps, channel_dim, spatial, need_w, fallback)
        else:
            dx, dw = fallback_bwd(g, x, weight, r_sum, eps, channel_dim, spatial, need_w, fallback, route)
        return (dx if need_x else None), (dw if need_w else None), None, None, None, None, None


def differentiable_grads(x: Tensor, weight: Optional[Tensor], g: Tensor, eps: float, channel_dim: int,
                         spatial: bool, need_x: bool, need_w: bool) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """``(dx, dw)`` of the reference formula for ``g``, differentiable again (double backward)."""
    inputs = [t for t, need in ((x, need_x), (weight, need_w)) if need]
    with torch.enable_grad():
        y = mrs_norm_reference(x, weight, eps, channel_dim, spatial)
        grads = iter(torch.autograd.grad(y, inputs, g, create_graph=True, allow_unused=True))
    return (next(grads) if need_x else None), (next(grads) if need_w else None)
