"""The Triton kernels of ``lightning_mrs.kernels_triton`` against the float64 reference.

On the CPU they run under Triton's interpreter: ``TRITON_INTERPRET=1`` must be set before
triton is imported, so the check runs in a subprocess (small shapes: the interpreter is
slow). On a CUDA machine the same checks run on the GPU, natively.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

TESTS = Path(__file__).parent

# (shape, channel_dim, memory_format) - tokens, odd widths, NCHW, NHWC, a 1-position tail
CASES = [
    ((6, 10), -1, None),
    ((3, 5, 70), -1, None),
    ((2, 8, 3, 5), 1, None),
    ((2, 8, 3, 5), 1, "channels_last"),
    ((2, 6, 1, 1), 1, None),
]

CHECK = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    from lightning_mrs import mrs_norm
    from mrs_reference import mrs_norm_ref
    device = {device!r}
    tols = {{torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}}
    for shape, cd, mf in {cases!r}:
        for dtype, affine in ((torch.float32, True), (torch.float32, False), (torch.float16, True), (torch.bfloat16, True)):
            g = torch.Generator().manual_seed(0)
            x = (2 * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)
            if mf:
                x = x.contiguous(memory_format=getattr(torch, mf))
            w = (torch.rand(shape[cd] // 2, generator=g, dtype=torch.float64) + 0.5).to(dtype) if affine else None
            gy = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
            x, gy = x.to(device), gy.to(device)
            w = w.to(device).requires_grad_() if affine else None
            x.requires_grad_()
            y = mrs_norm(x, w, channel_dim=cd, backend="triton")
            y.backward(gy)
            xr = x.detach().double().requires_grad_()
            wr = w.detach().double().requires_grad_() if affine else None
            yr = mrs_norm_ref(xr, wr, channel_dim=cd)
            yr.backward(gy.double())
            t = tols[dtype]
            assert y.dtype == dtype and all(a == b for a, b, n in zip(y.stride(), x.stride(), shape) if n > 1), (shape, dtype)
            torch.testing.assert_close(y.double(), yr, atol=t, rtol=t)
            torch.testing.assert_close(x.grad.double(), xr.grad, atol=10 * t, rtol=10 * t)
            if affine:
                torch.testing.assert_close(w.grad.double(), wr.grad, atol=10 * t * wr.grad.abs().max().item(), rtol=10 * t)
    print("TRITON-OK")
    """
)


def _script(device: str) -> str:
    return CHECK.format(tests=str(TESTS), device=device, cases=CASES)


def test_triton_kernels_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run(
        [sys.executable, "-c", _script("cpu")], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert "TRITON-OK" in out.stdout


def test_triton_backend_refuses_spatial_with_a_clear_error():
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = (
        "import torch; from lightning_mrs import mrs_norm\n"
        "try:\n"
        "    mrs_norm(torch.randn(2, 4, 3, 3), channel_dim=1, spatial=True, backend='triton')\n"
        "except ValueError as e:\n"
        "    print('REFUSED', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "REFUSED" in out.stdout and "spatial=False" in out.stdout, out.stderr[-2000:]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_kernels_on_cuda():
    out = subprocess.run([sys.executable, "-c", _script("cuda")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "TRITON-OK" in out.stdout


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_picks_triton_on_cuda():
    from lightning_mrs import fused

    x = torch.randn(64, 128, device="cuda")
    assert fused.resolve_backend(x, 1, False, "auto") == "triton"
