"""The speed checks of ``benchmarks/gpu_check.py``: MRSNorm's kernels against Liger-Kernel's RMSNorm.

Per case and dtype, one row of the speed table:

* **kernel times** (``triton.testing.do_bench``: CUDA events, the L2 cache flushed before every
  repetition, the median): our Triton forward and backward called directly on the kernels' 3-d
  view, and Liger's ``rms_norm_forward``/``rms_norm_backward`` (its ops, not its module) on the
  same input; ``ratio`` = ours / Liger's (forward + backward), below 1 when ours is faster;
* **module times**: forward+backward of ``MRSNorm`` and of ``nn.RMSNorm`` through autograd
  (what a training step pays, Python dispatch included);
* **bandwidth**: the bytes our kernels must move (forward: read ``x``, write ``y``; backward:
  read ``x`` and ``g``, write ``dx``) over their time, as a share of a device copy timed the
  same way (``do_bench`` of ``b.copy_(a)`` on 256 MiB).

Liger is imported lazily, on the GPU only (``pip install liger-kernel`` on the GPU machine;
without it the Liger columns say so). On the CPU (the self-test) ``do_bench`` is replaced by a
``perf_counter`` median and the kernels are the ``torch`` backend's.
"""

from __future__ import annotations

import contextlib
import io
import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from lightning_mrs import MRSNorm
from lightning_mrs.ops.dispatch import get_backend
from lightning_mrs.ops.layout import Layout

__all__ = ["CASES", "SpeedCase", "SpeedRow", "bench", "copy_bandwidth", "run_case"]

EPS = 1e-6


@dataclass(frozen=True)
class SpeedCase:
    """Rows of ``shape[1]`` channels: ``shape[0]`` tokens (or heads x tokens for a QK-norm)."""

    name: str
    shape: tuple[int, int]
    dtype: str  # "bfloat16" or "float32"


#: The speed table's rows on a GPU, in order (the CPU self-test divides the rows by its scale).
CASES = [
    SpeedCase("tokens 8192x1024", (8192, 1024), "bfloat16"),
    SpeedCase("tokens 4096x4096", (4096, 4096), "bfloat16"),
    SpeedCase("tokens 16384x4096", (16384, 4096), "bfloat16"),
    SpeedCase("tokens 8192x8192", (8192, 8192), "bfloat16"),
    SpeedCase("QK-norm (8*2048*16)x128", (8 * 2048 * 16, 128), "bfloat16"),
    SpeedCase("QK-norm (8*2048*16)x64", (8 * 2048 * 16, 64), "bfloat16"),
    SpeedCase("tokens 4096x4096", (4096, 4096), "float32"),
    SpeedCase("QK-norm (8*2048*16)x128", (8 * 2048 * 16, 128), "float32"),
]


def bench(fn: Callable[[], object], device: str) -> float:
    """Median milliseconds of ``fn``: ``triton.testing.do_bench`` (L2 flushed) on CUDA, a
    ``perf_counter`` median of a few calls on the CPU."""
    if device.startswith("cuda"):
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10, rep=40, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device: str, nbytes: int = 1 << 28) -> float:
    """Bytes per second of a device copy (read + write ``nbytes``), timed like the kernels."""
    a = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    b = torch.empty_like(a)
    return 2 * nbytes / (bench(lambda: b.copy_(a), device) * 1e-3)


def _liger_ops() -> Optional[tuple[Callable, Callable]]:
    """Liger's RMSNorm ``(forward, backward)`` ops, or ``None`` when not importable."""
    try:  # quietly: Liger reports every optional backend it cannot import
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            logging.disable(logging.WARNING)
            from liger_kernel.ops.rms_norm import rms_norm_backward, rms_norm_forward
    except Exception:
        return None
    finally:
        logging.disable(logging.NOTSET)
    return rms_norm_forward, rms_norm_backward


@dataclass
class SpeedRow:
    """The figures of one case (milliseconds; ``None``: could not run here, see ``notes``)."""

    case: str
    dtype: str
    ours_fwd: float
    ours_bwd: float
    liger_fwd: Optional[float] = None
    liger_bwd: Optional[float] = None
    module_ours: Optional[float] = None  # MRSNorm forward+backward through autograd
    module_rms: Optional[float] = None  # nn.RMSNorm forward+backward through autograd
    bandwidth: float = 0.0  # bytes/s of our kernels
    copy_share: Optional[float] = None  # bandwidth / device copy
    notes: list[str] = field(default_factory=list)

    @property
    def ours(self) -> float:
        return self.ours_fwd + self.ours_bwd

    @property
    def liger(self) -> Optional[float]:
        return None if self.liger_fwd is None or self.liger_bwd is None else self.liger_fwd + self.liger_bwd

    @property
    def ratio(self) -> Optional[float]:
        """Our kernel time / Liger's (forward + backward): below 1, ours is faster."""
        return None if self.liger is None else self.ours / self.liger

    @property
    def faster(self) -> str:
        if self.ratio is None:
            return ""
        return "MRSNorm" if self.ratio < 1 else "Liger RMSNorm"

    def summary(self) -> str:
        parts = [f"kernels fwd {self.ours_fwd:.3f} + bwd {self.ours_bwd:.3f} ms"]
        if self.liger is not None:
            parts.append(f"Liger fwd {self.liger_fwd:.3f} + bwd {self.liger_bwd:.3f} ms: x{self.ratio:.2f}, "
                         f"{self.faster} faster")
        if self.module_ours is not None and self.module_rms is not None:
            parts.append(f"modules fwd+bwd {self.module_ours:.3f} ms vs nn.RMSNorm {self.module_rms:.3f} ms")
        share = f" ({self.copy_share:.0%} of a device copy)" if self.copy_share is not None else ""
        parts.append(f"{self.bandwidth / 1e9:.3g} GB/s{share}")
        return "; ".join(parts + self.notes)


def _module_ms(module: nn.Module, x: Tensor, gy: Tensor, device: str) -> float:
    x = x.detach().requires_grad_()

    def step() -> None:
        x.grad = None
        module(x).backward(gy)

    return bench(step, device)


def run_case(case: SpeedCase, device: str, copy_bw: Optional[float], scale: int = 1) -> SpeedRow:
    """Time ``case`` (its rows divided by ``scale``: the CPU self-test)."""
    dtype = getattr(torch, case.dtype)
    m, c = max(1, case.shape[0] // scale), case.shape[1]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, c, generator=g).to(device=device, dtype=dtype)
    gy = torch.randn(m, c, generator=g).to(device=device, dtype=dtype)
    w = (torch.rand(c // 2, generator=g) + 0.5).to(device=device, dtype=dtype)
    kernels = get_backend("triton" if device.startswith("cuda") else "torch")
    layout = Layout(last=True, spatial=False)
    x3, g3 = x.view(m, 1, c), gy.view(m, 1, c)
    _, r_sum = kernels.forward(x3, w, EPS, layout)
    row = SpeedRow(case.name, case.dtype, bench(lambda: kernels.forward(x3, w, EPS, layout), device),
                   bench(lambda: kernels.backward(x3, w, r_sum, g3, EPS, layout), device))
    liger = _liger_ops() if device.startswith("cuda") else None
    if liger is None:
        row.notes.append("Liger: not installed (pip install liger-kernel)" if device.startswith("cuda")
                         else "Liger: CUDA only")
    else:
        row.liger_fwd, row.liger_bwd = _liger_ms(liger, x, gy, dtype, device, row.notes)
    with torch.no_grad():
        ours = MRSNorm(c).to(device=device, dtype=dtype)
        ours.weight.copy_(w)
    row.module_ours = _module_ms(ours, x, gy, device)
    row.module_rms = _module_ms(nn.RMSNorm(c, eps=EPS).to(device=device, dtype=dtype), x, gy, device)
    moved = 5 * x.numel() * x.element_size()  # fwd: x, y; bwd: x, g, dx
    row.bandwidth = moved / (row.ours * 1e-3)
    row.copy_share = row.bandwidth / copy_bw if copy_bw else None
    return row


def _liger_ms(ops: tuple[Callable, Callable], x: Tensor, gy: Tensor, dtype: torch.dtype, device: str,
              notes: list[str]) -> tuple[Optional[float], Optional[float]]:
    """Liger's forward and backward op times on ``x`` (its Llama casting: fp32 compute, like ours)."""
    fwd, bwd = ops
    w = torch.ones(x.shape[1], device=device, dtype=dtype)
    try:
        _, xs, rstd, block, warps, casting = fwd(x, w, EPS, 0.0, "llama", None)
        f_ms = bench(lambda: fwd(x, w, EPS, 0.0, "llama", None), device)
        b_ms = bench(lambda: bwd(gy, xs, w, rstd, 0.0, casting, block, warps, False, None), device)
    except Exception as err:  # another Liger version's signature: say so, keep the row
        notes.append(f"Liger ops failed: {type(err).__name__}: {str(err)[:120]}")
        return None, None
    return f_ms, b_ms
