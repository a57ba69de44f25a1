"""The speed rows of ``benchmarks/gpu_check.py`` (the anchors and the bar: ``gpu_check_results.py``).

Per case (rows x channels, a dtype), forward and backward apart:

* **our kernels** (the Triton forward and backward on the kernels' 3-d view) and **Liger-Kernel's
  RMSNorm ops** (``rms_norm_forward``/``rms_norm_backward``, Llama casting: fp32 compute, like
  ours), each timed by ``triton.testing.do_bench`` (CUDA events, L2 flushed, the median);
* **the modules**: ``MRSNorm`` and torch's ``nn.RMSNorm``, the forward with autograd recording
  and the backward by ``torch.autograd.grad`` of a kept graph (what a training step pays);
* **GB/s**: the bytes the kernels must move (forward: read ``x``, write ``y``; backward: read
  ``x`` and ``g``, write ``dx``) over our kernel time, and its share of a device copy timed the
  same way (``b.copy_(a)``, 256 MiB): the practical peak of this card.

``x Liger`` is Liger's op time over ours, ``x nn.RMSNorm`` the torch module's time over
``MRSNorm``'s: above 1, ours is faster. The decode rows (one token) time a call of each module
as a decoder makes it: back to back (launch-bound), and replayed from a CUDA graph.

Liger is imported lazily, on the GPU only. On the CPU (the harness's self-test) ``bench`` is a
``perf_counter`` median and our kernels are the ``torch`` backend's.
"""

from __future__ import annotations

import contextlib
import io
import logging
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from gpu_check_results import anchors_for
from lightning_mrs import MRSNorm
from lightning_mrs.ops import which_backend
from lightning_mrs.ops.dispatch import get_backend
from lightning_mrs.ops.layout import Layout

__all__ = ["CASES", "DECODE_WIDTHS", "SpeedCase", "SpeedRow", "bench", "copy_bandwidth", "decode_case", "run_case"]

EPS = 1e-6


@dataclass(frozen=True)
class SpeedCase:
    """Rows of ``shape[1]`` channels: ``shape[0]`` tokens (or heads x tokens for a QK-norm)."""

    name: str
    shape: tuple[int, int]
    dtype: str  # "bfloat16" or "float32"


#: The speed rows on a GPU, in order (the CPU self-test divides the rows by its scale).
CASES = [
    SpeedCase("tokens 8192x1024", (8192, 1024), "bfloat16"),
    SpeedCase("tokens 4096x4096", (4096, 4096), "bfloat16"),
    SpeedCase("tokens 16384x4096", (16384, 4096), "bfloat16"),
    SpeedCase("tokens 8192x8192", (8192, 8192), "bfloat16"),
    SpeedCase("tokens 4096x16384", (4096, 16384), "bfloat16"),
    SpeedCase("QK-norm (8*2048*16)x128", (8 * 2048 * 16, 128), "bfloat16"),
    SpeedCase("QK-norm (8*2048*16)x64", (8 * 2048 * 16, 64), "bfloat16"),
    SpeedCase("tokens 4096x4096", (4096, 4096), "float32"),
    SpeedCase("QK-norm (8*2048*16)x128", (8 * 2048 * 16, 128), "float32"),
]
#: The decode rows: one token of these widths (bfloat16)
DECODE_WIDTHS = (2048, 4096)

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


def _ratio(theirs: Optional[float], ours: Optional[float]) -> Optional[float]:
    return None if theirs is None or not ours else theirs / ours


@dataclass
class SpeedRow:
    """The figures of one case (milliseconds; ``None``: could not run here, see ``notes``)."""

    case: str
    dtype: str
    shape: tuple[int, int]
    nbytes: int  # bytes of one tensor of the case (x, y, g or dx)
    ours_fwd: float
    ours_bwd: float
    copy_bw: Optional[float] = None  # bytes/s of the device copy
    liger_fwd: Optional[float] = None
    liger_bwd: Optional[float] = None
    mrs_fwd: Optional[float] = None  # the MRSNorm module
    mrs_bwd: Optional[float] = None
    rms_fwd: Optional[float] = None  # torch's nn.RMSNorm
    rms_bwd: Optional[float] = None
    notes: list[str] = field(default_factory=list)

    def figures(self) -> dict:
        """The row's columns of the result file (GB/s, shares, ratios) and the raw figures."""
        fwd_bw, bwd_bw = 2 * self.nbytes / (self.ours_fwd * 1e-3), 3 * self.nbytes / (self.ours_bwd * 1e-3)
        share = (lambda bw: bw / self.copy_bw if self.copy_bw else None)
        return {"fwd_gbs": fwd_bw / 1e9, "fwd_copy": share(fwd_bw),
                "fwd_vs_liger": _ratio(self.liger_fwd, self.ours_fwd), "fwd_vs_torch": _ratio(self.rms_fwd, self.mrs_fwd),
                "bwd_gbs": bwd_bw / 1e9, "bwd_copy": share(bwd_bw),
                "bwd_vs_liger": _ratio(self.liger_bwd, self.ours_bwd), "bwd_vs_torch": _ratio(self.rms_bwd, self.mrs_bwd),
                "raw": asdict(self)}

    def summary(self) -> str:
        parts = [f"kernels fwd {self.ours_fwd:.4f} ms, bwd {self.ours_bwd:.4f} ms"]
        if self.liger_fwd is not None:
            parts.append(f"Liger fwd {self.liger_fwd:.4f}, bwd {self.liger_bwd:.4f} ms")
        if self.mrs_fwd is not None:
            parts.append(f"modules fwd {self.mrs_fwd:.4f} / nn.RMSNorm {self.rms_fwd:.4f} ms, "
                         f"bwd {self.mrs_bwd:.4f} / {self.rms_bwd:.4f} ms")
        return "; ".join(parts + self.notes + [f"anchor: {a}" for a in anchors_for(self.shape[1])])


def _module_ms(module: nn.Module, x: Tensor, gy: Tensor, device: str) -> tuple[float, float]:
    """``(forward, backward)`` ms of ``module`` on ``x`` (the forward recording autograd)."""
    x = x.detach().requires_grad_()
    inputs = (x, *module.parameters())
    y = module(x)
    fwd = bench(lambda: module(x), device)
    bwd = bench(lambda: torch.autograd.grad(y, inputs, gy, retain_graph=True), device)
    return fwd, bwd


def run_case(case: SpeedCase, device: str, copy_bw: Optional[float], scale: int = 1) -> SpeedRow:
    """Time ``case`` (its rows divided by ``scale``: the CPU self-test)."""
    dtype = getattr(torch, case.dtype)
    m, c = max(1, case.shape[0] // scale), case.shape[1]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, c, generator=g).to(device=device, dtype=dtype)  # (M, C)
    gy = torch.randn(m, c, generator=g).to(device=device, dtype=dtype)  # (M, C)
    w = (torch.rand(c // 2, generator=g) + 0.5).to(device=device, dtype=dtype)  # (P,)
    cuda = device.startswith("cuda")
    kernels = get_backend("triton" if cuda else "torch")
    layout = Layout(last=True, spatial=False)
    x3, g3 = x.view(m, 1, c), gy.view(m, 1, c)  # the kernels' canonical (A, L, C) view
    _, r_sum = kernels.forward(x3, w, EPS, layout)
    row = SpeedRow(case.name, case.dtype, (m, c), x.numel() * x.element_size(),
                   bench(lambda: kernels.forward(x3, w, EPS, layout), device),
                   bench(lambda: kernels.backward(x3, w, r_sum, g3, EPS, layout), device), copy_bw)
    liger = _liger_ops() if cuda else None
    if liger is None:
        row.notes.append("Liger: not installed (pip install liger-kernel)" if cuda else "Liger: CUDA only")
    else:
        row.liger_fwd, row.liger_bwd = _liger_ms(liger, x, gy, dtype, device, row.notes)
    ours = MRSNorm(c, eps=EPS).to(device=device, dtype=dtype)
    with torch.no_grad():
        ours.weight.copy_(w)
    row.mrs_fwd, row.mrs_bwd = _module_ms(ours, x, gy, device)
    row.rms_fwd, row.rms_bwd = _module_ms(nn.RMSNorm(c, eps=EPS).to(device=device, dtype=dtype), x, gy, device)
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


def _per_call_ms(fn: Callable[[], object], device: str, calls: int = 200) -> float:
    """Wall milliseconds per call of ``calls`` back to back (a decoder's launch-bound loop)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(10):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) * 1e3 / calls


def _graph_ms(fn: Callable[[], object], calls: int = 200) -> float:
    """Milliseconds per call of ``calls`` captured in one CUDA graph, replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up outside the capture (plans, autotuning, allocations)
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return _per_call_ms(graph.replay, "cuda", calls=10) / calls


def decode_case(channels: int, device: str) -> tuple[dict, list[str]]:
    """Per-call ms of ``MRSNorm`` and ``nn.RMSNorm`` on one bfloat16 token, back to back and
    (CUDA) replayed from a graph: ``({"mrs_ms", "rms_ms", "mrs_graph_ms", "rms_graph_ms"}, notes)``."""
    x = torch.randn(1, channels, device=device, dtype=torch.bfloat16)  # (1, C)
    modules = {"mrs": MRSNorm(channels, eps=EPS), "rms": nn.RMSNorm(channels, eps=EPS)}
    out: dict = {}
    notes: list[str] = []
    with torch.no_grad():
        for name, module in modules.items():
            module = module.to(device=device, dtype=torch.bfloat16)
            out[f"{name}_ms"] = _per_call_ms(lambda: module(x), device)
            out[f"{name}_graph_ms"] = None
            if not device.startswith("cuda"):
                continue
            try:
                out[f"{name}_graph_ms"] = _graph_ms(lambda: module(x))
            except Exception as err:  # a capture that fails is the finding of this row
                notes.append(f"{name}: CUDA graph capture failed: {type(err).__name__}: {str(err)[:120]}")
    if not device.startswith("cuda"):
        notes.append("CUDA graphs: CUDA only")
    return out, [f"MRSNorm ran the {which_backend(x)} backend", *notes]
