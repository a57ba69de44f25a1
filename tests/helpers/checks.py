"""Checks shared by the op tests: the backends and layouts to test, inputs, one backend forced,
gradients, the comparison with the independent float64 reference (:mod:`helpers.reference`), a
small model with every MRSNorm module, and saved-tensor bytes."""

from __future__ import annotations

from typing import Any, Callable, Optional

import pytest
import torch
from torch import Tensor, nn

from lightning_mrs import MRSNorm, MRSNorm2d, mrs_norm
from lightning_mrs.ops import cpu_kernels
from helpers.reference import mrs_norm_ref

#: (atol, rtol) of the output per input dtype, for outputs of size ~1; the gradients get 10x.
TOLS = {
    torch.float64: (1e-9, 1e-9),
    torch.float32: (2e-5, 2e-5),
    torch.bfloat16: (3e-2, 3e-2),
    torch.float16: (4e-3, 4e-3),
}
#: The fused backends that run on the CPU (``triton`` needs CUDA or its interpreter).
CPU_BACKENDS = ("torch", "inductor", "cpp")
#: Whether the C++ kernels could be built here (the first import builds them, once per machine).
CPP_BUILT = cpu_kernels.available()
#: The mark of a test that needs the C++ kernels.
needs_cpp = pytest.mark.skipif(not CPP_BUILT, reason=f"the C++ kernels could not be built: {cpu_kernels.build_error()}")
#: name -> (shape, channel_dim, spatial, memory_format) of the backend tests; odd sizes on purpose
LAYOUTS = {
    "tokens": ((5, 7, 64), -1, False, None),
    "tokens_per_sample": ((3, 7, 64), -1, True, None),
    "nchw_per_position": ((3, 64, 5, 7), 1, False, None),
    "nchw_per_sample": ((3, 64, 5, 7), 1, True, None),
    "nhwc_per_position": ((3, 64, 5, 7), 1, False, torch.channels_last),
    "nhwc_per_sample": ((3, 64, 5, 7), 1, True, torch.channels_last),
    "middle_dim": ((3, 4, 64, 5), 2, False, None),
    # shapes that stress the C++ loops: one phasor, a SIMD tail, a wide row, no positions
    "one_phasor": ((9, 2), -1, False, None),
    "odd_phasors": ((1, 3, 30), -1, False, None),
    "simd_tails": ((4, 3, 54), -1, False, None),  # AVX2 rows: a 32-, a 16-, an 8-channel step, then 3 pairs
    "wide_row": ((3, 4098), -1, False, None),
    "ncl_per_sample": ((2, 10, 13), 1, True, None),
    "ncdhw_per_sample": ((2, 6, 3, 1, 5), 1, True, None),
    "nc_per_sample": ((4, 6), 1, True, None),
}


def cpu_backends() -> list[Any]:
    """:data:`CPU_BACKENDS` as pytest parameters, ``cpp`` marked :data:`needs_cpp`."""
    return [pytest.param(name, marks=needs_cpp if name == "cpp" else ()) for name in CPU_BACKENDS]

Norm = Callable[[Tensor, Optional[Tensor]], Tensor]  # (x, weight) -> y
Grads = tuple[Tensor, Tensor, Optional[Tensor]]  # (y, dx, dw)


def make_inputs(
    shape: tuple[int, ...],
    channel_dim: int,
    memory_format: Optional[torch.memory_format],
    dtype: torch.dtype,
    affine: bool = True,
    seed: int = 0,
    device: str = "cpu",
) -> tuple[Tensor, Optional[Tensor], Tensor]:
    """``(x, w, gy)``: input (scaled by 3), per-phasor weight in [0.5, 1.5) or ``None``, and
    an upstream gradient, drawn in float64 and cast to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)
    if memory_format is not None:
        x = x.contiguous(memory_format=memory_format)
    w = (torch.rand(shape[channel_dim] // 2, generator=g, dtype=torch.float64) + 0.5).to(dtype) if affine else None
    gy = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return x.to(device), (None if w is None else w.to(device)), gy.to(device)


def forced(backend: str, channel_dim: int = -1, spatial: bool = False) -> Norm:
    """``mrs_norm`` with ``backend`` forced (every name ``which_backend`` answers is a valid ``backend``)."""
    return lambda x, w: mrs_norm(x, w, channel_dim=channel_dim, spatial=spatial, backend=backend)


def grads(fn: Norm, x: Tensor, w: Optional[Tensor], gy: Tensor) -> Grads:
    """``(y, dx, dw)`` of ``y = fn(x, w)`` for the upstream gradient ``gy`` (``x`` and ``w``
    become fresh leaves with their own strides)."""
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_() if w is not None else None
    y = fn(x, w)
    y.backward(gy)
    return y, x.grad, (w.grad if w is not None else None)


def same_layout(a: Tensor, b: Tensor) -> bool:
    """``a`` and ``b`` have the same strides, ignoring size-1 dims (whose stride means nothing)."""
    return a.shape == b.shape and all(sa == sb for sa, sb, n in zip(a.stride(), b.stride(), a.shape) if n > 1)


def is_dense(x: Tensor) -> bool:
    """``x`` is non-overlapping and dense (a permutation of a contiguous tensor): torch's own
    ``empty_like`` keeps its layout then."""
    return x.numel() > 0 and same_layout(torch.empty_like(x), x)


def assert_matches_reference(
    got: Grads, x: Tensor, w: Optional[Tensor], gy: Tensor, channel_dim: int, spatial: bool
) -> None:
    """``got = (y, dx, dw)`` of MRSNorm equals the float64 reference within the tolerance of
    ``x``'s dtype; ``y`` and ``dx`` have ``x``'s dtype, ``dw`` the weight's, and ``y`` keeps
    the strides of a dense ``x`` (its memory format)."""
    y, dx, dw = got
    ref = grads(
        lambda a, b: mrs_norm_ref(a, b, channel_dim=channel_dim, spatial=spatial),
        x.double(), None if w is None else w.double(), gy.double(),
    )
    atol, rtol = TOLS[x.dtype]
    assert y.dtype == x.dtype and dx.dtype == x.dtype, (y.dtype, dx.dtype, x.dtype)
    assert y.shape == x.shape and dx.shape == x.shape
    if is_dense(x):
        assert same_layout(y, x), f"memory format lost: {y.stride()} for an input with {x.stride()}"
    torch.testing.assert_close(y.double(), ref[0], atol=atol, rtol=rtol)
    torch.testing.assert_close(dx.double(), ref[1], atol=10 * atol, rtol=10 * rtol)
    if w is not None:
        assert dw is not None and dw.dtype == w.dtype
        atol, rtol = max(TOLS[x.dtype], TOLS[w.dtype])  # dw is rounded to the weight's dtype
        # dw sums over every position of the batch: compare relative to its size
        scale = max(ref[2].abs().max().item(), 1.0)
        torch.testing.assert_close(dw.double(), ref[2], atol=10 * atol * scale, rtol=10 * rtol)


def check_against_reference(
    backend: str, layout: tuple, dtype: torch.dtype, affine: bool = True, device: str = "cpu"
) -> None:
    """``backend`` forced on ``layout = (shape, channel_dim, spatial, memory_format)``: output,
    input gradient and weight gradient equal the float64 reference; strides kept."""
    shape, channel_dim, spatial, memory_format = layout
    x, w, gy = make_inputs(shape, channel_dim, memory_format, dtype, affine, device=device)
    got = grads(forced(backend, channel_dim, spatial), x, w, gy)
    assert_matches_reference(got, x, w, gy, channel_dim, spatial)
    assert same_layout(got[1], x)  # the input gradient in the input's layout too


def check_half_gradient(backend: str, layout: tuple, dtype: torch.dtype, device: str = "cpu") -> None:
    """The input gradient of a half ``dtype`` is the float64 reference rounded once, to an ulp.

    ``dx = w g / S - k x / r``: with ``g`` drawn apart from ``x`` the second term is about
    ``1/sqrt(n)`` of the first, inside the loose half tolerance of :func:`check_against_reference`
    (a kernel using the wrong channel passed it). Here ``g`` leans on ``x``, so both terms
    count; half inputs are exact in float64 and the maths runs in float32, so one rounding of
    the result is all the error there is: an ulp of ``dx``'s largest value, an ulp relative."""
    shape, channel_dim, spatial, memory_format = layout
    x, w, gy = make_inputs(shape, channel_dim, memory_format, dtype, device=device)
    g = (x.double() + gy.double()).to(dtype)
    got = grads(forced(backend, channel_dim, spatial), x, w, g)[1]
    ref = grads(lambda a, b: mrs_norm_ref(a, b, channel_dim=channel_dim, spatial=spatial),
                x.double(), w.double(), g.double())[1]
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got.double(), ref, rtol=eps, atol=eps * ref.abs().max().item())


def norm_model() -> nn.Sequential:
    """A small conv net with every MRSNorm module (per sample, per position, channels-last),
    weights away from 1; input ``(N, 3, 6, 6)``."""
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), MRSNorm2d(8, spatial=True), nn.GELU(), MRSNorm2d(8),
        nn.Flatten(), nn.Linear(8 * 6 * 6, 16), MRSNorm(16),
    )
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model:
            if isinstance(layer, (MRSNorm, MRSNorm2d)):
                layer.weight.copy_(torch.rand(layer.weight.shape, generator=g) + 0.5)
    return model


def saved_bytes(fn: Callable[[Tensor], Tensor], x: Tensor) -> tuple[Tensor, int]:
    """``(fn(x), bytes)``: the output and the bytes of the unique storages saved for backward."""
    saved: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(x)
    return y, sum(saved.values())
