"""The ``triton`` backend (``lightning_mrs.ops.triton_kernels``) against the float64 reference.

The checks run natively on a CUDA machine, and on the CPU under Triton's interpreter.
``TRITON_INTERPRET=1`` must be set before triton is imported, so on a CPU-only machine the
drivers at the end run this file's checks in a pytest subprocess with the variable set
(the default ones, and with ``-m slow`` the wide rows); without it (and without CUDA) they
skip. The interpreter runs every program in Python (numpy per program), so the shapes stay
small in programs, not in channels: a 16,384-channel row is one program.

What each shape reaches in the kernels (:mod:`lightning_mrs.ops.triton_launch`): the row
kernel with many rows per program (``rows``, ``one_phasor``: 1,024 rows of 2 channels per
program), odd phasor counts (``tokens_odd_phasors``: P = 35), the column kernel (NCHW, a
middle channel dim, one position), NHWC through the row kernel, strided views of both, and
the grid fold (:func:`test_a_grid_capped_at_three_programs_still_covers_every_row`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Callable

import pytest
import torch

from lightning_mrs import mrs_norm
from lightning_mrs.ops import triton_launch
from helpers import ROOT
from helpers.checks import (
    assert_matches_reference, check_against_reference, check_half_gradient, forced, grads, make_inputs,
)
from helpers.hard_inputs import check_tight, near_eps, past_half_range

pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED or not torch.cuda.is_available() else "cuda"
runs_triton = pytest.mark.skipif(
    not INTERPRETED and DEVICE != "cuda", reason="needs CUDA or TRITON_INTERPRET=1 (see the interpreter driver)"
)

# name -> (shape, channel_dim, spatial, memory_format); the Triton kernels compute one S per position
LAYOUTS = {
    "rows": ((6, 10), -1, False, None),
    "one_phasor": ((9, 2), -1, False, None),
    "tokens_odd_phasors": ((3, 5, 70), -1, False, None),
    "nchw": ((2, 8, 3, 5), 1, False, None),
    "nhwc": ((2, 8, 3, 5), 1, False, torch.channels_last),
    "one_position": ((2, 6, 1, 1), 1, False, None),
    "middle_dim": ((3, 4, 6, 5), 2, False, None),
    "row_16384": ((2, 16384), -1, False, None),  # 32 warps, one row per program
    "row_65538": ((2, 65538), -1, False, None),  # wider than a program holds: the torch bodies
}
# wide rows and many programs: seconds each under the interpreter (slow)
WIDE = {
    "row_2050": ((3, 2050), -1, False, None),  # P = 1025: a 4,096-channel block, 8 warps
    "row_12290": ((2, 12290), -1, False, None),  # P = 6145, not a power of two
    "row_16386": ((2, 16386), -1, False, None),  # just past 16,384: a 32,768-channel block
    "nchw_4098": ((1, 4098, 3, 1), 1, False, None),  # the column kernel, one position per tile
    "nhwc_4098": ((1, 4098, 3, 1), 1, False, torch.channels_last),
    "qk_norm": ((1000, 130), -1, False, None),  # 125 programs of 8 rows, P = 65
    "nchw_many_tiles": ((2, 6, 300, 70), 1, False, None),
}
DTYPES = [(torch.float32, True), (torch.float32, False), (torch.float16, True), (torch.bfloat16, True)]
HALF_DTYPES = [torch.bfloat16, torch.float16]
# name -> (base shape, channel_dim, the view): strides the kernels read as they are
VIEWS: dict[str, tuple[tuple[int, ...], int, Callable[[torch.Tensor], torch.Tensor]]] = {
    "rows_cropped": ((12, 80), -1, lambda x: x[:, 10:50]),  # row stride 80, 40 channels
    "tokens_seq_first": ((7, 3, 40), -1, lambda x: x.transpose(0, 1)),
    "channels_strided": ((4, 5, 80), -1, lambda x: x[..., ::2]),  # channel stride 2: the column kernel
    "nchw_positions_strided": ((2, 8, 3, 10), 1, lambda x: x[..., ::2]),  # position stride 2
}


@pytest.mark.cuda
@runs_triton
@pytest.mark.parametrize("dtype,affine", DTYPES, ids=[f"{d}-{a}" for d, a in DTYPES])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_triton_matches_reference(layout: str, dtype: torch.dtype, affine: bool) -> None:
    check_against_reference("triton", LAYOUTS[layout], dtype, affine, device=DEVICE)


@pytest.mark.cuda
@runs_triton
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_triton_half_input_gradient_is_the_reference_rounded_once(layout: str, dtype: torch.dtype) -> None:
    check_half_gradient("triton", LAYOUTS[layout], dtype, device=DEVICE)


@pytest.mark.slow
@pytest.mark.cuda
@runs_triton
@pytest.mark.parametrize("layout", list(WIDE))
def test_triton_wide_rows_match_the_reference(layout: str) -> None:
    check_against_reference("triton", WIDE[layout], torch.float32, True, device=DEVICE)
    check_against_reference("triton", WIDE[layout], torch.bfloat16, False, device=DEVICE)
    check_half_gradient("triton", WIDE[layout], torch.float16, device=DEVICE)


HARD = [(near_eps, torch.float32), (near_eps, torch.bfloat16), (past_half_range, torch.float16)]


@pytest.mark.cuda
@runs_triton
@pytest.mark.parametrize("make,dtype", HARD, ids=[f"{m.__name__}-{d}" for m, d in HARD])
@pytest.mark.parametrize("layout", ["tokens_odd_phasors", "nchw", "nhwc"])
def test_triton_hard_inputs_match_the_reference_rounded_once(layout: str, make, dtype: torch.dtype) -> None:
    # pairs near sqrt(eps) and zero pairs (a kernel dropping eps), pairs of 300s (float16 squares)
    shape, channel_dim, spatial, fmt = LAYOUTS[layout]
    x, w, g = (t.to(DEVICE) for t in make(shape, channel_dim, fmt, dtype))
    check_tight(forced("triton", channel_dim, spatial), x, w, g, channel_dim, spatial)


def _view_inputs(name: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    shape, channel_dim, view = VIEWS[name]
    x, _, gy = make_inputs(shape, channel_dim, None, dtype, device=DEVICE)
    x = view(x)
    g = torch.Generator().manual_seed(1)
    w = (torch.rand(x.shape[channel_dim] // 2, generator=g, dtype=torch.float64) + 0.5).to(dtype).to(DEVICE)
    return x, w, view(gy), channel_dim


@pytest.mark.cuda
@runs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(VIEWS))
def test_triton_reads_strided_views(name: str, dtype: torch.dtype) -> None:
    x, w, gy, channel_dim = _view_inputs(name, dtype)
    assert not x.is_contiguous()
    got = grads(forced("triton", channel_dim), x, w, gy)
    assert_matches_reference(got, x, w, gy, channel_dim, False)


@pytest.mark.cuda
@runs_triton
@pytest.mark.parametrize("layout", ["rows", "one_phasor", "nchw", "nhwc"])
def test_a_grid_capped_at_three_programs_still_covers_every_row(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # the fold past CUDA's grid limit: every program loops over range(pid, blocks, 3); taller
    # inputs, so that there are many more tiles than programs (forward and backward)
    shape, channel_dim, spatial, fmt = LAYOUTS[layout]
    tall = ((700, shape[1]) if len(shape) == 2 else (12, shape[1], 40, 30))
    monkeypatch.setattr(triton_launch, "MAX_GRID0", 3)
    assert triton_launch.grid(10_000) == (3,) and triton_launch.persistent_programs(10_000, 132, 4) == 3
    for affine in (True, False):
        check_against_reference("triton", (tall, channel_dim, spatial, fmt), torch.float32, affine, device=DEVICE)


@pytest.mark.cuda
@runs_triton
@pytest.mark.parametrize("last", [True, False], ids=["rows", "columns"])
def test_offsets_past_two_to_the_31_elements(last: bool, tmp_path) -> None:
    """Rows 2^30 + 64 elements apart: row 2 starts past 2^31 elements, where a 32-bit
    ``a * stride`` wraps (the interpreter then reads a wild address and the process dies).
    On the CPU the 4 GiB input is a sparse file mapped into memory: only its touched pages exist."""
    from lightning_mrs.ops import triton_kernels
    from lightning_mrs.ops.layout import Layout
    from helpers.reference import mrs_norm_ref

    stride, c = 2**30 + 64, 10
    n = 2 * stride + 2 * c
    if DEVICE == "cpu":
        path = tmp_path / "sparse.bin"
        with open(path, "wb") as f:
            f.truncate(2 * n)
        base = torch.from_file(str(path), shared=True, size=n, dtype=torch.float16)
    else:
        base = torch.zeros(n, dtype=torch.float16, device=DEVICE)
    shape, strides = ((3, 1, c), (stride, c, 1)) if last else ((3, c, 2), (stride, 2, 1))
    x3 = base.as_strided(shape, strides)
    g = torch.Generator().manual_seed(0)
    vals = (3 * torch.randn(shape, generator=g)).half()
    gy = torch.randn(shape, generator=g).half()
    x3.copy_(vals)
    w = torch.rand(c // 2, generator=g) + 0.5
    layout = Layout(last=last, spatial=False)
    y3, r_sum = triton_kernels.forward(x3, w.to(DEVICE), 1e-6, layout)
    dx3, dw = triton_kernels.backward(x3, w.to(DEVICE), r_sum, gy.to(DEVICE), 1e-6, layout)
    v, w64 = vals.double().requires_grad_(), w.double().requires_grad_()
    ref = mrs_norm_ref(v, w64, channel_dim=-1 if last else 1, spatial=False)
    ref.backward(gy.double())
    torch.testing.assert_close(y3.cpu().double(), ref.detach(), atol=4e-3, rtol=4e-3)
    torch.testing.assert_close(dx3.cpu().double(), v.grad, atol=4e-2, rtol=4e-2)
    torch.testing.assert_close(dw.cpu().double(), w64.grad, atol=4e-2, rtol=4e-2)
    del base


@pytest.mark.cuda
@runs_triton
def test_triton_refuses_one_scale_per_sample() -> None:
    with pytest.raises(ValueError, match=r"backend='triton'.*one S per position \(spatial=False\)"):
        mrs_norm(torch.randn(2, 4, 3, 3, device=DEVICE), channel_dim=1, spatial=True, backend="triton")


def _interpret(marker: str, timeout: float) -> str:
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-rs",
         "-m", marker, "-k", "not under_the_interpreter and not auto_picks_triton"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    return summary


@pytest.mark.skipif(INTERPRETED, reason="already under the interpreter")
def test_triton_kernels_under_the_interpreter() -> None:
    summary = _interpret("not slow", timeout=600)
    expected = len(LAYOUTS) * (len(DTYPES) + len(HALF_DTYPES)) + 2 * len(VIEWS) + 4 + 2 + 1 + 3 * len(HARD)
    assert summary.startswith(f"{expected} passed") and "skipped" not in summary, summary


@pytest.mark.slow
@pytest.mark.skipif(INTERPRETED, reason="already under the interpreter")
def test_triton_wide_rows_under_the_interpreter() -> None:
    summary = _interpret("slow", timeout=1200)
    assert summary.startswith(f"{len(WIDE)} passed") and "skipped" not in summary, summary


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_picks_triton_on_cuda() -> None:
    from lightning_mrs.ops import which_backend

    assert which_backend(torch.randn(64, 128, device="cuda")) == "triton"
