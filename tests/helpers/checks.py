"""Checks shared by the tests of the fused MRSNorm paths (test_fused.py, test_kernels_cpu.py):
inputs, gradients, the comparison with the float64 reference, and saved-tensor bytes."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from lightning_mrs import mrs_norm
from helpers.reference import mrs_norm_ref

# (atol, rtol) per dtype, relative to outputs/gradients of size ~1
TOLS = {
    torch.float64: (1e-9, 1e-9),
    torch.float32: (2e-5, 2e-5),
    torch.bfloat16: (3e-2, 3e-2),
    torch.float16: (4e-3, 4e-3),
}


def make_inputs(shape, cd, memory_format, dtype, affine=True, seed=0):
    """``(x, w, gy)``: input (scaled by 3), per-phasor weight in [0.5, 1.5) or ``None``, and
    an upstream gradient, drawn in float64 and cast to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)
    if memory_format is not None:
        x = x.contiguous(memory_format=memory_format)
    c = shape[cd]
    w = (torch.rand(c // 2, generator=g, dtype=torch.float64) + 0.5).to(dtype) if affine else None
    gy = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return x, w, gy


def grads(fn, x, w, gy):
    """``(y, dx, dw)`` of ``y = fn(x, w)`` for the upstream gradient ``gy``."""
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_() if w is not None else None
    y = fn(x, w)
    y.backward(gy)
    return y, x.grad, (w.grad if w is not None else None)


def check_against_reference(backend: str, layout: tuple, dtype: torch.dtype, affine: bool = True) -> None:
    """``mrs_norm(backend=...)`` equals the float64 reference in output, input and weight
    gradient for ``layout = (shape, channel_dim, spatial, memory_format)``; the output and
    the input gradient keep the input's dtype and strides."""
    shape, cd, spatial, mf = layout
    x, w, gy = make_inputs(shape, cd, mf, dtype, affine)
    y, dx, dw = grads(lambda a, b: mrs_norm(a, b, channel_dim=cd, spatial=spatial, backend=backend), x, w, gy)
    y_r, dx_r, dw_r = grads(
        lambda a, b: mrs_norm_ref(a, b, channel_dim=cd, spatial=spatial), x.double(),
        None if w is None else w.double(), gy.double(),
    )
    atol, rtol = TOLS[dtype]
    assert y.dtype == dtype and dx.dtype == dtype
    assert y.shape == x.shape and y.stride() == x.stride() and dx.stride() == x.stride()  # memory format kept
    torch.testing.assert_close(y.double(), y_r, atol=atol, rtol=rtol)
    torch.testing.assert_close(dx.double(), dx_r, atol=atol * 10, rtol=rtol * 10)
    if affine:
        assert dw.dtype == dtype
        # dw sums over many positions: compare relative to its size
        torch.testing.assert_close(dw.double(), dw_r, atol=atol * 10 * dw_r.abs().max().item(), rtol=rtol * 10)


def saved_bytes(fn: Callable[[Tensor], Tensor], x: Tensor) -> tuple[Tensor, int]:
    """``(fn(x), bytes)``: the output and the bytes of the unique storages saved for backward."""
    saved: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(x)
    return y, sum(saved.values())
