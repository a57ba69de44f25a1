"""Everything that needs a GPU, in one command sized to fit a 15-minute lease twice.

**The core** (at most :data:`CORE_LIMIT_S` by its estimate; the measured time is printed beside
it), in this order:

* ``speed``: a device copy (the practical peak), then per token shape and dtype our Triton
  kernels and the ``MRSNorm`` module beside Liger-Kernel's RMSNorm and torch's ``nn.RMSNorm``,
  forward and backward apart (GB/s, share of the copy, ratios), the QK-norm rows, and the
  decode rows (one token; with and without CUDA graphs) (``gpu_check_speed.py``);
* ``ops``: the Triton op in float32/bfloat16/float16, every layout against a float64 reference
  (``gpu_check_ops.py``);
* ``recipes``: one step of ``recipes/cifar100.py`` (``16-mixed``) and of ``recipes/lm.py``
  (``bf16-mixed``), monitors on (``gpu_check_recipes.py``).

**``--extended``** (only after a core without a ``FAIL`` row, as far as ``--budget`` allows):
the ``auto`` and ``eager`` ops, the half-precision gradient to one ulp, ``torch.compile``,
longer recipe runs (the compiled LM, with 2 GPUs DDP and FSDP2) and ``pytest -m cuda``.

On a bare machine it installs nothing: its first lines (within seconds: no import of triton,
Liger or Lightning before them) say what is missing, one line each (triton, liger-kernel, a
CUDA capability), and the checks that need it are ``SKIP`` rows that say so; the rest run. The
in-process checks run in a worker subprocess (an illegal memory access poisons a CUDA context:
it costs one ``FAIL`` row and a fresh worker goes on); the recipes and pytest are subprocesses
of their own. After every row ``results.json`` and ``results.md`` in ``--out`` are rewritten
atomically (``gpu_check_results.py``), so a run cut off leaves the rows it finished. Exit
status: 1 if a check failed, 0 otherwise; 2 without CUDA.

Usage::

    python benchmarks/gpu_check.py --dry-run                        # the plan and its estimates
    python benchmarks/gpu_check.py --out gpu_check_out              # the core (<= 240 s)
    python benchmarks/gpu_check.py --out gpu_check_out --extended   # then the rest, within --budget
    python benchmarks/gpu_check.py --device cpu --match QK          # the harness itself, on the CPU
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import re
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check_results as results  # noqa: E402
from gpu_check_recipes import (ALL_FLAGS, kill_active, last_error, pytest_check, recipe_check,  # noqa: E402
                               recipe_command)
from gpu_check_recipes import run_command as _run_command  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CORE_LIMIT_S = 240.0  # the core's estimate must stay under it: two runs fit a lease
BUDGET_S = 450.0  # the default --budget: the whole run, core and --extended
WORKER_START_S = 20.0  # a worker's start: torch, triton, lightning_mrs, the CUDA context
CPU_SLACK = 6.0  # the CPU self-test's commands take this many times a GPU's estimate (timeouts only)
CRASH_ENV = "GPU_CHECK_SELFTEST_CRASH"  # a check's "group/name": it kills its worker (the self-test)
RESTART = 75  # a worker's exit status after a CUDA error (a poisoned context): the rest in a fresh one
Result = tuple[str, str, dict]  # (status, result text, figures)


@dataclass
class Check:
    """One row: ``run(ctx)`` returns ``(status, result, figures)``; ``seconds``: the estimate
    on one GPU (a first call compiles: Triton ~1 s a kernel variant, Inductor more)."""

    group: str
    name: str
    seconds: float
    run: Callable[["Context"], Result]
    gpus: int = 1
    extended: bool = False  # only with --extended
    command: Optional[list[str]] = None  # a subprocess check (runs in the parent, no worker)
    needs: tuple[str, ...] = ()  # keys of preflight(): a check whose need is missing is a SKIP row


@dataclass
class Context:
    device: str
    gpus: int
    scale: int  # the speed cases' rows are divided by it (the CPU self-test)
    out: Path  # the output folder (the recipes' runs go under it too)
    copy_bw: Optional[float] = None


# --- the checks ---------------------------------------------------------------------------------
def _copy_check(ctx: Context) -> Result:
    import gpu_check_speed as speed

    ctx.copy_bw = speed.copy_bandwidth(ctx.device, nbytes=(1 << 28) // ctx.scale)
    text = f"device copy {ctx.copy_bw / 1e9:.3g} GB/s ({256 / ctx.scale:g} MiB)"
    return "INFO", text, {"copy_gbs": ctx.copy_bw / 1e9}


def _speed_check(index: int) -> Callable[[Context], Result]:
    def run(ctx: Context) -> Result:
        import gpu_check_speed as speed

        if ctx.copy_bw is None:  # a restarted worker: measure the copy again
            _copy_check(ctx)
        row = speed.run_case(speed.CASES[index], ctx.device, ctx.copy_bw, ctx.scale)
        figures = row.figures()
        # faster than a copy: a wrong timing (on a GPU; the CPU's small copy is noise beside it)
        too_fast = [k for k in ("fwd_copy", "bwd_copy") if (figures[k] or 0) > 1.05 and ctx.device.startswith("cuda")]
        text = row.summary() + "".join(f"; {k} above 105 %: a wrong timing" for k in too_fast)
        return ("FAIL" if too_fast else "INFO"), text, figures
    return run


def _decode_check(channels: int) -> Callable[[Context], Result]:
    def run(ctx: Context) -> Result:
        import gpu_check_speed as speed

        t, notes = speed.decode_case(channels, ctx.device)
        text = f"per call: MRSNorm {t['mrs_ms'] * 1e3:.1f} us, nn.RMSNorm {t['rms_ms'] * 1e3:.1f} us"
        if t["mrs_graph_ms"] is not None and t["rms_graph_ms"] is not None:
            text += (f"; in a CUDA graph: MRSNorm {t['mrs_graph_ms'] * 1e3:.2f} us, "
                     f"nn.RMSNorm {t['rms_graph_ms'] * 1e3:.2f} us")
        failed = ctx.device.startswith("cuda") and t["mrs_graph_ms"] is None  # ours not capturable
        figures = {"fwd_vs_torch": t["rms_ms"] / t["mrs_ms"], **t}
        return ("FAIL" if failed else "INFO"), "; ".join([text, *notes]), figures
    return run


def _ops_check(backend: str, dtype: torch.dtype, compiled: bool = False) -> Callable[[Context], Result]:
    def run(ctx: Context) -> Result:
        import gpu_check_ops as ops

        def expected_refusal(layout: str) -> bool:
            # the Triton kernels compute one S per position; on the CPU (the self-test) a forced
            # kernel may refuse any layout it does not cover, with its reason
            return (backend == "triton" and ops.LAYOUTS[layout][2]) or (ctx.device == "cpu" and backend != "auto")

        layouts = ["tokens", "nchw_per_sample", "nhwc_per_position"] if compiled else list(ops.LAYOUTS)
        outcome = ops.check_backend_dtype(backend, dtype, ctx.device, expected_refusal, layouts, compiled)
        return outcome.row(len(layouts))
    return run


def _half_check(dtype: torch.dtype) -> Callable[[Context], Result]:
    def run(ctx: Context) -> Result:
        import gpu_check_ops as ops

        errors = {layout: ops.half_gradient_error("auto", layout, dtype, ctx.device) for layout in ops.HALF_LAYOUTS}
        worst = max(errors, key=errors.get)
        bad = [f"{k}: {v:.2f} ulp" for k, v in errors.items() if not v <= 1.0]
        text = f"{len(errors) - len(bad)}/{len(errors)} layouts within one ulp (worst {worst}: {errors[worst]:.2f})"
        return ("FAIL" if bad else "PASS"), text + ("; FAILED " + ", ".join(bad) if bad else ""), {"ulps": errors}
    return run


def checks(ctx: Context) -> list[Check]:
    """Every check, in the order they run: the core, then the ``extended`` ones."""
    import gpu_check_speed as speed

    cuda = ctx.device.startswith("cuda")

    def needs(*keys: str, dtype: str = "") -> tuple[str, ...]:  # on the CPU (the self-test) nothing is missing
        return (tuple(keys) + (("bf16",) if dtype == "bfloat16" else ())) if cuda else ()

    out = [Check("speed", "device copy", 3, _copy_check, needs=needs("triton"))]
    out += [Check("speed", f"{c.name} {c.dtype}", 6, _speed_check(i), needs=needs("triton", dtype=c.dtype))
            for i, c in enumerate(speed.CASES)]
    out += [Check("speed", f"decode 1x{c} bfloat16", 3, _decode_check(c), needs=needs(dtype="bfloat16"))
            for c in speed.DECODE_WIDTHS]
    kernel = "triton" if cuda else "cpp"  # the hand-written kernels of the device
    out += [Check("ops", f"{kernel} {name}", 25, _ops_check(kernel, dtype), needs=needs(kernel, dtype=name))
            for name, dtype in DTYPES.items()]
    out += [Check("ops", f"{backend} bfloat16", seconds, _ops_check(backend, torch.bfloat16), extended=True,
                  needs=needs(dtype="bfloat16")) for backend, seconds in (("auto", 30), ("eager", 5))]
    out += [Check("ops", f"half gradient to one ulp {name}", 10, _half_check(DTYPES[name]), extended=True,
                  needs=needs(dtype=name)) for name in ("bfloat16", "float16")]
    out.append(Check("ops", "torch.compile bfloat16", 15, _ops_check("auto", torch.bfloat16, compiled=True),
                     extended=True, needs=needs("triton", dtype="bfloat16")))
    slack = 1.0 if cuda else CPU_SLACK
    cifar, lm = "recipes/cifar100.py", "recipes/lm.py"
    recipes = [  # group, seconds, script, precision, devices, strategy, compiled, steps, extended
        ("recipes", 30, cifar, "16-mixed", 1, None, False, 1, False),
        ("recipes", 30, lm, "bf16-mixed", 1, None, False, 1, False),
        ("recipes", 35, cifar, "bf16-mixed", 1, None, False, 6, True),
        ("recipes", 90, lm, "bf16-mixed", 1, None, True, 6, True),
        ("multi-gpu", 60, cifar, "bf16-mixed", 2, "ddp", False, 6, True),
        ("multi-gpu", 60, lm, "bf16-mixed", 2, "ddp", False, 6, True),
        ("multi-gpu", 60, lm, "bf16-mixed", 2, "fsdp2", False, 6, True),
    ]
    for group, seconds, script, precision, devices, strategy, compiled, steps, extended in recipes:
        cmd, _ = recipe_command(script, precision, ctx.device, devices, strategy, ctx.out / "runs",
                                ALL_FLAGS, compiled, steps)
        name = (f"{script} {precision}{' compiled' if compiled else ''}"
                f"{f' {strategy.upper()} x{devices}' if strategy else ''}, {steps} step{'s' * (steps > 1)}")
        out.append(Check(group, name, seconds, recipe_check(cmd, 2 * seconds * slack), devices, extended, cmd,
                         needs(dtype="bfloat16" if precision.startswith("bf") else "")))
    out.append(Check("pytest", "pytest -m cuda", 90, pytest_check(2 * 90 * slack), extended=True,
                     command=[sys.executable, "-m", "pytest", "-m", "cuda", "-q"]))
    return out


def estimate(selected: list[Check], gpus: int = 1) -> float:
    """Seconds the run of ``selected`` takes by the checks' estimates: one worker start for
    the in-process checks, then every check (those needing more than ``gpus`` GPUs skipped)."""
    runnable = [c for c in selected if c.gpus <= gpus]
    return sum(c.seconds for c in runnable) + WORKER_START_S * any(c.command is None for c in runnable)


def preflight(device: str) -> dict[str, str]:
    """What is missing here, a line each, keyed as :attr:`Check.needs` names them. Cheap on
    purpose (no import of triton or Liger): these lines come within seconds of the start."""
    missing = {}
    skipped = "the speed rows and the Triton op rows are SKIP rows"
    if importlib.util.find_spec("triton") is None:
        missing["triton"] = f"missing: triton - {skipped} (it comes with torch's CUDA wheels; pip install triton)"
    elif not (os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")):  # as triton's build looks
        missing["triton"] = f"missing: a C compiler (gcc, clang or $CC), Triton builds its launcher with one - {skipped}"
    if importlib.util.find_spec("liger_kernel") is None:
        missing["liger"] = ("missing: liger-kernel - the speed rows' 'x Liger' columns stay empty and the bar's "
                            "'backward >= 1.0x Liger' is unknown (pip install liger-kernel)")
    if not device.startswith("cuda"):
        missing["cuda"] = "missing: CUDA - --device cpu: the harness's self-test, CPU timings, no CUDA graphs"
    elif not torch.cuda.is_available():
        missing["cuda"] = ("missing: CUDA - no CUDA GPU is visible (torch.cuda.is_available() is False): nothing "
                           "run; --dry-run prints the plan, --device cpu runs the harness's self-test")
    elif torch.cuda.get_device_capability() < (8, 0):
        major, minor = torch.cuda.get_device_capability()
        missing["bf16"] = (f"missing: CUDA capability 8.0 (bfloat16; this GPU is {major}.{minor}) - the "
                           "bfloat16 rows are SKIP rows")
    return missing


# --- running the checks ------------------------------------------------------------------------------
def report(out: Path, index: int, check: Check, status: str, seconds: float, result: str,
           figures: Optional[dict] = None) -> None:
    """Write one row to the result file and print it."""
    figures = {k: v for k, v in (figures or {}).items() if k not in ("status", "result")}
    row = {"index": index, "group": check.group, "check": check.name, "status": status,
           "seconds": round(seconds, 1), "result": result, "extended": check.extended, **figures}
    results.add_row(out, row)
    print(f"{check.group:9s} {check.name:40s} {status:4s} {seconds:6.1f}  {result}", flush=True)


def run_worker(ctx: Context, indices: list[int]) -> int:
    """Run ``checks(ctx)[i]`` for ``indices`` in order (a worker subprocess), a row each; after a
    CUDA error (an illegal memory access leaves the context unusable) stop with :data:`RESTART`."""
    every = checks(ctx)
    crash = os.environ.get(CRASH_ENV, "")

    def stop(signum: int, frame: object) -> None:
        kill_active()
        os._exit(143)

    signal.signal(signal.SIGTERM, stop)
    for i in indices:
        check = every[i]
        if crash == f"{check.group}/{check.name}":
            os._exit(134)  # the self-test of a worker that dies (as on an illegal memory access)
        t0 = time.perf_counter()
        poisoned = False
        try:
            status, result, figures = check.run(ctx)
        except Exception as err:  # a broken check is one failed row, not the end of the run
            status, result, figures = "FAIL", f"{type(err).__name__}: {str(err)[:300]}", {}
            poisoned = ctx.device.startswith("cuda") and "CUDA error" in str(err)
        report(ctx.out, i, check, status, time.perf_counter() - t0, result, figures)
        if poisoned:
            return RESTART
    return 0


def _worker(args: argparse.Namespace, indices: list[int], timeout: float) -> tuple[int, str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--indices", ",".join(map(str, indices)),
           "--out", str(args.out), "--device", args.device]
    return _run_command(cmd, timeout, live=True)


def run_checks(args: argparse.Namespace, ctx: Context, every: list[Check], indices: list[int],
               missing: dict[str, str], deadline: float) -> None:
    """Run ``indices`` in order before ``deadline`` (``perf_counter``): a SKIP row for a check
    whose need is missing or that no longer fits; the in-process checks in workers (a fresh one
    after a crash: a FAIL row for the check it stopped), the commands here."""
    out, gpus, slack = ctx.out, ctx.gpus, 1.0 if ctx.device.startswith("cuda") else CPU_SLACK
    pending = list(indices)
    while pending:
        i, check = pending[0], every[pending[0]]
        left = deadline - time.perf_counter()
        lacking = [missing[n] for n in check.needs if n in missing]
        start = WORKER_START_S if check.command is None else 0.0  # a worker's start comes first
        if lacking or check.gpus > gpus or start + check.seconds > left:
            why = (lacking[0] if lacking else f"needs {check.gpus} GPUs, {gpus} visible" if check.gpus > gpus
                   else f"time budget: ~{start + check.seconds:.0f} s needed, {max(left, 0):.0f} s left")
            report(out, i, check, "SKIP", 0.0, why)
            pending.pop(0)
            continue
        if check.command is not None:
            t0 = time.perf_counter()
            status, result, figures = check.run(ctx)
            report(out, i, check, status, time.perf_counter() - t0, result, figures)
            pending.pop(0)
            continue
        batch, total = [], WORKER_START_S  # the in-process checks that follow and fit, in one worker
        for j in pending:
            c = every[j]
            if c.command is not None or any(n in missing for n in c.needs) or total + c.seconds > left:
                break
            batch.append(j)
            total += c.seconds
        t0 = time.perf_counter()
        status, text = _worker(args, batch, min(slack * 2 * total, left))
        done = {r["index"] for r in results.load(out)["rows"]}
        rest = [j for j in batch if j not in done]
        pending = [j for j in pending if j not in batch or j in rest]
        if rest and status != RESTART:  # the worker stopped in the middle of a check: a FAIL row
            why = (f"timed out: the worker was stopped after {time.perf_counter() - t0:.0f} s" if status == 124
                   else f"the worker died (exit {status}): {last_error(text)}")
            report(out, rest[0], every[rest[0]], "FAIL", time.perf_counter() - t0, why)
            pending.remove(rest[0])


def select(every: list[Check], extended: bool, match: Optional[str] = None) -> list[int]:
    """The indices of the checks a run makes, in order (the core first)."""
    return [i for i, c in enumerate(every)
            if (extended or not c.extended) and (match is None or re.search(match, c.name))]


def _versions() -> str:
    found = [f"torch {torch.__version__}"]
    for package in ("triton", "liger-kernel"):
        try:
            found.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ", ".join(found)


def _machine(device: str) -> str:
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        return f"{props.name} ({props.total_memory / 2**30:.0f} GiB, compute capability {props.major}.{props.minor})"
    return f"CPU ({os.cpu_count()} cores): the harness's self-test"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="print the plan and its estimates, run nothing")
    p.add_argument("--extended", action="store_true",
                   help="after a core without a FAIL row, the rest (ulp, compile, longer recipes, pytest -m cuda)")
    p.add_argument("--budget", type=float, default=BUDGET_S,
                   help=f"seconds for the whole run (default {BUDGET_S:.0f}); a check that no longer fits: a SKIP row")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (the harness's self-test)")
    p.add_argument("--out", default=None, help="the output folder (default gpu_check_out/<date-time>)")
    p.add_argument("--match", default=None, help="only the checks whose name matches this regular expression")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--indices", default="", help=argparse.SUPPRESS)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    args.out = args.out or str(ROOT / "gpu_check_out" / time.strftime("%Y%m%d-%H%M%S"))
    cuda = args.device.startswith("cuda")
    gpus = max(torch.cuda.device_count(), 1) if cuda and torch.cuda.is_available() else 1
    ctx = Context(args.device, gpus, 1 if cuda else 64, Path(args.out))
    out = ctx.out
    if args.worker:
        return run_worker(ctx, [int(i) for i in args.indices.split(",") if i])
    missing = {} if args.dry_run else preflight(args.device)  # first, before lightning_mrs is imported
    for line in missing.values():
        print(line, flush=True)
    if cuda and not args.dry_run and not torch.cuda.is_available():
        return 2
    every = checks(ctx)
    chosen = select(every, args.extended, args.match)
    core = [i for i in chosen if not every[i].extended]
    extended = [i for i in chosen if every[i].extended]
    core_estimate = estimate([every[i] for i in core], gpus)
    if args.dry_run:
        for i in chosen:
            c = every[i]
            print(f"{'extended' if c.extended else 'core':8s} {c.group:9s} {c.name:40s} ~{c.seconds:4.0f} s"
                  + (f", {c.gpus} GPUs" if c.gpus > 1 else ""))
            if c.command:
                print(f"{'':19s}$ {' '.join(c.command)}")
        print(f"core: {len(core)} checks, ~{core_estimate:.0f} s estimated (limit {CORE_LIMIT_S:.0f} s)")
        if args.extended:
            print(f"extended: {len(extended)} checks, ~{estimate([every[i] for i in extended], gpus):.0f} s "
                  f"estimated on {gpus} GPU(s), as far as --budget {args.budget:.0f} s allows")
        return 0
    title = f"gpu_check on {_machine(args.device)}; {_versions()}"
    results.start(out, {"title": title, "missing": list(missing.values()), "core_estimate_s": round(core_estimate)})
    print(f"{title}\ncore: {len(core)} checks, ~{core_estimate:.0f} s estimated; results in {out}", flush=True)
    started = time.perf_counter()
    deadline = started + args.budget
    run_checks(args, ctx, every, core, missing, deadline)
    measured = time.perf_counter() - started
    core_failed = sum(r["status"] == "FAIL" for r in results.load(out)["rows"])
    print(f"core: ~{core_estimate:.0f} s estimated, {measured:.0f} s measured, {core_failed} FAIL", flush=True)
    results.update(out, core=f"{len(core)} checks, ~{core_estimate:.0f} s estimated, {measured:.0f} s measured")
    if extended:
        fate = (f"not run: the core has {core_failed} FAIL row(s)" if core_failed
                else f"{len(extended)} checks within the budget ({args.budget:.0f} s for the run)")
        print(f"extended: {fate}", flush=True)
        if not core_failed:
            run_checks(args, ctx, every, extended, missing, deadline)
        results.update(out, extended=fate, total=f"{time.perf_counter() - started:.0f} s measured")
    rows = results.load(out)["rows"]
    for claim, met, shown in results.bar(rows):
        print(f"bar: {claim}: {results.met_text(met)} ({shown})")
    print(f"{len(rows)} rows: " + ", ".join(f"{sum(r['status'] == s for r in rows)} {s}"
                                           for s in ("PASS", "FAIL", "SKIP", "INFO")))
    print(f"results: {out / 'results.md'} (table) and {out / 'results.json'} (every figure)")
    return 1 if any(r["status"] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
