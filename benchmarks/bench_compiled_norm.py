"""Per-call time of one norm under ``torch.compile`` on the CPU: MRSNorm against the norms Inductor
compiles itself.

Every row is a module compiled with ``fullgraph=True, dynamic=False`` and timed interleaved with
the others in one process (``interleave.round_orders``), so machine noise hits them alike:

==================================  ============================================================
row                                 what the compiled graph calls
==================================  ============================================================
``MRSNorm compiled``                the operator pair, its C++ CPU kernels (``lightning_mrs.ops.library``)
``MRSNorm compiled, Python ops``    the fallback pair asked for ``cpp``: a Python body around the
                                    same operators (:class:`PythonOpsMRSNorm`)
``nn.RMSNorm compiled``             Inductor's own fused kernel: the ratio's denominator
``LlamaRMSNorm compiled``           the same, for transformers' norm (when it is installed)
==================================  ============================================================

Modes: ``inference`` (a forward under ``torch.no_grad``) and ``train`` (a forward and the
backward of the input and the weight). Shapes: ``lm_2048x128`` (a norm of
``bench_lm_step.py``'s Llama, batch 16) and ``decode_1x128`` (one token: where a call's fixed
cost is all there is). The ``ops`` column names the ``lightning_mrs`` operators each row's graph
called (checked with a dispatch mode on one call), so a row cannot measure the wrong path.

Usage::

    python benchmarks/bench_compiled_norm.py
    python benchmarks/bench_compiled_norm.py --threads 1 --rounds 21 --dtype float32 bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interleave import time_steps  # noqa: E402 - the sibling helper
from machine import cpu_line  # noqa: E402

from lightning_mrs import MRSNorm  # noqa: E402
from lightning_mrs.ops.library import MRSNormFunction  # noqa: E402

SHAPES = {"lm_2048x128": (2048, 128), "decode_1x128": (1, 128)}
MODES = ("inference", "train")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DENOMINATOR = "nn.RMSNorm compiled"


class PythonOpsMRSNorm(MRSNorm):
    """MRSNorm whose graphs call the fallback pair with ``backend="cpp"``: its Python body runs the
    same C++ operators, so the row measures what a Python operator body costs (and its own class:
    Dynamo reuses a graph traced for a module of the same class and shapes)."""

    def forward(self, x: Tensor) -> Tensor:
        return MRSNormFunction.apply(x, self.weight, self.eps, x.ndim - 1, False, "cpp")


def rows(width: int) -> dict[str, Callable[[], nn.Module]]:
    """Row name -> module factory."""
    out: dict[str, Callable[[], nn.Module]] = {
        "MRSNorm compiled": lambda: MRSNorm(width),
        "MRSNorm compiled, Python ops": lambda: PythonOpsMRSNorm(width),
        DENOMINATOR: lambda: nn.RMSNorm(width),
    }
    try:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
    except ImportError:
        return out
    out["LlamaRMSNorm compiled"] = lambda: LlamaRMSNorm(width)
    return out


def lightning_ops(call: Callable[[], None]) -> list[str]:
    """The ``lightning_mrs`` operators one ``call()`` runs (by the profiler: a dispatch mode would
    make the compiled function trace again)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        call()
    return sorted({e.name.split("::")[1] for e in prof.events() if e.name.startswith("lightning_mrs::")})


class Case:
    """One compiled module, its input and the call that is timed."""

    def __init__(self, factory: Callable[[], nn.Module], x: Tensor, train: bool) -> None:
        self.module = factory().to(x.dtype)
        self.fn = torch.compile(self.module, fullgraph=True, dynamic=False)
        self.train = train
        self.x = x.detach().requires_grad_(train)
        self.gy = torch.randn_like(x)
        self()  # traced and compiled here
        self.ops = lightning_ops(self)

    def __call__(self) -> None:
        if not self.train:
            with torch.no_grad():
                self.fn(self.x)
            return
        self.fn(self.x).backward(self.gy)
        self.x.grad = None
        self.module.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--dtype", nargs="+", default=["float32"], choices=list(DTYPES))
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds (median)")
    p.add_argument("--calls", type=int, default=None,
                   help="calls per row and round (default: 20 on lm_2048x128, 200 on decode_1x128)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--quick", action="store_true", help="3 rounds of 5 calls")
    p.add_argument("--json", default=None, help="write the raw figures to this file")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.calls = 3, 5
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"One norm under torch.compile (fullgraph, dynamic=False); torch {torch.__version__}; "
          f"median of {args.rounds} interleaved rounds")
    print(cpu_line())
    report: dict[str, dict] = {}
    for shape_name in args.shapes:
        shape = SHAPES[shape_name]
        calls = args.calls or (20 if shape[0] > 1 else 200)
        for dtype_name in args.dtype:
            x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(DTYPES[dtype_name])
            for mode in args.modes:
                # each case compiles its module's forward once per group: without a reset, a third
                # dtype or shape ran past Dynamo's recompile limit (8) and stopped the benchmark
                torch._dynamo.reset()
                cases = {name: Case(f, x, mode == "train") for name, f in rows(shape[-1]).items()}
                times = time_steps(lambda n: cases[n](), list(cases), args.rounds, calls)
                med = {n: statistics.median(t) for n, t in times.items()}
                fast = {n: min(t) for n, t in times.items()}
                key = f"{shape_name} {dtype_name} {mode}"
                print(f"\n{key} ({calls} calls a round)")
                print(f"{'row':30s} {'median us':>10s} {'x ' + DENOMINATOR:>22s} {'min us':>8s} {'min x':>7s}  ops")
                for n, case in cases.items():
                    print(f"{n:30s} {med[n] * 1e6:10.1f} {med[n] / med[DENOMINATOR]:22.3f} {fast[n] * 1e6:8.1f} "
                          f"{fast[n] / fast[DENOMINATOR]:7.3f}  {', '.join(case.ops) or '-'}")
                report[key] = {"median_s": med, "min_s": fast, "all_s": times,
                               "ops": {n: c.ops for n, c in cases.items()}}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
