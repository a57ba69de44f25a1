"""The C++ kernels alone against ATen's: forward and backward apart, no module, no autograd.

``bench_norm.py`` times a module's forward+backward, which is the kernels plus what runs around
them (the op's Python, the autograd Function, allocations). This script times only the calls
that do the work, so that the two can be told apart: the operators ``mrs_norm_fwd`` and
``mrs_norm_bwd`` with their C++ CPU kernels (:mod:`lightning_mrs.ops.cpu_kernels`) against ``aten::native_layer_norm`` / ``native_group_norm`` and their backwards, which is what
``nn.LayerNorm`` and ``nn.GroupNorm`` run. Every row allocates its outputs, as the op does.
Rows are interleaved in one process, in a new random order each round.

Usage::

    python benchmarks/bench_cpu_kernels.py                     # bfloat16 and float16, every case
    python benchmarks/bench_cpu_kernels.py --cases spatial_64x64x32x32 --dtype bfloat16 --repeats 41
    python benchmarks/bench_cpu_kernels.py --cpu-kernels generic avx2  # a row per kernel set too
    python benchmarks/bench_cpu_kernels.py --threads 1 --clock cpu     # steadier on a loaded machine
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interleave import round_orders  # noqa: E402 - the sibling helper
from machine import check_kernel_sets, cpu_line  # noqa: E402

from lightning_mrs.ops import cpu_kernels  # noqa: E402
from lightning_mrs.ops import library  # noqa: E402

EPS = 1e-6
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: name -> (input shape, channel_dim, spatial, the ATen peer)
CASES = {
    "ln_8192x1024": ((8192, 1024), 1, False, "layer_norm"),
    "ln_2048x4096": ((2048, 4096), 1, False, "layer_norm"),
    "spatial_64x64x32x32": ((64, 64, 32, 32), 1, True, "group_norm"),
    # the norm of bench_lm_step.py's Llama (batch 16 x 128 tokens of width 128): short rows
    "lm_2048x128": ((2048, 128), 1, False, "layer_norm"),
}
Calls = dict[str, Callable[[], object]]


def ours(x: Tensor, g: Tensor, channel_dim: int, spatial: bool) -> Calls:
    """``{"fwd": ..., "bwd": ...}``: the operator pair on the CPU (its C++ kernels), as the op calls it."""
    w = torch.ones(x.shape[channel_dim] // 2, dtype=x.dtype)  # (P,): a module cast to the input's dtype
    _, r_sum = library.FWD(x, w, EPS, channel_dim, spatial)
    return {"fwd": lambda: library.FWD(x, w, EPS, channel_dim, spatial),
            "bwd": lambda: library.BWD(g, x, w, r_sum, EPS, channel_dim, spatial, True)}


def aten(x: Tensor, g: Tensor, peer: str) -> Calls:
    """The same two calls of ATen's norm (``nn.LayerNorm`` over the last dim, ``nn.GroupNorm(1, C)``)."""
    ops = torch.ops.aten
    channels = x.shape[-1] if peer == "layer_norm" else x.shape[1]
    w, b = torch.ones(channels, dtype=x.dtype), torch.zeros(channels, dtype=x.dtype)
    mask = [True, True, True]
    if peer == "layer_norm":
        _, mean, rstd = ops.native_layer_norm(x, [channels], w, b, EPS)
        return {"fwd": lambda: ops.native_layer_norm(x, [channels], w, b, EPS),
                "bwd": lambda: ops.native_layer_norm_backward(g, x, [channels], mean, rstd, w, b, mask)}
    n, hw = x.shape[0], x[0, 0].numel()
    _, mean, rstd = ops.native_group_norm(x, w, b, n, channels, hw, 1, EPS)
    return {"fwd": lambda: ops.native_group_norm(x, w, b, n, channels, hw, 1, EPS),
            "bwd": lambda: ops.native_group_norm_backward(g, x, mean, rstd, w, n, channels, hw, 1, mask)}


def run_case(name: str, dtype: torch.dtype, repeats: int, inner: int, kernel_sets: tuple[str, ...] = (),
             clock: Callable[[], float] = time.perf_counter) -> list[dict]:
    """One row per implementation and pass (``fwd``, ``bwd``, their sum ``f+b``): the median and the
    fastest round, in ms and against ATen's same pass."""
    shape, channel_dim, spatial, peer = CASES[name]
    torch.manual_seed(0)
    x, g = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    impls: dict[str, tuple[Calls, str | None]] = {"MRSNorm cpp": (ours(x, g, channel_dim, spatial), None),
                                                  f"aten {peer}": (aten(x, g, peer), None)}
    for ks in kernel_sets:
        with cpu_kernels.using(ks):
            impls[f"MRSNorm cpp [{ks}]"] = (ours(x, g, channel_dim, spatial), ks)
    rows = [(impl, p) for impl in impls for p in ("fwd", "bwd")]

    def call(row: tuple[str, str]) -> None:
        calls, ks = impls[row[0]]
        with nullcontext() if ks is None else cpu_kernels.using(ks):
            for _ in range(inner):
                calls[row[1]]()

    for row in rows:  # warm-up: the build, the allocator
        call(row)
    times: dict[tuple[str, str], list[float]] = {row: [] for row in rows}
    for order in round_orders(rows, repeats):
        for row in order:
            t0 = clock()
            call(row)
            times[row].append((clock() - t0) / inner)
    med = {row: statistics.median(t) for row, t in times.items()}
    best = {row: min(t) for row, t in times.items()}
    for impl in impls:  # "f+b": the sums of the two passes' medians and of their fastest rounds
        med[(impl, "f+b")] = med[(impl, "fwd")] + med[(impl, "bwd")]
        best[(impl, "f+b")] = best[(impl, "fwd")] + best[(impl, "bwd")]
    out = []
    for impl in impls:
        for p in ("fwd", "bwd", "f+b"):
            base = (f"aten {peer}", p)
            out.append({"case": name, "dtype": str(dtype).removeprefix("torch."), "impl": impl, "pass": p,
                        "ms": med[(impl, p)] * 1e3, "time_ratio": med[(impl, p)] / med[base],
                        "min_ms": best[(impl, p)] * 1e3, "min_time_ratio": best[(impl, p)] / best[base]})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float16"], choices=list(DTYPES))
    p.add_argument("--repeats", type=int, default=21, help="interleaved rounds (median)")
    p.add_argument("--inner", type=int, default=5, help="calls per timed round")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: time.perf_counter; cpu: process CPU time (best with --threads 1)")
    p.add_argument("--cpu-kernels", nargs="+", default=[], choices=cpu_kernels.KERNEL_SETS, metavar="SET",
                   help=f"also a row per C++ kernel set: {', '.join(cpu_kernels.KERNEL_SETS)}")
    p.add_argument("--json", default=None, help="write the raw figures to this file")
    args = p.parse_args(argv)
    if not cpu_kernels.available():
        p.error(f"the C++ kernels are not built here: {cpu_kernels.build_error()}")
    check_kernel_sets(p, args.cpu_kernels)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} clock, {args.repeats} "
          f"interleaved rounds x {args.inner} calls; 'x' = ratio of medians, 'min x' = of fastest rounds, "
          "both against ATen's same pass")
    print(cpu_line())
    hdr = f"{'case':20s} {'dtype':8s} {'impl':26s} {'pass':4s} {'median ms':>9s} {'x':>6s} {'min ms':>8s} {'min x':>6s}"
    print(hdr)
    print("-" * len(hdr))
    results = []
    for name in args.cases:
        for dt in args.dtype:
            rows = run_case(name, DTYPES[dt], args.repeats, args.inner, tuple(args.cpu_kernels), clock)
            results += rows
            for r in rows:
                print(f"{name:20s} {dt:8s} {r['impl']:26s} {r['pass']:4s} {r['ms']:9.3f} {r['time_ratio']:6.2f} "
                      f"{r['min_ms']:8.3f} {r['min_time_ratio']:6.2f}")
            sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": cpu_line(),
                       "clock": args.clock, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
