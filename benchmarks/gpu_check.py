"""Everything that needs a GPU, in one command and one table: the first thing to run on a GPU.

Checks, in this order (``--dry-run`` lists them with their commands):

* ``ops``: the op on CUDA, every layout (:data:`gpu_check_ops.LAYOUTS`) x float32, bfloat16,
  float16 x backend (``triton``, ``inductor``, ``eager``, ``auto``) against a float64 reference,
  forward, input and weight gradient; ``compile``: ``torch.compile(fullgraph=True)`` of the op;
* ``pytest``: the ``-m cuda`` test marker set;
* ``speed``: forward+backward time and peak memory of MRSNorm against ``F.layer_norm``,
  ``F.rms_norm``, ``F.group_norm`` and (when importable) Liger-Kernel's ``LigerRMSNorm`` and
  ``LigerLayerNorm``, with the achieved fraction of the memory bandwidth on the large token
  shapes (of a device copy, and of the GPU's nominal figure);
* ``recipes``: a few steps of ``recipes/cifar100.py`` (synthetic data, ``16-mixed`` and
  ``bf16-mixed``) and ``recipes/lm.py`` (``bf16-mixed``, and again with ``--model.compile
  true``: its decoder layers compiled by Inductor), monitors on; ``multi-gpu`` (with 2 or more GPUs): the same with
  ``--trainer.devices 2`` (DDP) and FSDP2.

Each check ends as PASS, FAIL (with why), SKIP (with why: no Liger, one GPU, the time budget)
or INFO (figures). The run keeps to ``--budget`` seconds (450, so under 8 minutes): a check
whose estimate no longer fits is skipped, and says so (``--only`` runs it on its own); the
multi-GPU checks add about 3 minutes to the default budget where they run. The exit status is 1 if any check
failed, 0 otherwise; without CUDA the script prints one line and exits with status 2.

Usage::

    python benchmarks/gpu_check.py                       # everything (one GPU: < 8 minutes)
    python benchmarks/gpu_check.py --dry-run             # the checks and commands, nothing run
    python benchmarks/gpu_check.py --only ops speed      # some groups
    python benchmarks/gpu_check.py --json gpu_check.json # also the figures, machine-readable
    python benchmarks/gpu_check.py --device cpu --only ops speed   # the harness itself, on the CPU
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

GROUPS = ("ops", "compile", "pytest", "speed", "recipes", "multi-gpu")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NO_CUDA = ("gpu_check: no CUDA GPU is visible here (torch.cuda.is_available() is False), so nothing was run; "
           "--dry-run lists the checks, --device cpu runs the harness on the CPU.")


@dataclass
class Row:
    """One line of the table."""

    group: str
    check: str
    status: str  # PASS, FAIL, SKIP, INFO
    result: str
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)  # for --json


@dataclass
class Check:
    """One check: ``run(ctx)`` returns its row's ``(status, result, figures)``."""

    group: str
    name: str
    seconds: float  # the estimate on one GPU, for the budget
    run: Callable[["Context"], tuple[str, str, dict]]
    gpus: int = 1  # GPUs it needs
    command: Optional[list[str]] = None  # a subprocess check's command line (--dry-run prints it)


@dataclass
class Context:
    device: str
    gpus: int
    scale: int  # the speed cases' first dim is divided by it (the CPU self-test)
    root_dir: Path  # where the recipes write their runs
    backends: list[str]
    started: float = field(default_factory=time.perf_counter)
    copy_bw: Optional[float] = None
    peak_bw: Optional[float] = None


# --- the op: correctness, compile, speed --------------------------------------------------------
def _ops_check(backend: str, dtype: torch.dtype) -> Callable[[Context], tuple[str, str, dict]]:
    def run(ctx: Context) -> tuple[str, str, dict]:
        import gpu_check_ops as ops

        def expected_refusal(layout: str) -> bool:
            # the Triton kernels compute one S per position; on the CPU (the self-test) a forced
            # kernel may refuse any layout it does not cover, with its reason
            return (backend == "triton" and ops.LAYOUTS[layout][2]) or (ctx.device == "cpu" and backend != "auto")

        out = ops.check_backend_dtype(backend, dtype, ctx.device, expected_refusal)
        return _outcome(out, len(ops.LAYOUTS))
    return run


def _compile_check(dtype: torch.dtype) -> Callable[[Context], tuple[str, str, dict]]:
    layouts = ["tokens", "nchw_per_sample", "nhwc_per_position"]

    def run(ctx: Context) -> tuple[str, str, dict]:
        import gpu_check_ops as ops

        out = ops.check_backend_dtype("auto", dtype, ctx.device, lambda layout: False, layouts, compiled=True)
        return _outcome(out, len(layouts))
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


def _bandwidth_check(ctx: Context) -> tuple[str, str, dict]:
    import gpu_check_ops as ops

    ctx.copy_bw = ops.copy_bandwidth(ctx.device, nbytes=(1 << 28) // ctx.scale)
    ctx.peak_bw = ops.nominal_bandwidth(ctx.device)
    nominal = f", nominal {ctx.peak_bw / 1e9:.0f} GB/s (memory clock x bus width)" if ctx.peak_bw else ""
    return "INFO", f"device copy {ctx.copy_bw / 1e9:.0f} GB/s{nominal}", {"copy": ctx.copy_bw, "nominal": ctx.peak_bw}


def _speed_check(index: int, dtype: torch.dtype) -> Callable[[Context], tuple[str, str, dict]]:
    def run(ctx: Context) -> tuple[str, str, dict]:
        import gpu_check_ops as ops

        case = ops.scaled(ops.SPEED_CASES[index], ctx.scale)
        res = ops.speed_case(case, dtype, ctx.device, iters=20 if ctx.device != "cpu" else 2,
                             rounds=5 if ctx.device != "cpu" else 2)
        status = "INFO" if res.ours in res.ms else "FAIL"
        return status, res.summary(ctx.copy_bw, ctx.peak_bw), asdict(res)
    return run


# --- subprocesses: recipes and the CUDA test marker set -----------------------------------------
_HELP: dict[str, set[str]] = {}


def help_flags(script: str) -> set[str]:
    """The ``--flags`` a recipe's ``--help`` lists (read once per script)."""
    if script not in _HELP:
        out = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
        _HELP[script] = set(re.findall(r"(--[A-Za-z_][\w.]*)", out.stdout))
    return _HELP[script]


def recipe_command(script: str, precision: str, ctx_device: str, devices: int, strategy: Optional[str],
                   root_dir: Path, flags: Optional[set[str]] = None,
                   compiled: bool = False) -> tuple[list[str], list[str]]:
    """``(command, notes)``: a few steps of ``script`` with the monitors on (``compiled``: its model
    compiled, ``--model.compile true``); ``notes`` say what its ``--help`` did not offer (then that
    part is left out, or the check fails where the option is the point of it)."""
    accelerator = "gpu" if ctx_device.startswith("cuda") else "cpu"
    run_dir = root_dir / (f"{Path(script).stem}_{precision}_{devices}{'_' + strategy if strategy else ''}"
                          f"{'_compiled' if compiled else ''}")
    cmd = [sys.executable, script, "--trainer.accelerator", accelerator, "--trainer.devices", str(devices),
           "--trainer.precision", precision, "--trainer.max_steps", "6", "--trainer.limit_val_batches", "2",
           "--trainer.log_every_n_steps", "2", "--trainer.enable_progress_bar", "false",
           "--trainer.default_root_dir", str(run_dir)]
    if strategy:
        cmd += ["--trainer.strategy", strategy]
    notes: list[str] = []
    if script.endswith("cifar100.py"):
        cmd += ["--data.dataset", "synthetic", "--data.synthetic_train_size", "256", "--data.synthetic_val_size", "64",
                "--data.batch_size", "32", "--model.norm", "mrs"]
        if accelerator == "cpu":  # the self-test: the CPU demo's narrow ResNet (a ResNet-18 takes minutes)
            cmd += ["--model.arch", "timm:resnet18", "--model.arch_kwargs",
                    '{"layers": [1, 1, 1, 1], "channels": [32, 48, 64, 96], "stem_width": 32}']
    else:
        cmd += ["--model.arch", "llama", "--model.norm", "mrs", "--model.config",
                '{"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 512}',
                "--data.dataset", "stdlib", "--data.seq_len", "128", "--data.batch_size", "16",
                "--data.val_windows", "32", "--trainer.val_check_interval", "3"]
    if compiled:
        cmd += ["--model.compile", "true"]
    if flags is not None:
        for monitor in ("--monitor.log_every_n_steps", "--attention.log_every_n_steps"):
            if monitor in flags:
                cmd += [monitor, "2"]
        if not any(f.startswith("--monitor.") for f in flags):
            notes.append("no --monitor.* option in its --help: no gradient monitor")
        unknown = [a for a in cmd if a.startswith("--") and a not in flags]
        if unknown:
            notes.append(f"its --help lacks {', '.join(unknown)}")
    return cmd, notes


def _run_command(cmd: list[str], timeout: float) -> tuple[int, str]:
    """``(status, the last lines of the output)``; status 124 on a timeout."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(timeout, 1), env=env)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout:.0f} s"
    return out.returncode, (out.stdout + out.stderr).strip()


def _last_error(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.search(r"(Error|error:|Exception)", ln)]
    return (errors or lines or ["(no output)"])[-1][:300]


def _recipe_check(script: str, precision: str, devices: int = 1, strategy: Optional[str] = None,
                  compiled: bool = False) -> Callable[[Context], tuple[str, str, dict]]:
    def run(ctx: Context) -> tuple[str, str, dict]:
        flags = help_flags(script)
        cmd, notes = recipe_command(script, precision, ctx.device, devices, strategy, ctx.root_dir, flags, compiled)
        if any(n.startswith("its --help lacks") for n in notes):
            return "FAIL", "; ".join(notes), {"command": cmd}
        t0 = time.perf_counter()
        status, text = _run_command(cmd, _remaining(ctx, cap=420))
        seconds = time.perf_counter() - t0
        figures = {"command": cmd, "returncode": status}
        if status != 0:
            return "FAIL", f"exit {status}: {_last_error(text)}", figures
        return "PASS", "; ".join([f"6 steps in {seconds:.0f} s", *notes]), figures
    return run


def _pytest_check(ctx: Context) -> tuple[str, str, dict]:
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", "-rfs"]
    status, text = _run_command(cmd, _remaining(ctx, cap=300))
    summary = next((ln for ln in reversed(text.splitlines()) if re.search(r"\d+ (passed|failed|skipped|error)", ln)),
                   _last_error(text))
    if status == 0 and "passed" in summary:
        return "PASS", summary.strip("= "), {"returncode": status}
    if status == 0 and "skipped" in summary and ctx.device == "cpu":
        return "SKIP", summary.strip("= ") + " (no GPU here)", {"returncode": status}
    return "FAIL", f"exit {status}: {summary.strip('= ')}", {"returncode": status}


def _remaining(ctx: Context, cap: float) -> float:
    return min(cap, BUDGET[0] - (time.perf_counter() - ctx.started))


BUDGET = [450.0]  # seconds; --budget (the default adds MULTI_GPU_S where 2+ GPUs are visible)
MULTI_GPU_S = 180.0


# --- the list of checks, the run, the table ----------------------------------------------------
def checks(ctx: Context) -> list[Check]:
    """Every check, in the order they run."""
    import gpu_check_ops as ops

    out: list[Check] = []
    # seconds on one GPU (a first call compiles: Triton ~1 s per kernel variant, Inductor more)
    estimate = {"triton": 10, "inductor": 30, "eager": 2, "auto": 5, "cpp": 3, "torch": 3}
    for backend in ctx.backends:
        for name, dtype in DTYPES.items():
            out.append(Check("ops", f"{backend} {name}", estimate.get(backend, 10), _ops_check(backend, dtype)))
    for name, dtype in DTYPES.items():
        out.append(Check("compile", f"torch.compile {name}", 10, _compile_check(dtype)))
    out.append(Check("pytest", "pytest -m cuda", 60, _pytest_check,
                     command=[sys.executable, "-m", "pytest", "-m", "cuda", "-q"]))
    out.append(Check("speed", "memory bandwidth", 3, _bandwidth_check))
    for i, case in enumerate(ops.SPEED_CASES):
        for name in ("bfloat16", "float32"):
            out.append(Check("speed", f"{case.name} {name}", 4, _speed_check(i, DTYPES[name])))
    cifar, lm = "recipes/cifar100.py", "recipes/lm.py"
    recipes = [
        ("recipes", f"{cifar} 16-mixed", 35, cifar, "16-mixed", 1, None, False),
        ("recipes", f"{cifar} bf16-mixed", 35, cifar, "bf16-mixed", 1, None, False),
        ("recipes", f"{lm} bf16-mixed", 35, lm, "bf16-mixed", 1, None, False),
        ("recipes", f"{lm} bf16-mixed compiled", 90, lm, "bf16-mixed", 1, None, True),
        ("multi-gpu", f"{cifar} bf16-mixed DDP x2", 60, cifar, "bf16-mixed", 2, "ddp", False),
        ("multi-gpu", f"{lm} bf16-mixed DDP x2", 60, lm, "bf16-mixed", 2, "ddp", False),
        ("multi-gpu", f"{lm} bf16-mixed FSDP2 x2", 60, lm, "bf16-mixed", 2, "fsdp2", False),
    ]
    for group, name, seconds, script, precision, devices, strategy, compiled in recipes:
        cmd, _ = recipe_command(script, precision, ctx.device, devices, strategy, ctx.root_dir, compiled=compiled)
        out.append(Check(group, name, seconds, _recipe_check(script, precision, devices, strategy, compiled),
                         gpus=devices, command=cmd))
    return out


def run_checks(selected: list[Check], ctx: Context, print_row: Callable[[Row], None]) -> list[Row]:
    """Run ``selected`` in order within the budget; one row each, printed as it ends."""
    rows = []
    for check in selected:
        elapsed = time.perf_counter() - ctx.started
        if check.gpus > ctx.gpus:
            row = Row(check.group, check.name, "SKIP", f"needs {check.gpus} GPUs, {ctx.gpus} visible")
        elif elapsed + check.seconds > BUDGET[0]:
            row = Row(check.group, check.name, "SKIP",
                      f"time budget: {elapsed:.0f} s spent, ~{check.seconds:.0f} s needed, --budget {BUDGET[0]:.0f}")
        else:
            t0 = time.perf_counter()
            try:
                status, result, figures = check.run(ctx)
            except Exception as err:  # a broken check is one failed row, not the end of the run
                status, result, figures = "FAIL", f"{type(err).__name__}: {str(err)[:300]}", {}
            row = Row(check.group, check.name, status, result, time.perf_counter() - t0, figures)
        rows.append(row)
        print_row(row)
    return rows


def format_row(row: Row) -> str:
    return f"{row.group:10s} {row.check:42s} {row.status:5s} {row.seconds:7.1f}  {row.result}"


def header(ctx: Context) -> str:
    if ctx.device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        what = (f"{props.name} x{ctx.gpus} ({props.total_memory / 2**30:.0f} GiB, compute capability "
                f"{props.major}.{props.minor})")
    else:
        what = f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads): the harness's self-test"
    versions = [f"torch {torch.__version__}"]
    for package in ("triton", "liger-kernel", "transformers"):
        try:
            versions.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{package} not installed")
    return f"gpu_check on {what}; {', '.join(versions)}; budget {BUDGET[0]:.0f} s"


def summary(rows: list[Row], seconds: float) -> str:
    counts = {s: sum(r.status == s for r in rows) for s in ("PASS", "FAIL", "SKIP", "INFO")}
    return f"{len(rows)} checks: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + f" in {seconds:.0f} s"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="list the checks (and their commands), run nothing")
    p.add_argument("--only", nargs="+", choices=GROUPS, default=None, help="run only these groups")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (the harness's self-test)")
    p.add_argument("--backends", nargs="+", default=None,
                   help="backends of the ops checks (cuda: triton inductor eager auto; cpu: cpp eager auto)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole run (default 450 on one GPU, 630 with the multi-GPU checks)")
    p.add_argument("--json", default=None, help="also write every row and its figures to this file")
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not args.dry_run and not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count() if cuda and torch.cuda.is_available() else (1 if cuda else 0)
    BUDGET[0] = args.budget if args.budget is not None else 450.0 + (MULTI_GPU_S if gpus > 1 else 0.0)
    backends = args.backends or (["triton", "inductor", "eager", "auto"] if cuda else ["cpp", "eager", "auto"])
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        ctx = Context(args.device, max(gpus, 1), 1 if cuda else 64, Path(tmp), backends)
        selected = [c for c in checks(ctx) if args.only is None or c.group in args.only]
        if args.dry_run:
            for c in selected:
                need = f", {c.gpus} GPUs" if c.gpus > 1 else ""
                print(f"{c.group:10s} {c.name:42s} ~{c.seconds:4.0f} s{need}")
                if c.command:
                    print(f"{'':10s}   $ {' '.join(c.command)}")
            total = sum(c.seconds for c in selected if c.gpus <= 1)
            print(f"{len(selected)} checks, ~{total:.0f} s estimated on one GPU (budget {BUDGET[0]:.0f} s)")
            return 0
        print(header(ctx))
        print(f"{'group':10s} {'check':42s} {'':5s} {'seconds':>7s}  result (x = our time / theirs)")
        rows = run_checks(selected, ctx, lambda row: print(format_row(row), flush=True))
        print(summary(rows, time.perf_counter() - ctx.started))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2, default=str))
    return 1 if any(r.status == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
