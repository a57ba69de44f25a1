"""Every CPU backend of the fused MRSNorm (``torch``, ``inductor``, ``cpp``) against the
independent float64 reference: forward, input gradient and weight gradient, for every layout
the kernels distinguish, every dtype and with and without a weight.

Each backend is forced (``cpp`` is skipped where it cannot be built); the cases a backend
does not cover (``cpp`` for float16, per-position NCHW...) are left out here and asserted to
raise in ``test_dispatch.py`` / ``test_layout_matrix.py``. Inductor compiles once per
(kernel, dtype, weight) and then reuses the code for every size, so its cases keep to few
combinations: float32 for every layout, each half dtype on one layout, no weight on two (the
rest of its product is the slow part of ``test_layout_matrix.py``).
"""

from __future__ import annotations

import pytest
import torch

from helpers.checks import LAYOUTS, check_against_reference, check_half_gradient, forced, needs_cpp
FLOATS = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
CPP_LAYOUTS = [name for name, (_, dim, spatial, fmt) in LAYOUTS.items()
               if spatial or dim == -1 or fmt is torch.channels_last]  # channels contiguous, or per sample
INDUCTOR_LAYOUTS = list(LAYOUTS)[:7]  # the kernel-shape stress cases add only compile time here


def _cases() -> list:
    cases = []
    for layout in LAYOUTS:
        for dtype in FLOATS:
            for affine in (True, False):
                cases.append(pytest.param("torch", layout, dtype, affine, id=f"torch-{layout}-{dtype}-{affine}"))
    for layout in CPP_LAYOUTS:
        for dtype in (torch.float32, torch.bfloat16):
            for affine in (True, False):
                cases.append(pytest.param("cpp", layout, dtype, affine, marks=needs_cpp,
                                          id=f"cpp-{layout}-{dtype}-{affine}"))
    inductor = [(layout, torch.float32, True) for layout in INDUCTOR_LAYOUTS]
    inductor += [("tokens", torch.bfloat16, True), ("nchw_per_sample", torch.float16, True)]
    inductor += [(layout, torch.float32, False) for layout in ("tokens", "nchw_per_position")]
    cases += [pytest.param("inductor", *case, id=f"inductor-{case[0]}-{case[1]}-{case[2]}") for case in inductor]
    return cases


@pytest.mark.parametrize("backend,layout,dtype,affine", _cases())
def test_backend_matches_reference(backend: str, layout: str, dtype: torch.dtype, affine: bool) -> None:
    check_against_reference(backend, LAYOUTS[layout], dtype, affine)


ZERO_CASES = [(backend, dtype) for backend in ("eager", "torch") for dtype in FLOATS] + [("inductor", torch.float32)]
ZERO_CASES += [pytest.param("cpp", dtype, marks=needs_cpp) for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("backend,dtype", ZERO_CASES)
@pytest.mark.parametrize("layout", ["tokens", "nchw_per_sample"])
def test_zeros_give_zeros_and_finite_gradients(backend: str, dtype: torch.dtype, layout: str) -> None:
    shape, channel_dim, spatial, _ = LAYOUTS[layout]
    x = torch.zeros(shape, dtype=dtype, requires_grad=True)
    w = torch.ones(shape[channel_dim] // 2, dtype=dtype, requires_grad=True)
    y = forced(backend, channel_dim, spatial)(x, w)
    y.backward(torch.randn(shape).to(dtype))
    assert torch.count_nonzero(y) == 0
    assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()


HALF_CASES = [pytest.param(backend, layout, dtype, marks=needs_cpp if backend == "cpp" else (),
                           id=f"{backend}-{layout}-{dtype}")
              for backend, layouts in (("torch", list(LAYOUTS)), ("cpp", CPP_LAYOUTS))
              for layout in layouts for dtype in (torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("backend,layout,dtype", HALF_CASES)
def test_half_input_gradient_is_the_reference_rounded_once(backend: str, layout: str, dtype: torch.dtype) -> None:
    check_half_gradient(backend, LAYOUTS[layout], dtype)  # g leaning on x: the k x / r term counts
