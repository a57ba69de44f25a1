"""Forward+backward time and saved-activation memory of MRSNorm against native norms.

Every case times, interleaved in one process (so machine noise hits all rows alike), the
default ``MRSNorm``/``MRSNorm2d`` module (on the CPU: the hand-written ``cpp`` kernels where
they cover the layout), its native counterpart (the ratio's denominator) and peers: the
Inductor-compiled MRS kernels, the eager MRS formula, the module under ``torch.compile`` (the
custom op: our kernels) and the formula under ``torch.compile`` (Inductor's own code for it),
``F.rms_norm`` eager and compiled. Saved memory is the sum
of the unique storages packed by ``torch.autograd.graph.saved_tensors_hooks`` for one
forward.

Usage::

    python benchmarks/bench_norm.py                 # the table
    python benchmarks/bench_norm.py --json out.json # also the raw figures
    python benchmarks/bench_norm.py --repeats 21 --inner 5 --cases ln_8192x1024
    python benchmarks/bench_norm.py --threads 1 --clock cpu  # steadier on a loaded machine
    python benchmarks/bench_norm.py --dtype float32 bfloat16 float16  # one table, every dtype
    python benchmarks/bench_norm.py --quick --dtype all              # a few minutes
    python benchmarks/bench_norm.py --malloc keep  # freed memory reused: no page faults
    python benchmarks/bench_norm.py --cpu-kernels avx2 generic  # both C++ kernel sets, one row each

``--cpu-kernels`` adds, to every case, a row of the default module for each named kernel set
of the C++ kernels (``lightning_mrs.ops.cpu_kernels.KERNEL_SETS``: ``avx2`` = ``cpu_avx2.h``,
``generic`` = the compiler-vectorised loops), interleaved with the rest: on an AVX-512 CPU,
where ``auto`` builds the generic loops, it measures whether the AVX2 kernels would be faster.

Page faults: every call allocates its outputs (``y``, then ``dx``), tens of MiB here. glibc's
malloc hands such blocks back to the OS when they are freed (``mmap`` above its threshold,
trimming of the heap's top), and the next call's first write to each 4 KiB page is a fault
of about 1.5 us: 16,384 of them per call on (2048, 4096) float32, 20 ms against a 4 ms
kernel. How many a call pays depends on the heap's history, not on the norm, so the
``faults`` column (minor page faults per call, ``getrusage``) is printed beside the times;
``--malloc keep`` sets glibc's ``mallopt`` so that freed memory stays mapped and is reused
(what jemalloc or tcmalloc, PyTorch's advice for CPU training, do), which leaves the
kernels' own time.

Every module (ours and the natives) is cast to the input's dtype (``model.to(dtype)``), as
a half-precision model is; MRSNorm computes half inputs in float32 inside.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import resource
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interleave import round_orders  # noqa: E402 - the sibling helper
from machine import check_kernel_sets, cpu_line  # noqa: E402

from lightning_mrs import MRSNorm, MRSNorm2d  # noqa: E402
from lightning_mrs.ops import cpu_kernels  # noqa: E402

try:  # timm is a project dependency; keep the script usable without it
    from timm.layers import LayerNorm2d
except ImportError:  # pragma: no cover
    LayerNorm2d = None


def saved_bytes(module: nn.Module, x: Tensor) -> int:
    """Bytes of the unique storages saved for backward by one forward of ``module``."""
    storages: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x.detach().requires_grad_())
    return sum(storages.values())


def _step(module: nn.Module, x: Tensor, gy: Tensor, kernel_set: str | None = None) -> None:
    x.grad = None
    with nullcontext() if kernel_set is None else cpu_kernels.using(kernel_set):  # forward and backward
        module(x).backward(gy)


def _time(fn: Callable[[], None], inner: int, clock: Callable[[], float] = time.perf_counter) -> tuple[float, int]:
    """Seconds per call and the minor page faults of the ``inner`` calls."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = clock()
    for _ in range(inner):
        fn()
    return (clock() - t0) / inner, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory() -> None:
    """Make glibc's malloc keep freed blocks mapped for reuse (no ``mmap`` for large blocks,
    no trimming), so that the outputs of one call reuse the pages of the last one."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    except (OSError, AttributeError):
        ok = False
    if not ok:
        raise SystemExit("bench_norm: --malloc keep needs glibc's mallopt (Linux with glibc); "
                         "use --malloc system here")


class _Compiled(nn.Module):
    def __init__(self, m: nn.Module) -> None:
        super().__init__()
        self.m = m
        self.fn = torch.compile(m, dynamic=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.fn(x)


def cases() -> dict[str, tuple[tuple[int, ...], dict[str, Callable[[], nn.Module]], str]]:
    """name -> (input shape, {row name: module factory}, name of the denominator row)."""
    out = {}
    for m, c in ((8192, 1024), (2048, 4096)):
        out[f"ln_{m}x{c}"] = (
            (m, c),
            {
                "MRSNorm (default)": lambda c=c: MRSNorm(c),
                "nn.LayerNorm": lambda c=c: nn.LayerNorm(c),
                "MRSNorm inductor": lambda c=c: _backend(MRSNorm(c), "inductor"),
                "MRSNorm eager formula": lambda c=c: _backend(MRSNorm(c), "eager"),
                "MRSNorm compiled": lambda c=c: _Compiled(MRSNorm(c)),  # the custom op: our kernels
                "MRSNorm formula compiled": lambda c=c: _Compiled(_backend(MRSNorm(c), "eager")),  # Inductor's code
                "F.rms_norm eager": lambda c=c: nn.RMSNorm(c),
                "F.rms_norm compiled": lambda c=c: _Compiled(nn.RMSNorm(c)),
            },
            "nn.LayerNorm",
        )
    shape = (64, 64, 32, 32)
    if LayerNorm2d is not None:
        out["pos_64x64x32x32"] = (
            shape,
            {
                "MRSNorm2d (default)": lambda: MRSNorm2d(64),
                "timm LayerNorm2d": lambda: LayerNorm2d(64),
                "MRSNorm2d eager formula": lambda: _backend(MRSNorm2d(64), "eager"),
            },
            "timm LayerNorm2d",
        )
    out["spatial_64x64x32x32"] = (
        shape,
        {
            "MRSNorm2d spatial (default)": lambda: MRSNorm2d(64, spatial=True),
            "nn.GroupNorm(1, C)": lambda: nn.GroupNorm(1, 64),
            "MRSNorm2d spatial inductor": lambda: _backend(MRSNorm2d(64, spatial=True), "inductor"),
            "MRSNorm2d spatial compiled": lambda: _Compiled(MRSNorm2d(64, spatial=True)),
            "MRSNorm2d spatial eager formula": lambda: _backend(MRSNorm2d(64, spatial=True), "eager"),
        },
        "nn.GroupNorm(1, C)",
    )
    return out


def _backend(m: nn.Module, backend: str) -> nn.Module:
    m.backend = backend
    return m


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def run_case(
    name: str, shape, factories, base: str, repeats: int, inner: int,
    clock: Callable[[], float] = time.perf_counter, dtype: torch.dtype = torch.float32,
    kernel_sets: tuple[str, ...] = (),
) -> dict:
    torch.manual_seed(0)
    x = torch.randn(shape).to(dtype).requires_grad_()
    gy = torch.randn(shape).to(dtype)
    mods = {k: f().to(dtype) for k, f in factories.items()}
    sets: dict[str, str | None] = dict.fromkeys(mods)  # row -> the C++ kernel set it runs (None: the default)
    default = next(k for k in factories if "(default)" in k)
    for ks in kernel_sets:  # the default module again, on each named kernel set
        mods[f"{default} [{ks}]"] = factories[default]().to(dtype)
        sets[f"{default} [{ks}]"] = ks
    for k, m in mods.items():  # warm-up: compiles, allocator, caches
        for _ in range(3):
            _step(m, x, gy, sets[k])
    times: dict[str, list[float]] = {k: [] for k in mods}
    faults = dict.fromkeys(mods, 0)
    for order in round_orders(list(mods), repeats):  # interleaved: every row sees the same machine state
        for k in order:  # a random order each round: no row always follows the same one
            seconds, n_faults = _time(lambda m=mods[k], ks=sets[k]: _step(m, x, gy, ks), inner, clock)
            times[k].append(seconds)
            faults[k] += n_faults
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}  # robust to other loads on a busy machine
    mem = {k: saved_bytes(m, x) for k, m in mods.items()}
    rows = []
    for k in mods:
        rows.append(
            {
                "impl": k,
                "ms": med[k] * 1e3,
                "time_ratio": med[k] / med[base],
                "min_ms": best[k] * 1e3,
                "min_time_ratio": best[k] / best[base],
                "faults_per_call": faults[k] / (repeats * inner),
                "saved_MiB": mem[k] / 2**20,
                "mem_ratio": mem[k] / mem[base],
            }
        )
    return {"case": name, "shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "baseline": base,
            "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=15, help="interleaved rounds (median)")
    p.add_argument("--inner", type=int, default=3, help="fwd+bwd calls per timed round")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--cases", nargs="*", default=None, help="subset of case names")
    p.add_argument("--json", default=None, help="write the raw figures to this file")
    p.add_argument("--dtype", nargs="+", default=["float32"], choices=[*DTYPES, "all"],
                   help="input (and module) dtypes, one block of rows each; 'all' = all three")
    p.add_argument("--quick", action="store_true", help="5 rounds x 1 call: a few minutes for every case")
    p.add_argument(
        "--clock", choices=("wall", "cpu"), default="wall",
        help="wall: time.perf_counter; cpu: process CPU time (time.process_time), steadier "
        "on a loaded machine, best with --threads 1 (idle OpenMP threads spin and count)",
    )
    p.add_argument(
        "--malloc", choices=("system", "keep"), default="system",
        help="system: glibc's defaults (large freed blocks go back to the OS; the next call "
        "page-faults on them); keep: mallopt so that freed memory is reused (see the module "
        "docstring)",
    )
    p.add_argument("--cpu-kernels", nargs="+", default=[], choices=cpu_kernels.KERNEL_SETS, metavar="SET",
                   help="also time the default module on these C++ kernel sets (one row each): "
                   f"{', '.join(cpu_kernels.KERNEL_SETS)}")
    args = p.parse_args(argv)
    check_kernel_sets(p, args.cpu_kernels)
    if args.malloc == "keep":
        keep_freed_memory()
    if args.quick:
        args.repeats, args.inner = 5, 1
    dtypes = list(DTYPES) if "all" in args.dtype else list(dict.fromkeys(args.dtype))
    if args.threads:
        torch.set_num_threads(args.threads)
    all_cases = cases()
    names = args.cases or list(all_cases)
    unknown = [n for n in names if n not in all_cases]
    if unknown:
        p.error(f"unknown case(s) {unknown}; choose from {list(all_cases)}")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} clock, "
          f"malloc {args.malloc}, {args.repeats} "
          f"interleaved rounds x {args.inner} fwd+bwd calls; 'time x' = ratio of medians, "
          f"'min x' = ratio of fastest rounds; both against each case's native counterpart")
    print(cpu_line())  # the model, the ISA flags the kernels use, threads, how the kernels were built
    results = []
    hdr = (f"{'case':20s} {'dtype':8s} {'impl':32s} {'median ms':>9s} {'time x':>6s} {'min ms':>8s} "
           f"{'min x':>6s} {'faults':>7s} {'saved MiB':>9s} {'mem x':>6s}")
    print(hdr)
    print("-" * len(hdr))
    for n, dt in [(n, dt) for n in names for dt in dtypes]:
        res = run_case(n, *all_cases[n], args.repeats, args.inner, clock, DTYPES[dt], tuple(args.cpu_kernels))
        results.append(res)
        for r in res["rows"]:
            print(f"{n:20s} {dt:8s} {r['impl']:32s} {r['ms']:9.2f} {r['time_ratio']:6.2f} "
                  f"{r['min_ms']:8.2f} {r['min_time_ratio']:6.2f} {r['faults_per_call']:7.0f} "
                  f"{r['saved_MiB']:9.1f} {r['mem_ratio']:6.2f}")
        sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": cpu_line(),
                       "clock": args.clock, "malloc": args.malloc,
                       "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
