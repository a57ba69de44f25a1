"""The op's checks of ``benchmarks/gpu_check.py``: correctness of every layout x dtype x backend
against a float64 reference, and speed, memory and achieved bandwidth against torch's native
norms and Liger-Kernel's.

Device-agnostic: every function takes the device, so that the same code runs as
``gpu_check.py --device cpu`` (the self-test of ``tests/benchmarks/test_gpu_check.py``) and on
CUDA; the CUDA-only parts (events, peak memory, the GPU's nominal bandwidth) are small functions
with a CPU counterpart. Nothing here imports triton or liger_kernel at import time.
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
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_mrs import MRSNorm, MRSNorm2d, mrs_norm

__all__ = ["LAYOUTS", "TOLS", "Case", "check_backend_dtype", "copy_bandwidth", "nominal_bandwidth",
           "reference", "speed_case", "SPEED_CASES"]

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


# --- speed, memory, bandwidth -------------------------------------------------------------------
def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], object], device: str, iters: int, rounds: int) -> tuple[float, float]:
    """``(median, fastest)`` milliseconds per call of ``fn`` over ``rounds`` rounds of ``iters``
    calls (CUDA events on a GPU, ``perf_counter`` on the CPU), after a warm-up round."""
    for _ in range(max(2, iters // 4)):
        fn()
    _sync(device)
    times = []
    for _ in range(rounds):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / iters)
    return statistics.median(times), min(times)


def peak_bytes(fn: Callable[[], object], device: str) -> Optional[int]:
    """Peak memory a call of ``fn`` allocates above what was allocated before (CUDA only)."""
    if not device.startswith("cuda"):
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def copy_bandwidth(device: str, nbytes: int = 1 << 28) -> float:
    """Bytes per second of a device-to-device copy (read + write) of ``nbytes``: the
    bandwidth a memory-bound kernel can reach here."""
    a = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    b = torch.empty_like(a)
    ms, _ = time_ms(lambda: b.copy_(a), device, iters=10, rounds=5)
    return 2 * nbytes / (ms * 1e-3)


def nominal_bandwidth(device: str) -> Optional[float]:
    """The GPU's nominal memory bandwidth (bytes/s) from its memory clock and bus width
    (double data rate), or ``None`` off CUDA or when the properties lack them."""
    if not device.startswith("cuda"):
        return None
    props = torch.cuda.get_device_properties(device)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    return 2 * clock_khz * 1e3 * bus_bits / 8 if clock_khz and bus_bits else None


class _LayerNorm2d(nn.LayerNorm):
    """timm's LayerNorm2d: ``F.layer_norm`` over the channels of an NCHW tensor."""

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias,
                            self.eps).permute(0, 3, 1, 2)


def _liger(kind: str, c: int) -> Optional[nn.Module]:
    try:  # quietly: Liger reports every optional backend it cannot import
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            logging.disable(logging.WARNING)
            from liger_kernel.transformers import LigerLayerNorm, LigerRMSNorm
    except Exception:  # not installed, or no triton: the row is left out (the table says so)
        return None
    finally:
        logging.disable(logging.NOTSET)
    return LigerRMSNorm(c) if kind == "rms" else LigerLayerNorm(c)


@dataclass
class Case:
    """One speed case: an input shape and the modules to time on it (the first is ours)."""

    name: str
    shape: tuple[int, ...]
    modules: Callable[[], dict[str, Optional[nn.Module]]]
    bandwidth: bool = False  # report the achieved fraction of the memory bandwidth


def _tokens(m: int, c: int) -> Case:
    return Case(f"tokens {m}x{c}", (m, c), lambda: {
        "MRSNorm": MRSNorm(c), "F.layer_norm": nn.LayerNorm(c), "F.rms_norm": nn.RMSNorm(c),
        "LigerRMSNorm": _liger("rms", c), "LigerLayerNorm": _liger("layer", c),
    }, bandwidth=True)


#: the speed cases on a GPU; ``--device cpu`` scales them down (:func:`scaled`)
SPEED_CASES = [
    _tokens(8192, 1024), _tokens(4096, 4096), _tokens(16384, 4096), _tokens(8192, 8192),
    Case("nchw 64x64x32x32 per sample", (64, 64, 32, 32), lambda: {
        "MRSNorm2d(spatial=True)": MRSNorm2d(64, spatial=True), "F.group_norm(1 group)": nn.GroupNorm(1, 64)}),
    Case("nchw 64x64x32x32 per position", (64, 64, 32, 32), lambda: {
        "MRSNorm2d": MRSNorm2d(64), "F.layer_norm (LayerNorm2d)": _LayerNorm2d(64)}),
]


def scaled(case: Case, factor: int) -> Case:
    """``case`` with its first dim divided by ``factor`` (the CPU self-test)."""
    return Case(case.name, (max(1, case.shape[0] // factor), *case.shape[1:]), case.modules, case.bandwidth)


@dataclass
class SpeedResult:
    """Figures of one case and dtype: per module, fwd+bwd ms (median, fastest), peak bytes."""

    case: str
    dtype: str
    ours: str
    ms: dict[str, float] = field(default_factory=dict)
    min_ms: dict[str, float] = field(default_factory=dict)
    peak: dict[str, Optional[int]] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)  # modules that could not run here
    bandwidth: Optional[float] = None  # ours, bytes/s (fwd: read x, write y; bwd: read x, g, write dx)

    def summary(self, copy_bw: Optional[float], peak_bw: Optional[float]) -> str:
        """One line: our time, then ours / theirs per peer (time, then peak memory), and bandwidth."""
        ours = self.ours
        if ours not in self.ms:
            return f"{ours} did not run; " + "; ".join(self.missing)
        parts = [f"{ours} {self.ms[ours]:.3f} ms"]
        for name, ms in self.ms.items():
            if name == ours:
                continue
            part = f"x{self.ms[ours] / ms:.2f} {name}"
            if self.peak.get(name) and self.peak.get(ours) is not None:
                part += f" (mem x{self.peak[ours] / self.peak[name]:.2f})"
            parts.append(part)
        if self.bandwidth is not None:
            shares = [f"{self.bandwidth / 1e9:.0f} GB/s"]
            if copy_bw:
                shares.append(f"{self.bandwidth / copy_bw:.0%} of copy")
            if peak_bw:
                shares.append(f"{self.bandwidth / peak_bw:.0%} of nominal")
            parts.append(", ".join(shares))
        if self.missing:
            parts.append("n/a: " + ", ".join(self.missing))
        return "; ".join(parts)


def speed_case(case: Case, dtype: torch.dtype, device: str, iters: int = 20, rounds: int = 5) -> SpeedResult:
    """Forward+backward of every module of ``case`` on one input (same data for all)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(case.shape, generator=g).to(device=device, dtype=dtype).requires_grad_()
    gy = torch.randn(case.shape, generator=g).to(device=device, dtype=dtype)
    modules = case.modules()
    out = SpeedResult(case.name, str(dtype).removeprefix("torch."), next(iter(modules)))
    for name, module in modules.items():
        if module is None:
            out.missing.append(f"{name} (not installed)")
            continue
        module = module.to(device=device, dtype=dtype)

        def step(m: nn.Module = module) -> None:
            x.grad = None
            m(x).backward(gy)

        try:
            out.ms[name], out.min_ms[name] = time_ms(step, device, iters, rounds)
            out.peak[name] = peak_bytes(step, device)
        except Exception as err:  # e.g. Liger on a device it does not support
            out.missing.append(f"{name} ({type(err).__name__}: {str(err)[:80]})")
    if case.bandwidth and out.ours in out.ms:
        out.bandwidth = 5 * x.numel() * x.element_size() / (out.ms[out.ours] * 1e-3)
    return out
