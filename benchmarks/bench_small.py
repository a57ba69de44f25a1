"""Time one call of MRSNorm on the small inputs of a language model, against torch's norms.

Rows: the default ``MRSNorm`` module, ``nn.LayerNorm`` (the ratios' denominator),
``nn.RMSNorm`` and transformers' ``LlamaRMSNorm`` (if transformers is installed), each in
inference (``torch.inference_mode``, one token when decoding) and forward+backward. All
rows of a case are interleaved in one process, in a random order each round (``interleave.py``); the figure of a round is
the mean of ``--inner`` calls; the table gives the median and the fastest round.

``--profile`` also times the stages of one call (the router, the operator) beside
``backend="cpp"`` and the fallback pair, on ``(1, 1, 2048)`` in inference.

Usage::

    python benchmarks/bench_small.py                 # the table, 1 thread
    python benchmarks/bench_small.py --quick         # seconds
    python benchmarks/bench_small.py --profile       # and the stages of one call
    python benchmarks/bench_small.py --clock cpu     # process CPU time: steadier on a shared machine
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interleave import round_orders  # noqa: E402 - the sibling helper
from machine import cpu_line  # noqa: E402

from lightning_mrs import MRSNorm  # noqa: E402

CASES = [  # (shape, mode)
    ((1, 1, 2048), "inference"),
    ((1, 1, 4096), "inference"),
    ((1, 1, 2048), "fwd+bwd"),
    ((8, 64), "fwd+bwd"),
    ((4096, 128), "fwd+bwd"),
]


def norms(c: int) -> dict[str, nn.Module]:
    out = {"MRSNorm": MRSNorm(c), "nn.LayerNorm": nn.LayerNorm(c), "nn.RMSNorm": nn.RMSNorm(c)}
    try:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        out["LlamaRMSNorm"] = LlamaRMSNorm(c)
    except ImportError:  # pragma: no cover - transformers is the [hf] extra
        pass
    return out


CLOCK: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = [time.perf_counter]  # --clock: the timer of every round


def _per_call(fn: Callable[[], object], inner: int) -> float:
    clock = _clock[0]
    t0 = clock()
    for _ in range(inner):
        fn()
    return (clock() - t0) / inner


def run_case(shape: tuple[int, ...], mode: str, repeats: int, inner: int) -> dict[str, list[float]]:
    torch.manual_seed(0)
    mods = norms(shape[-1])
    x = torch.randn(shape, requires_grad=mode != "inference")
    gy = torch.randn(shape)

    def call(m: nn.Module) -> Callable[[], object]:
        if mode == "inference":
            return lambda: m(x)
        return lambda: m(x).backward(gy)

    ctx = torch.inference_mode() if mode == "inference" else torch.enable_grad()
    with ctx:
        fns = {k: call(m) for k, m in mods.items()}
        for fn in fns.values():  # warm-up
            _per_call(fn, inner)
        times: dict[str, list[float]] = {k: [] for k in fns}
        for order in round_orders(list(fns), repeats):  # a random order each round
            for k in order:
                times[k].append(_per_call(fns[k], inner))
    return times


def profile(inner: int) -> list[tuple[str, float]]:
    """Microseconds of the stages of one inference call on (1, 1, 2048), fastest of 7 rounds."""
    from lightning_mrs.ops import dispatch, library
    from lightning_mrs.ops.mrs_norm import normalize

    c = 2048
    m = MRSNorm(c)
    x = torch.randn(1, 1, c)
    w = m.weight.detach()
    idle = nn.Identity()
    stages: dict[str, Callable[[], object]] = {
        "module call, fast path (total)": lambda: m(x),
        "nn.LayerNorm module call (total)": (lambda ln=nn.LayerNorm(c): ln(x)),
        "  an empty nn.Module call": lambda: idle(x),
        "  module.weight (nn.Module __getattr__)": lambda: m.weight,
        "  normalize (the router: lookup + operator)": lambda: normalize(x, w, 1e-6, -1, False, "auto", "mrs_norm"),
        "    the route lookup (key, dict)": lambda: dispatch.ROUTES.get(dispatch.key_of(x, w, 1e-6, -1, False, "auto")),
        "    mrs_norm_fwd (dispatcher, C++ kernel, allocs)": lambda: library.FWD(x, w, 1e-6, 2, False),
        "    torch.empty_like (the output)": lambda: torch.empty_like(x),
        "  a route miss (checks, layout, backend choice)": lambda: dispatch._build(x, w, 1e-6, -1, False, "auto",
                                                                                  "mrs_norm"),
        "backend='cpp' (total)": lambda: normalize(x, w, 1e-6, -1, False, "cpp", "mrs_norm"),
        "backend='torch', the fallback pair (total)": lambda: normalize(x, w, 1e-6, -1, False, "torch", "mrs_norm"),
    }
    out = []
    with torch.inference_mode():
        for name, fn in stages.items():
            _per_call(fn, inner)
            out.append((name, min(_per_call(fn, inner) for _ in range(7)) * 1e6))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=15, help="interleaved rounds (median)")
    p.add_argument("--inner", type=int, default=200, help="calls per timed round")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--quick", action="store_true", help="5 rounds x 50 calls")
    p.add_argument("--profile", action="store_true", help="also time the stages of one call")
    p.add_argument("--clock", choices=tuple(CLOCK), default="wall",
                   help="wall: time.perf_counter; cpu: process CPU time, steadier on a shared machine (1 thread)")
    args = p.parse_args(argv)
    _clock[0] = CLOCK[args.clock]
    if args.quick:
        args.repeats, args.inner = 5, 50
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.clock} clock; median of {args.repeats} interleaved "
          f"rounds x {args.inner} calls (us per call); 'x LN' = ratio of medians to nn.LayerNorm "
          f"(in brackets: of the fastest rounds)")
    print(cpu_line())
    names = list(norms(2))
    print(f"{'input':14s} {'mode':10s} " + " ".join(f"{n:>22s}" for n in names))
    for shape, mode in CASES:
        times = run_case(shape, mode, args.repeats, args.inner)
        med = {k: statistics.median(v) for k, v in times.items()}
        best = {k: min(v) for k, v in times.items()}
        ln_med, ln_best = med["nn.LayerNorm"], best["nn.LayerNorm"]
        cells = [f"{med[n] * 1e6:7.1f} x{med[n] / ln_med:4.2f} ({best[n] / ln_best:4.2f})" for n in names]
        print(f"{str(shape):14s} {mode:10s} " + " ".join(f"{c:>22s}" for c in cells), flush=True)
    if args.profile:
        print("\nOne inference call on (1, 1, 2048), fastest of 7 rounds (us):")
        for name, us in profile(max(args.inner, 1000)):
            print(f"  {name:48s} {us:7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
