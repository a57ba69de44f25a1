"""The correctness checks of ``benchmarks/gpu_check.py``: every layout x dtype x backend against a
float64 reference, and the half-precision input gradient to one ulp.

Device-agnostic: every function takes the device, so that the same code runs as
``gpu_check.py --device cpu`` (the self-test of ``tests/benchmarks/test_gpu_check.py``) and on
CUDA. Nothing here imports triton at import time. (The speed checks: ``gpu_check_speed.py``.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor

from lightning_mrs import mrs_norm

__all__ = ["HALF_LAYOUTS", "LAYOUTS", "TOLS", "check_backend_dtype", "half_gradient_error", "reference"]

#: name -> (shape, channel_dim, spatial, memory_format, view): every layout the kernels tell
#: apart, odd sizes, and two non-contiguous views ("transposed": a sequence-first tensor seen
#: batch-first; "sliced": every other row)
LAYOUTS: dict[str, tuple] = {
    "tokens": ((8, 33, 256), -1, False, None, None),
    "tokens_per_sample": ((4, 33, 256), -1, True, None, None),
    "tokens_transposed": ((33, 8, 256), -1, False, None, "transposed"),
    "tokens_sliced": ((16, 33, 256), -1, False, None, "sliced"),
    "wide_row": ((3, 8194), -1, False, None, None),
    "nchw_per_position": ((4, 64, 9, 11), 1, False, None, None),
    "nchw_per_sample": ((4, 64, 9, 11), 1, True, None, None),
    "nhwc_per_position": ((4, 64, 9, 11), 1, False, torch.channels_last, None),
    "nhwc_per_sample": ((4, 64, 9, 11), 1, True, torch.channels_last, None),
    "middle_dim": ((4, 6, 64, 5), 2, False, None, None),
}
#: (atol, rtol) of the output per dtype (the gradients get 10x), as in tests/helpers/checks.py
TOLS = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (3e-2, 3e-2), torch.float16: (4e-3, 4e-3)}
EPS = 1e-6


def reference(x: Tensor, w: Optional[Tensor], channel_dim: int, spatial: bool, eps: float = EPS) -> Tensor:
    """MRSNorm in float64, written out here from docs/method.md (independent of the package)."""
    x = x.double()
    cd = channel_dim % x.ndim
    pairs = x.unflatten(cd, (-1, 2))  # (..., P, 2, ...)
    r = (pairs.square().sum(cd + 1) + eps).sqrt()  # (..., P, ...)
    s = r.mean(dim=list(range(1, x.ndim)) if spatial else [cd], keepdim=True)
    y = x / s
    if w is not None:
        y = y * w.double().repeat_interleave(2).view([-1] + [1] * (x.ndim - 1 - cd))
    return y


def make_inputs(layout: str, dtype: torch.dtype, device: str, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """``(x, w, gy)`` of ``layout``: drawn in float64 on the CPU, cast, moved, then viewed."""
    shape, channel_dim, _, memory_format, view = LAYOUTS[layout]
    g = torch.Generator().manual_seed(seed)
    x = 3 * torch.randn(shape, generator=g, dtype=torch.float64)
    w = torch.rand(shape[channel_dim] // 2, generator=g, dtype=torch.float64) + 0.5
    x, w = x.to(device=device, dtype=dtype), w.to(device=device, dtype=dtype)
    if memory_format is not None:
        x = x.contiguous(memory_format=memory_format)
    if view == "transposed":
        x = x.transpose(0, 1)
    elif view == "sliced":
        x = x[::2]
    gy = torch.randn(x.shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    return x, w, gy


def _ratio(got: Tensor, ref: Tensor, atol: float, rtol: float) -> float:
    """The largest ``|got - ref| / (atol + rtol |ref|)``: at most 1 within tolerance."""
    err = (got.detach().double() - ref.detach()).abs() / (atol + rtol * ref.detach().abs())
    return float(err.max()) if err.numel() else 0.0


def check_layout(norm: Callable, layout: str, dtype: torch.dtype, device: str) -> float:
    """The worst error of ``norm(x, w)`` (forward, input and weight gradient) over tolerance.

    Raises:
        AssertionError: a wrong dtype or a lost memory format.
    """
    _, channel_dim, spatial, _, _ = LAYOUTS[layout]
    x, w, gy = make_inputs(layout, dtype, device)
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = norm(xg, wg)
    y.backward(gy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = reference(x64, w64, channel_dim, spatial)
    ref.backward(gy.double())
    assert y.dtype == dtype and xg.grad.dtype == dtype and wg.grad.dtype == dtype, (y.dtype, xg.grad.dtype)
    if x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last):
        assert y.stride() == x.stride(), f"memory format lost: {y.stride()} for {x.stride()}"
    atol, rtol = TOLS[dtype]
    scale = max(float(w64.grad.abs().max()), 1.0)  # dw sums over the batch
    return max(_ratio(y, ref.detach(), atol, rtol), _ratio(xg.grad, x64.grad, 10 * atol, 10 * rtol),
               _ratio(wg.grad, w64.grad, 10 * atol * scale, 10 * rtol))


@dataclass
class Outcome:
    """The result of one (backend, dtype) over every layout."""

    worst: float = 0.0  # the largest error / tolerance
    failed: list[str] = field(default_factory=list)  # "layout: why"
    refused: list[str] = field(default_factory=list)  # layouts the backend refused (a ValueError)

    @property
    def ok(self) -> bool:
        return not self.failed

    def row(self, n: int) -> tuple[str, str, dict]:
        """``(status, result, figures)``: the row of the check over ``n`` layouts."""
        ran = n - len(self.refused) - len(self.failed)
        text = f"{ran}/{n} layouts within tolerance, worst error {self.worst:.2f} x tolerance"
        if self.refused:
            text += f"; refused as documented: {', '.join(self.refused)}"
        if self.failed:
            text += "; FAILED " + " | ".join(self.failed)
        figures = {"worst": self.worst, "failed": self.failed, "refused": self.refused}
        return ("PASS" if self.ok else "FAIL"), text, figures


def check_backend_dtype(backend: str, dtype: torch.dtype, device: str,
                        expected_refusal: Callable[[str], bool], layouts: Optional[list[str]] = None,
                        compiled: bool = False) -> Outcome:
    """Every layout with ``backend`` forced (``compiled``: under ``torch.compile(fullgraph=True)``,
    the torch.library ops); a refusal is a failure unless ``expected_refusal(layout)``."""
    out = Outcome()
    for layout in layouts or list(LAYOUTS):
        _, channel_dim, spatial, _, _ = LAYOUTS[layout]

        def norm(a: Tensor, b: Tensor) -> Tensor:
            return mrs_norm(a, b, channel_dim=channel_dim, spatial=spatial, backend=backend)

        try:
            if compiled:
                torch._dynamo.reset()  # one code object for every layout: a fresh compile each
                norm = torch.compile(norm, fullgraph=True, dynamic=False)
            ratio = check_layout(norm, layout, dtype, device)
        except ValueError as err:
            if "cannot run" in str(err) and expected_refusal(layout):
                out.refused.append(layout)
            else:
                out.failed.append(f"{layout}: {type(err).__name__}: {str(err)[:160]}")
            continue
        except Exception as err:  # a crash in a kernel is a failure of this check, not of the script
            out.failed.append(f"{layout}: {type(err).__name__}: {str(err)[:160]}")
            continue
        out.worst = max(out.worst, ratio)
        if not ratio <= 1.0:
            out.failed.append(f"{layout}: error {ratio:.2f} x tolerance")
    return out



#: The layouts of the one-ulp check: tokens (the row kernel), a wide row, NCHW (the column
#: kernel), NHWC, and one S per sample (not Triton's: ``auto`` runs Inductor there)
HALF_LAYOUTS = ["tokens", "wide_row", "nchw_per_position", "nhwc_per_position", "tokens_sliced", "nchw_per_sample"]


def half_gradient_error(backend: str, layout: str, dtype: torch.dtype, device: str) -> float:
    """``max |dx - ref| / (eps |ref| + eps max|ref|)`` for a half ``dtype``: at most 1 when the
    input gradient is the float64 reference rounded once (as ``tests/helpers/checks.py``).

    ``dx = w g / S - k x / r``: with ``g`` drawn apart from ``x`` the second term is about
    ``1/sqrt(n)`` of the first and hides inside a loose half tolerance (a kernel missing it
    passes); here ``g = x + noise``, so both terms count, and the float32 maths leaves one
    rounding to the half result as the only error.
    """
    _, channel_dim, spatial, _, _ = LAYOUTS[layout]
    x, w, gy = make_inputs(layout, dtype, device)
    g = (x.double() + gy.double()).to(dtype)
    xg = x.detach().requires_grad_()
    mrs_norm(xg, w, channel_dim=channel_dim, spatial=spatial, backend=backend).backward(g)
    x64 = x.detach().double().requires_grad_()
    reference(x64, w.double(), channel_dim, spatial).backward(g.double())
    eps = torch.finfo(dtype).eps
    return _ratio(xg.grad, x64.grad, eps * float(x64.grad.abs().max()), eps)
