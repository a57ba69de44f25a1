"""Everything that needs a GPU, in one command: the first thing to run on a GPU (a 15-minute lease).

Groups, in this order (the number we have never had first):

* ``speed``: a device copy, then per token shape and dtype our Triton kernels' forward and
  backward beside Liger-Kernel's RMSNorm ops (``triton.testing.do_bench``, L2 flushed), a
  ratio and which is faster, the module times, and our bandwidth as a share of the copy
  (``gpu_check_speed.py``);
* ``ops``: the op on CUDA, every layout x dtype x backend against a float64 reference
  (forward, input and weight gradient), the half-precision input gradient to one ulp, and
  ``torch.compile(fullgraph=True)`` of the op (``gpu_check_ops.py``);
* ``recipes``: 6 steps of ``recipes/cifar100.py`` (synthetic data, ``16-mixed``) and
  ``recipes/lm.py`` (``bf16-mixed``), monitors on;
* ``pytest``: the ``-m cuda`` test marker set.

``--extra`` adds the ``bf16-mixed`` image recipe, the compiled LM recipe and (with 2 GPUs) DDP
and FSDP2. Each group runs in a worker subprocess of its own, with a timeout: a crash (an
illegal memory access poisons a CUDA context) costs one row, and the group goes on in a fresh
worker. Every row is appended, as it ends, to ``results.csv`` and ``results.md`` in the output
folder (``--out``), so a run cut off still leaves what it did. The default run's estimate
(:func:`estimate`, tested against the list) keeps inside :data:`BUDGET_S` with a margin under
8 minutes; a check that no longer fits is a SKIP row that says so. Exit status: 1 if a check
failed, 0 otherwise; without CUDA one line and status 2.

Usage::

    pip install liger-kernel                            # the bar of the speed table (optional)
    python benchmarks/gpu_check.py --dry-run            # the plan and its estimate, nothing run
    python benchmarks/gpu_check.py --out gpu_check_out  # everything (< 8 minutes on one GPU)
    python benchmarks/gpu_check.py --only speed         # some groups
    python benchmarks/gpu_check.py --device cpu --only ops   # the harness itself, on the CPU
"""

from __future__ import annotations

import argparse
import csv
import importlib.metadata
import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check_recipes import ALL_FLAGS, kill_active, last_error as _last_error, pytest_check, recipe_check, recipe_command  # noqa: E402
from gpu_check_recipes import run_command as _run_command  # noqa: E402

GROUPS = ("speed", "ops", "recipes", "pytest", "multi-gpu")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NO_CUDA = ("gpu_check: no CUDA GPU is visible here (torch.cuda.is_available() is False), so nothing was run; "
           "--dry-run prints the plan, --device cpu runs the harness on the CPU.")
LIMIT_S = 480.0  # what the run must stay under (8 minutes of a 15-minute lease)
BUDGET_S = 450.0  # the default budget: LIMIT_S less a 30 s margin
WORKER_START_S = 20.0  # a worker's start: torch, triton, lightning_mrs, the CUDA context
COLUMNS = ["group", "check", "status", "seconds", "ours_ms", "liger_ms", "ratio", "faster", "copy_share", "result"]
CPU_SLACK = 6.0  # the CPU self-test's commands take this many times a GPU's estimate (timeouts only)
CRASH_ENV = "GPU_CHECK_SELFTEST_CRASH"  # "group/check": that check kills its worker (the self-test)


@dataclass
class Check:
    """One row: ``run(ctx)`` returns ``(status, result, figures)``; ``seconds``: the estimate
    on one GPU (a first call compiles: Triton ~1 s a kernel variant, Inductor more)."""

    group: str
    name: str
    seconds: float
    run: Callable[["Context"], tuple[str, str, dict]]
    gpus: int = 1
    extra: bool = False  # only with --extra
    command: Optional[list[str]] = None  # a subprocess check's command (--dry-run prints it)


@dataclass
class Context:
    device: str
    gpus: int
    scale: int  # the speed cases' rows are divided by it (the CPU self-test)
    out: Path  # the output folder (the recipes' runs go under it too)
    backends: list[str]
    copy_bw: Optional[float] = None


# --- the checks ---------------------------------------------------------------------------------
def _copy_check(ctx: Context) -> tuple[str, str, dict]:
    import gpu_check_speed as speed

    ctx.copy_bw = speed.copy_bandwidth(ctx.device, nbytes=(1 << 28) // ctx.scale)
    return "INFO", f"device copy {ctx.copy_bw / 1e9:.0f} GB/s (do_bench, 256 MiB)", {"copy_bw": ctx.copy_bw}


def _speed_check(index: int) -> Callable[[Context], tuple[str, str, dict]]:
    def run(ctx: Context) -> tuple[str, str, dict]:
        import gpu_check_speed as speed

        if ctx.copy_bw is None:  # a restarted worker: measure the copy again
            _copy_check(ctx)
        row = speed.run_case(speed.CASES[index], ctx.device, ctx.copy_bw, ctx.scale)
        figures = {"ours_ms": row.ours, "liger_ms": row.liger, "ratio": row.ratio, "faster": row.faster,
                   "copy_share": row.copy_share}
        suspicious = row.copy_share is not None and row.copy_share > 1.05  # faster than a copy: a wrong timing
        return ("FAIL" if suspicious else "INFO"), row.summary(), figures
    return run


def _outcome(out: object, n: int) -> tuple[str, str, dict]:
    ran = n - len(out.refused) - len(out.failed)  # type: ignore[attr-defined]
    text = f"{ran}/{n} layouts within tolerance, worst error {out.worst:.2f} x tolerance"  # type: ignore[attr-defined]
    if out.refused:  # type: ignore[attr-defined]
        text += f"; refused as documented: {', '.join(out.refused)}"  # type: ignore[attr-defined]
    if out.failed:  # type: ignore[attr-defined]
        text += "; FAILED " + " | ".join(out.failed)  # type: ignore[attr-defined]
    return ("PASS" if out.ok else "FAIL"), text, {"worst": out.worst, "failed": out.failed,  # type: ignore[attr-defined]
                                                   "refused": out.refused}  # type: ignore[attr-defined]


def _ops_check(backend: str, dtype: torch.dtype) -> Callable[[Context], tuple[str, str, dict]]:
    def run(ctx: Context) -> tuple[str, str, dict]:
        import gpu_check_ops as ops

        def expected_refusal(layout: str) -> bool:
            # the Triton kernels compute one S per position; on the CPU (the self-test) a forced
            # kernel may refuse any layout it does not cover, with its reason
            return (backend == "triton" and ops.LAYOUTS[layout][2]) or (ctx.device == "cpu" and backend != "auto")

        return _outcome(ops.check_backend_dtype(backend, dtype, ctx.device, expected_refusal), len(ops.LAYOUTS))
    return run


def _half_check(dtype: torch.dtype) -> Callable[[Context], tuple[str, str, dict]]:
    def run(ctx: Context) -> tuple[str, str, dict]:
        import gpu_check_ops as ops

        errors = {layout: ops.half_gradient_error("auto", layout, dtype, ctx.device) for layout in ops.HALF_LAYOUTS}
        worst = max(errors, key=errors.get)
        bad = [f"{k}: {v:.2f} ulp" for k, v in errors.items() if not v <= 1.0]
        text = f"{len(errors) - len(bad)}/{len(errors)} layouts within one ulp (worst {worst}: {errors[worst]:.2f})"
        return ("FAIL" if bad else "PASS"), text + ("; FAILED " + ", ".join(bad) if bad else ""), {"ulps": errors}
    return run


def _compile_check(dtype: torch.dtype) -> Callable[[Context], tuple[str, str, dict]]:
    layouts = ["tokens", "nchw_per_sample", "nhwc_per_position"]

    def run(ctx: Context) -> tuple[str, str, dict]:
        import gpu_check_ops as ops

        out = ops.check_backend_dtype("auto", dtype, ctx.device, lambda layout: False, layouts, compiled=True)
        return _outcome(out, len(layouts))
    return run



def checks(ctx: Context) -> list[Check]:
    """Every check, in the order they run (the default run: those without ``extra``)."""
    import gpu_check_speed as speed

    out = [Check("speed", "device copy", 3, _copy_check)]
    out += [Check("speed", f"{c.name} {c.dtype}", 7, _speed_check(i)) for i, c in enumerate(speed.CASES)]
    estimate = {"triton": 25, "auto": 30, "inductor": 40, "eager": 5, "cpp": 3, "torch": 3}
    for backend in ctx.backends:  # Triton in every dtype; the others once (auto: Inductor per sample)
        for name, dtype in DTYPES.items():
            if backend == "triton" or name == "bfloat16" or ctx.device == "cpu":
                out.append(Check("ops", f"{backend} {name}", estimate.get(backend, 10), _ops_check(backend, dtype)))
    out += [Check("ops", f"half gradient to one ulp {name}", 10, _half_check(DTYPES[name]))
            for name in ("bfloat16", "float16")]
    out.append(Check("ops", "torch.compile bfloat16", 15, _compile_check(torch.bfloat16)))
    slack = 1.0 if ctx.device.startswith("cuda") else CPU_SLACK
    cifar, lm = "recipes/cifar100.py", "recipes/lm.py"
    recipes = [
        ("recipes", f"{cifar} 16-mixed", 35, cifar, "16-mixed", 1, None, False, False),
        ("recipes", f"{lm} bf16-mixed", 35, lm, "bf16-mixed", 1, None, False, False),
        ("recipes", f"{cifar} bf16-mixed", 35, cifar, "bf16-mixed", 1, None, False, True),
        ("recipes", f"{lm} bf16-mixed compiled", 90, lm, "bf16-mixed", 1, None, True, True),
        ("multi-gpu", f"{cifar} bf16-mixed DDP x2", 60, cifar, "bf16-mixed", 2, "ddp", False, True),
        ("multi-gpu", f"{lm} bf16-mixed DDP x2", 60, lm, "bf16-mixed", 2, "ddp", False, True),
        ("multi-gpu", f"{lm} bf16-mixed FSDP2 x2", 60, lm, "bf16-mixed", 2, "fsdp2", False, True),
    ]
    for group, name, seconds, script, precision, devices, strategy, compiled, extra in recipes:
        cmd, _ = recipe_command(script, precision, ctx.device, devices, strategy, ctx.out / "runs",
                                ALL_FLAGS, compiled)
        out.append(Check(group, name, seconds, recipe_check(cmd, 2 * seconds * slack), devices, extra, cmd))
    out.append(Check("pytest", "pytest -m cuda", 90, pytest_check(2 * 90 * slack),
                     command=[sys.executable, "-m", "pytest", "-m", "cuda", "-q"]))
    return out


def estimate(selected: list[Check], gpus: int = 1) -> float:
    """Seconds the run of ``selected`` takes by the checks' estimates: each group's worker
    start, then its checks (those that need more GPUs than ``gpus`` are skipped)."""
    runnable = [c for c in selected if c.gpus <= gpus]
    return sum(c.seconds for c in runnable) + WORKER_START_S * len({c.group for c in runnable})


# --- the output: one CSV and one Markdown table, a row appended as it ends ------------------------
def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def start_output(out: Path, title: str) -> None:
    """Create ``out`` with the headers of ``results.csv`` and ``results.md`` (if not there yet)."""
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "results.csv").exists():
        with open(out / "results.csv", "w", newline="") as f:
            csv.writer(f).writerow(COLUMNS)
        with open(out / "results.md", "w") as f:
            f.write(f"{title}\n\n| {' | '.join(COLUMNS)} |\n|{'---|' * len(COLUMNS)}\n")


def append_row(out: Path, group: str, name: str, status: str, seconds: float, result: str,
               figures: Optional[dict] = None) -> None:
    """Append one row to both files, flushed (a run cut off keeps every finished row)."""
    figures = figures or {}
    values = {"group": group, "check": name, "status": status, "seconds": round(seconds, 1), "result": result,
              **{k: figures.get(k) for k in ("ours_ms", "liger_ms", "ratio", "faster", "copy_share")}}
    cells = [_cell(values[c]) for c in COLUMNS]
    with open(out / "results.csv", "a", newline="") as f:
        csv.writer(f).writerow(cells)
    with open(out / "results.md", "a") as f:
        f.write("| " + " | ".join(c.replace("|", "/").replace("\n", " ") for c in cells) + " |\n")


def read_rows(out: Path) -> list[dict]:
    """The rows written so far."""
    with open(out / "results.csv", newline="") as f:
        return list(csv.DictReader(f))


# --- the worker: one group's checks in a subprocess --------------------------------------------
def run_worker(ctx: Context, indices: list[int]) -> int:
    """Run ``checks(ctx)[i]`` for ``indices`` in order, appending each row as it ends."""
    every = checks(ctx)
    crash = os.environ.get(CRASH_ENV, "")

    def stop(signum: int, frame: object) -> None:  # the group's timeout: take the running command along
        kill_active()
        os._exit(143)

    signal.signal(signal.SIGTERM, stop)
    for i in indices:
        check = every[i]
        if crash == f"{check.group}/{check.name}":
            os._exit(134)  # the self-test of a worker that dies (as on an illegal memory access)
        t0 = time.perf_counter()
        try:
            status, result, figures = check.run(ctx)
        except Exception as err:  # a broken check is one failed row, not the end of the group
            status, result, figures = "FAIL", f"{type(err).__name__}: {str(err)[:300]}", {}
        append_row(ctx.out, check.group, check.name, status, time.perf_counter() - t0, result, figures)
        with open(ctx.out / ".done", "a") as f:
            f.write(f"{i}\n")
    return 0


def _done(out: Path) -> set[int]:
    path = out / ".done"
    return {int(s) for s in path.read_text().split()} if path.exists() else set()


def _worker_command(args: argparse.Namespace, group: str, indices: list[int]) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", group, "--indices", ",".join(map(str, indices)),
           "--out", str(args.out), "--device", args.device]
    if args.backends:
        cmd += ["--backends", *args.backends]
    return cmd


def run_group(args: argparse.Namespace, every: list[Check], indices: list[int], started: float,
              budget: float) -> None:
    """The checks ``indices`` of one group in workers: those that fit the budget, a fresh
    worker after a crash, a FAIL row for the check a crash or the timeout stopped."""
    out = Path(args.out)
    pending = list(indices)
    while pending:
        left = budget - (time.perf_counter() - started) - WORKER_START_S
        fits, total = [], 0.0
        for i in pending:
            if total + every[i].seconds <= left:
                fits.append(i)
                total += every[i].seconds
        for i in (i for i in pending if i not in fits):
            c = every[i]
            append_row(out, c.group, c.name, "SKIP", 0.0,
                       f"time budget: ~{c.seconds:.0f} s needed, {max(left - total, 0):.0f} s left of {budget:.0f} "
                       f"(run it with --only {c.group})")
        if not fits:
            return
        slack = 1.0 if args.device.startswith("cuda") else CPU_SLACK
        timeout = min(slack * (WORKER_START_S + 2 * total), budget - (time.perf_counter() - started))
        t0 = time.perf_counter()
        status, text = _run_command(_worker_command(args, every[fits[0]].group, fits), timeout)
        done = _done(out)
        rest = [i for i in fits if i not in done]
        if not rest:
            return
        first = every[rest[0]]
        why = (f"timed out: the group's worker was stopped after {timeout:.0f} s" if status == 124
               else f"the worker died (exit {status}): {_last_error(text)}")
        append_row(out, first.group, first.name, "FAIL", time.perf_counter() - t0, why)
        if status == 124:
            for i in rest[1:]:
                append_row(out, every[i].group, every[i].name, "SKIP", 0.0, "the group's worker timed out before it")
            return
        pending = rest[1:]  # the next check in a fresh worker (a fresh CUDA context)


# --- the run -----------------------------------------------------------------------------------
def header(device: str, gpus: int, budget: float) -> str:
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        what = (f"{props.name} x{gpus} ({props.total_memory / 2**30:.0f} GiB, compute capability "
                f"{props.major}.{props.minor})")
    else:
        what = f"CPU ({os.cpu_count()} cores): the harness's self-test"
    versions = [f"torch {torch.__version__}"]
    for package in ("triton", "liger-kernel"):
        try:
            versions.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{package} not installed")
    return f"gpu_check on {what}; {', '.join(versions)}; budget {budget:.0f} s"


def summary(rows: list[dict], seconds: float) -> str:
    counts = {s: sum(r["status"] == s for r in rows) for s in ("PASS", "FAIL", "SKIP", "INFO")}
    return f"{len(rows)} checks: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + f" in {seconds:.0f} s"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="print the plan and its estimate, run nothing")
    p.add_argument("--only", nargs="+", choices=GROUPS, default=None, help="run only these groups")
    p.add_argument("--extra", action="store_true", help="also the extra recipes (bf16 image, compiled LM, 2 GPUs)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (the harness's self-test)")
    p.add_argument("--backends", nargs="+", default=None,
                   help="backends of the ops checks (cuda: triton auto eager; cpu: cpp eager auto)")
    p.add_argument("--budget", type=float, default=None, help=f"seconds for the whole run (default {BUDGET_S:.0f})")
    p.add_argument("--out", default=None, help="the output folder (default gpu_check_out/<date-time>)")
    p.add_argument("--match", default=None, help="only the checks whose name matches this regular expression")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--indices", default="", help=argparse.SUPPRESS)
    return p


def _context(args: argparse.Namespace) -> Context:
    cuda = args.device.startswith("cuda")
    gpus = torch.cuda.device_count() if cuda and torch.cuda.is_available() else 1
    backends = args.backends or (["triton", "auto", "eager"] if cuda else ["cpp", "eager", "auto"])
    return Context(args.device, max(gpus, 1), 1 if cuda else 64, Path(args.out or "."), backends)


def select(every: list[Check], only: Optional[list[str]], extra: bool, match: Optional[str] = None) -> list[int]:
    """The indices of the checks a run makes, in order."""
    return [i for i, c in enumerate(every) if (only is None or c.group in only) and (extra or not c.extra)
            and (match is None or re.search(match, c.name))]


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.out is None:
        args.out = str(ROOT / "gpu_check_out" / time.strftime("%Y%m%d-%H%M%S"))
    ctx = _context(args)
    if args.worker:
        return run_worker(ctx, [int(i) for i in args.indices.split(",") if i])
    cuda = args.device.startswith("cuda")
    if cuda and not args.dry_run and not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    budget = args.budget if args.budget is not None else BUDGET_S
    every = checks(ctx)
    chosen = select(every, args.only, args.extra, args.match)
    if args.dry_run:
        for i in chosen:
            c = every[i]
            print(f"{c.group:10s} {c.name:44s} ~{c.seconds:4.0f} s" + (f", {c.gpus} GPUs" if c.gpus > 1 else ""))
            if c.command:
                print(f"{'':10s}   $ {' '.join(c.command)}")
        selected = [every[i] for i in chosen]
        print(f"{len(chosen)} checks in {len({c.group for c in selected})} workers, "
              f"~{estimate(selected, ctx.gpus):.0f} s estimated on {ctx.gpus} GPU(s) (budget {budget:.0f} s, "
              f"limit {LIMIT_S:.0f} s)")
        return 0
    out = Path(args.out)
    title = header(args.device, ctx.gpus, budget)
    start_output(out, title)
    print(title, flush=True)
    started = time.perf_counter()
    for group in GROUPS:
        indices = [i for i in chosen if every[i].group == group]
        fits = [i for i in indices if every[i].gpus <= ctx.gpus]
        for i in (i for i in indices if i not in fits):
            append_row(out, group, every[i].name, "SKIP", 0.0, f"needs {every[i].gpus} GPUs, {ctx.gpus} visible")
        if fits:
            run_group(args, every, fits, started, budget)
        for row in read_rows(out):
            if row["group"] == group:
                print(f"{row['group']:10s} {row['check']:44s} {row['status']:5s} {float(row['seconds']):6.1f}  "
                      f"{row['result']}", flush=True)
    rows = read_rows(out)
    print(summary(rows, time.perf_counter() - started))
    print(f"results: {out / 'results.csv'} and {out / 'results.md'}")
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    return 1 if any(r["status"] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
