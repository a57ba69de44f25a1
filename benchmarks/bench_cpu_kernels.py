"""The C++ kernels alone against ATen's: forward and backward apart, no module, no autograd.

``bench_norm.py`` times a module's forward+backward, which is the kernels plus what runs around
them (the op's Python, the autograd Function, allocations). This script times only the calls
that do the work, so that the two can be told apart: our ``cpp`` backend's ``forward`` and
``backward`` (:mod:`lightning_mrs.ops.cpu_kernels`, on the canonical 3-d view the op hands them)
against ``aten::native_layer_norm`` / ``native_group_norm`` and their backwards, which is what
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
from lightning_mrs.ops.layout import Layout  # noqa: E402

EPS = 1e-6
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: name -> (input shape, the canonical 3-d view, its layout, the ATen peer)
CASES = {
    "ln_8192x1024": ((8192, 1024), (8192, 1, 1024), Layout(last=True, spatial=False), "layer_norm"),
    "ln_2048x4096": ((2048, 4096), (2048, 1, 4096), Layout(last=True, spatial=False), "layer_norm"),
    "spatial_64x64x32x32": ((64, 64, 32, 32), (64, 64, 1024), Layout(last=False, spatial=True), "group_norm"),
    # the norm of bench_lm_step.py's Llama (batch 16 x 128 tokens of width 128): short rows
    "lm_2048x128": ((2048, 128), (2048, 1, 128), Layout(last=True, spatial=False), "layer_norm"),
}
Calls = dict[str, Callable[[], object]]


def ours(x: Tensor, g: Tensor, view3: tuple[int, int, int], layout: Layout) -> Calls:
    """``{"fwd": ..., "bwd": ...}``: the cpp backend's two kernels, as the op calls them."""
    x3, g3 = x.view(view3), g.view(view3)
    channels = view3[2] if layout.last else view3[1]
    w = torch.ones(channels // 2, dtype=x.dtype)  # (P,): a module cast to the input's dtype
    _, r_sum = cpu_kernels.forward(x3, w, EPS, layout)
    return {"fwd": lambda: cpu_kernels.forward(x3, w, EPS, layout),
            "bwd": lambda: cpu_kernels.backward(x3, w, r_sum, g3, EPS, layout)}


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
    shape, view3, layout, peer = CASES[name]
    torch.manual_seed(0)
    x, g = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    impls: dict[str, tuple[Calls, str | None]] = {"MRSNorm cpp": (ours(x, g, view3, layout), None),
                                                  f"aten {peer}": (aten(x, g, peer), None)}
    for ks in kernel_sets:
        with cpu_kernels.using(ks):
            impls[f"MRSNorm cpp [{ks}]"] = (ours(x, g, view3, layout), ks)
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
