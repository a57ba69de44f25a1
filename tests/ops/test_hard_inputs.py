"""Every kernel path on the inputs that random ones miss (:mod:`helpers.hard_inputs`), against the
float64 reference at what the kernels achieve (one rounding to the dtype).

Each case kills a wrong implementation that today's random-input tests let pass (checked by
mutation, see the commit that added this file): a C++ row kernel that drops ``eps``
(``near_eps``: a sample of ``sqrt(eps)`` pairs, zero pairs beside normal ones), a reference
formula that squares float16 without the float32 upcast (``past_half_range``: a pair of 300s),
and a backward that drops a term of ``dx`` (the tight gradient comparison, ``g`` leaning on ``x``).

Paths: ``eager`` (the reference formula), ``torch`` (the plain bodies), ``inductor`` (the same
compiled), ``cpp`` rows (tokens; NHWC per sample) and per sample (NCHW), ``auto`` (the rows fast
path) and a ``torch.compile``d call (the compiled graph's operator). Triton: the same cases in
``test_triton_interpret.py``.
"""

from __future__ import annotations

import pytest
import torch

from helpers.checks import LAYOUTS, forced, needs_cpp
from helpers.hard_inputs import check_tight, near_eps, past_half_range

HALVES = (torch.bfloat16, torch.float16)
ALL = (torch.float32, *HALVES)
_CPP = ("tokens", "nchw_per_sample", "nhwc_per_sample", "tokens_per_sample")
_TORCH = ("tokens", "nchw_per_position", "nchw_per_sample", "nhwc_per_position", "middle_dim")


def _cases() -> list:
    cases = []
    for dtype in ALL:
        for layout in ("tokens", "nchw_per_sample", "nchw_per_position"):
            cases.append(("eager", layout, dtype))
        cases += [("torch", layout, dtype) for layout in _TORCH]
        cases += [pytest.param("cpp", layout, dtype, marks=needs_cpp) for layout in _CPP]
        cases.append(pytest.param("auto", "tokens", dtype, marks=needs_cpp))
    # inductor compiles per (body, dtype): one dtype per layout keeps it to a few compiles
    cases += [("inductor", "tokens", torch.float32), ("inductor", "nchw_per_sample", torch.bfloat16)]
    return cases


def _half_cases() -> list:
    cases = []
    for dtype in HALVES:
        cases += [("eager", layout, dtype) for layout in ("tokens", "nchw_per_sample")]
        cases += [("torch", layout, dtype) for layout in _TORCH]
        cases += [pytest.param("cpp", layout, dtype, marks=needs_cpp) for layout in _CPP]
        cases.append(pytest.param("auto", "tokens", dtype, marks=needs_cpp))
    cases.append(("inductor", "tokens", torch.float16))
    return cases


@pytest.mark.parametrize("backend,layout,dtype", _cases())
def test_pairs_near_sqrt_eps_and_zero_pairs(backend: str, layout: str, dtype: torch.dtype) -> None:
    shape, channel_dim, spatial, fmt = LAYOUTS[layout]
    x, w, g = near_eps(shape, channel_dim, fmt, dtype)
    check_tight(forced(backend, channel_dim, spatial), x, w, g, channel_dim, spatial)


@pytest.mark.parametrize("backend,layout,dtype", _half_cases())
def test_half_pairs_whose_squares_pass_float16s_range(backend: str, layout: str, dtype: torch.dtype) -> None:
    shape, channel_dim, spatial, fmt = LAYOUTS[layout]
    x, w, g = past_half_range(shape, channel_dim, fmt, dtype)
    check_tight(forced(backend, channel_dim, spatial), x, w, g, channel_dim, spatial)


@pytest.mark.parametrize("make,dtype", [(near_eps, torch.float32), (near_eps, torch.bfloat16),
                                        (past_half_range, torch.float16)])
@pytest.mark.parametrize("layout", ["tokens", "nchw_per_sample"])
def test_compiled_call(make, dtype: torch.dtype, layout: str) -> None:
    """``torch.compile`` of the op: the compiled graph's operators (the C++ row operators for
    tokens) on the same inputs."""
    torch._dynamo.reset()
    shape, channel_dim, spatial, fmt = LAYOUTS[layout]
    x, w, g = make(shape, channel_dim, fmt, dtype)
    check_tight(torch.compile(forced("auto", channel_dim, spatial), fullgraph=True), x, w, g, channel_dim, spatial)
