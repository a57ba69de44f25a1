"""The fused MRSNorm: a custom autograd Function and the choice of kernel behind it.

Eager MRSNorm saves every intermediate (``x^2``, ``r``, ``S``, ``x/S``...) for the backward
and runs one kernel per op. :class:`MRSNormFunction` saves only the input and one scale per
group (``P * S``, from which the backward takes ``1/S``) and calls one fused forward and one fused backward (PAPER.md, "Backward"), in one of
four implementations:

* ``"cpp"``: the hand-written one-pass CPU kernels of :mod:`lightning_mrs.kernels_cpu`
  (channels contiguous, both modes; positions contiguous, per sample);
* ``"inductor"``: the bodies of :mod:`lightning_mrs.kernels_inductor` compiled by Inductor
  (C++/OpenMP on the CPU, Triton on a GPU), compiled on first use;
* ``"triton"``: the hand-written kernels of :mod:`lightning_mrs.kernels_triton` (CUDA);
* ``"function"``: the same bodies run eagerly (float64, tiny tensors, no compiler).

``backend="auto"`` (the default of :func:`lightning_mrs.mrs_norm` and of the modules) picks
the fastest that applies; see :func:`resolve_backend`.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from lightning_mrs import kernels_cpu as kc
from lightning_mrs import kernels_inductor as ki

__all__ = ["BACKENDS", "MRSNormFunction", "fused_mrs_norm", "resolve_backend"]

BACKENDS = ("auto", "eager", "function", "inductor", "cpp", "triton")

# Below this many elements (1 MiB of fp32) a compiled kernel is not worth its first-call
# compile (seconds per body and layout) nor its guards; the eager-bodied "function" path
# still saves only x and one scale per group.
COMPILE_MIN_NUMEL = int(os.environ.get("LIGHTNING_MRS_COMPILE_MIN_NUMEL", 1 << 18))
_COMPILE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Canonical(NamedTuple):
    """A kernel's view of the input: ``x3`` and how to map results back."""

    x3: Tensor  # (A, L, C) if last else (A, C, L)
    last: bool  # channels contiguous (the *_last kernels)
    shape: tuple[int, ...]  # x.movedim(cd, -1).shape if last else x.shape


def to_canonical(x: Tensor, cd: int, spatial: bool) -> Canonical:
    """``x`` as a 3-d view for the kernels (see :mod:`lightning_mrs.kernels_inductor`).

    Channels with stride 1 (tokens, NHWC, ``channels_last``) give ``(A, L, C)``, other
    layouts ``(A, C, L)``. ``spatial=False``: one group per position (``A`` = all positions,
    or the dims before the channel dim); ``spatial=True``: ``A`` = the batch dim (the
    channel dim must then be 1 or the last, see :func:`resolve_backend`). ``reshape`` is a
    view for every dense layout; odd strides fall back to a copy.
    """
    shape = x.shape
    c = shape[cd]
    if x.stride(cd) == 1:
        moved = x.movedim(cd, -1)  # (..., C), a view
        a = shape[0] if spatial else moved.numel() // c
        x3 = moved.reshape(a, moved.numel() // (a * c), c)  # (A, L, C)
        return Canonical(x3, True, tuple(moved.shape))
    if spatial:
        a, l = shape[0], math.prod(shape[1:]) // c
    else:
        a, l = math.prod(shape[:cd]), math.prod(shape[cd + 1 :])
    return Canonical(x.reshape(a, c, l), False, tuple(shape))  # (A, C, L)


def _from_canonical(y3: Tensor, can: Canonical, cd: int) -> Tensor:
    if can.last:
        return y3.reshape(can.shape).movedim(-1, cd)
    return y3.reshape(can.shape)


def _like(g: Tensor, x: Tensor) -> Tensor:
    """``g`` with the strides of ``x`` (one compiled kernel per layout, not per gradient)."""
    if g.stride() == x.stride():
        return g
    return torch.empty_like(x, dtype=g.dtype).copy_(g)


def _ct(x: Tensor) -> torch.dtype:
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


_MASKS: dict[tuple, Tensor] = {}


def _even_mask(x3: Tensor) -> Tensor:
    key = (x3.shape[2], _ct(x3), x3.device)
    m = _MASKS.get(key)
    if m is None:
        m = (torch.arange(key[0], device=x3.device) % 2 == 0).to(key[1])  # (C,) 1 on even
        _MASKS[key] = m
    return m


def _weight2(weight: Optional[Tensor]) -> Optional[Tensor]:
    # Per-channel gain (C,), built eagerly (tiny): a contiguous load in the kernels, where
    # an index c // 2 inside them would defeat vectorisation.
    return None if weight is None else weight.repeat_interleave(2)


def _run_forward(impl: str, x3: Tensor, last: bool, w2: Optional[Tensor], eps: float, spatial: bool):
    if impl == "cpp":
        return kc.forward(x3, w2, eps, last)
    if impl == "triton":
        from lightning_mrs import kernels_triton as kt

        xt = x3.transpose(1, 2) if last else x3  # (A, C, L), any strides
        y3, r_sum = kt.forward(xt, w2, eps)
        return (y3.transpose(1, 2) if last else y3), r_sum
    use = impl == "inductor"
    if last:
        return ki.run("fwd_last", x3, w2, _even_mask(x3), eps, spatial, use_compiled=use)
    return ki.run("fwd_first", x3, w2, eps, spatial, use_compiled=use)


def _run_backward(impl: str, x3: Tensor, last: bool, g3: Tensor, w2, r_sum: Tensor, eps: float, spatial: bool):
    if impl == "cpp":
        return kc.backward(x3, w2, r_sum, g3, eps, last)
    if impl == "triton":
        from lightning_mrs import kernels_triton as kt

        t = (lambda v: v.transpose(1, 2)) if last else (lambda v: v)
        dx3, dw = kt.backward(t(x3), w2, r_sum, t(g3), eps)
        return t(dx3), dw
    use = impl == "inductor"
    if last:
        m = _even_mask(x3)
        return ki.run("bwd_last", x3, w2, m, r_sum, g3, eps, spatial, use_compiled=use)
    return ki.run("bwd_first", x3, w2, r_sum, g3, eps, spatial, use_compiled=use)


class MRSNormFunction(torch.autograd.Function):
    """MRSNorm with a hand-written backward that needs only ``x`` and one scale per group.

    ``apply(x, weight, eps, channel_dim, spatial, impl)`` with ``channel_dim >= 0`` and
    ``impl`` one of ``"cpp"``, ``"inductor"``, ``"triton"``, ``"function"``. The kernels see
    a 3-d view of ``x`` (:func:`to_canonical`); the output is handed back as a fresh tensor, not as a
    view of the kernel's buffer, so in-place ops on it (``relu_``, ``out += identity``) need
    no CopySlices copies in the backward. Double backward (``create_graph=True``)
    recomputes the forward with differentiable torch ops, so gradgradcheck works too.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Optional[Tensor], eps: float, cd: int, spatial: bool, impl: str):
        can = to_canonical(x, cd, spatial)
        y3, r_sum = _run_forward(impl, can.x3, can.last, _weight2(weight), eps, spatial)
        ctx.save_for_backward(x, weight, r_sum)  # r_sum = P * S: one value per group
        ctx.cfg = (eps, cd, spatial, impl)
        return _fresh(_from_canonical(y3, can, cd))

    @staticmethod
    def backward(ctx, g: Tensor):
        x, weight, r_sum = ctx.saved_tensors
        eps, cd, spatial, impl = ctx.cfg
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if torch.is_grad_enabled():  # create_graph=True: a differentiable backward
            dx, dw = _differentiable_grads(x, weight, g, eps, cd, spatial, need_x, need_w)
            return dx, dw, None, None, None, None
        can = to_canonical(x, cd, spatial)
        g3 = to_canonical(_like(g, x), cd, spatial).x3
        dx3, dw = _run_backward(impl, can.x3, can.last, g3, _weight2(weight), r_sum, eps, spatial)
        dx = _from_canonical(dx3, can, cd) if need_x else None
        dw = dw.to(weight.dtype) if need_w else None
        return dx, dw, None, None, None, None


def _fresh(view: Tensor) -> Tensor:
    """The same memory as ``view`` in a tensor that is not a view (no ``_base``).

    A custom Function must not return a view created inside it (autograd then forbids
    in-place ops on it), and a view taken outside makes every in-place op on the result
    go through CopySlices (two full copies of the gradient per op in the backward).
    """
    out = view.new_empty(0)
    return out.set_(view.untyped_storage(), view.storage_offset(), view.size(), view.stride())


def _differentiable_grads(x, weight, g, eps, cd, spatial, need_x, need_w):
    from lightning_mrs.functional import mrs_norm  # the eager formula; lazy: no import cycle

    inputs = [t for t, need in ((x, need_x), (weight, need_w)) if need]
    with torch.enable_grad():
        y = mrs_norm(x, weight, eps, channel_dim=cd, spatial=spatial, backend="eager")
        grads = torch.autograd.grad(y, inputs, g, create_graph=True, allow_unused=True)
    it = iter(grads)
    return (next(it) if need_x else None), (next(it) if need_w else None)


def _triton_ok(x: Tensor, spatial: bool, explicit: bool = False) -> bool:
    """Triton applies: CUDA (or, when asked for explicitly, ``TRITON_INTERPRET=1`` on the
    CPU, for tests), float32/16/bf16 (the kernels compute in fp32), one ``S`` per position."""
    if spatial or x.dtype not in _COMPILE_DTYPES:
        return False
    interpret = explicit and os.environ.get("TRITON_INTERPRET") == "1"
    if not (x.is_cuda or interpret):
        return False
    from lightning_mrs import kernels_triton as kt

    return kt.importable() and (interpret or kt.available())


def _cpp_ok(x: Tensor, cd: int, spatial: bool) -> bool:
    """A hand-written CPU kernel covers this input (builds the kernels on first use)."""
    last = x.stride(cd) == 1  # as in to_canonical
    # the canonical view is contiguous exactly when these are (no copy in to_canonical)
    dense = x.movedim(cd, -1).is_contiguous() if last else x.is_contiguous()
    return dense and kc.supports(x.device, x.dtype, last, spatial) and kc.available(x.dtype)


def resolve_backend(x: Tensor, cd: int, spatial: bool, backend: str) -> str:
    """The implementation that ``backend`` means for this input.

    ``"auto"``: the eager formula under ``torch.compile`` (the outer compile fuses it, no
    graph break) and where no canonical view exists; Triton on CUDA when installed
    (``spatial=False``); on the CPU the hand-written kernels (``"cpp"``) for the layouts
    they cover (channels contiguous; positions contiguous with ``spatial=True``), else
    Inductor for float32/16/bf16 tensors of at least ``COMPILE_MIN_NUMEL`` elements; else
    the eager-bodied ``"function"``.
    """
    if backend == "eager" or torch.compiler.is_compiling() or x.numel() == 0:
        return "eager"
    if spatial and cd not in (1, x.ndim - 1):  # no 3-d view has one group per sample
        return "eager"
    if backend == "triton":
        if not _triton_ok(x, spatial, explicit=True):
            raise ValueError(
                "mrs_norm(backend='triton') needs a float32/float16/bfloat16 CUDA tensor, the "
                "triton package and spatial=False; use backend='auto' to pick the best "
                "available kernel."
            )
        return "triton"
    if backend == "cpp":
        if not _cpp_ok(x, cd, spatial):
            raise ValueError(
                "mrs_norm(backend='cpp') needs a dense float32/bfloat16 CPU tensor with "
                "the channels contiguous, or the positions contiguous and spatial=True, and a "
                f"C++ compiler ({kc.build_error() or f'got {x.dtype}, strides {x.stride()}, spatial={spatial}'}); "
                "use backend='auto' to pick the best available kernel."
            )
        return "cpp"
    if backend in ("inductor", "function"):
        return backend
    if _triton_ok(x, spatial):
        return "triton"
    if _cpp_ok(x, cd, spatial):
        return "cpp"
    if x.dtype in _COMPILE_DTYPES and x.numel() >= COMPILE_MIN_NUMEL and not ki.compile_failed():
        return "inductor"
    return "function"


def fused_mrs_norm(
    x: Tensor, weight: Optional[Tensor], eps: float, cd: int, spatial: bool, impl: str
) -> Tensor:
    """MRSNorm through :class:`MRSNormFunction` (``impl`` from :func:`resolve_backend`)."""
    return MRSNormFunction.apply(x, weight, eps, cd, spatial, impl)
