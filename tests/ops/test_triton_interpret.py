"""The ``triton`` backend (``lightning_mrs.ops.triton_kernels``) against the float64 reference.

The checks run natively on a CUDA machine, and on the CPU under Triton's interpreter.
``TRITON_INTERPRET=1`` must be set before triton is imported, so on a CPU-only machine
:func:`test_triton_kernels_under_the_interpreter` runs this file's checks in a pytest
subprocess with the variable set; without it (and without CUDA) they skip. Tiny shapes: the
interpreter runs every program instance in Python.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from lightning_mrs import mrs_norm
from helpers import ROOT
from helpers.checks import check_against_reference, check_half_gradient

pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED or not torch.cuda.is_available() else "cuda"
runs_triton = pytest.mark.skipif(
    not INTERPRETED and DEVICE != "cuda", reason="needs CUDA or TRITON_INTERPRET=1 (see the interpreter driver)"
)

# name -> (shape, channel_dim, spatial, memory_format): tokens, an odd width, NCHW, NHWC,
# one position per sample (the Triton kernels compute one S per position only)
LAYOUTS = {
    "rows": ((6, 10), -1, False, None),
    "tokens_odd_width": ((3, 5, 70), -1, False, None),
    "nchw": ((2, 8, 3, 5), 1, False, None),
    "nhwc": ((2, 8, 3, 5), 1, False, torch.channels_last),
    "one_position": ((2, 6, 1, 1), 1, False, None),
}
DTYPES = [(torch.float32, True), (torch.float32, False), (torch.float16, True), (torch.bfloat16, True)]
HALF_DTYPES = [torch.bfloat16, torch.float16]


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


@pytest.mark.cuda
@runs_triton
def test_triton_refuses_one_scale_per_sample() -> None:
    with pytest.raises(ValueError, match=r"backend='triton'.*one S per position \(spatial=False\)"):
        mrs_norm(torch.randn(2, 4, 3, 3, device=DEVICE), channel_dim=1, spatial=True, backend="triton")


@pytest.mark.skipif(INTERPRETED, reason="already under the interpreter")
def test_triton_kernels_under_the_interpreter() -> None:
    names = ("test_triton_matches_reference", "test_triton_half_input_gradient_is_the_reference_rounded_once",
             "test_triton_refuses_one_scale_per_sample")
    nodes = [f"{__file__}::{name}" for name in names]
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *nodes],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    expected = len(LAYOUTS) * (len(DTYPES) + len(HALF_DTYPES)) + 1
    assert summary.startswith(f"{expected} passed") and "skipped" not in summary, summary


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_picks_triton_on_cuda() -> None:
    from lightning_mrs.ops import which_backend

    assert which_backend(torch.randn(64, 128, device="cuda")) == "triton"
