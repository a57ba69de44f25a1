"""The subprocess checks of ``benchmarks/gpu_check.py``: a few steps of each recipe, and the
``-m cuda`` test marker set; and the way every subprocess is run (a timeout, the last error)."""

from __future__ import annotations

import contextlib
import os
import signal
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["ALL_FLAGS", "kill_active", "last_error", "pytest_check", "recipe_check", "recipe_command", "run_command"]


def recipe_command(script: str, precision: str, ctx_device: str, devices: int, strategy: Optional[str],
                   root_dir: Path, flags: Optional[set[str]] = None, compiled: bool = False,
                   steps: int = 6) -> tuple[list[str], list[str]]:
    """``(command, notes)``: ``steps`` steps of ``script`` with the monitors on (one step: a one-batch
    epoch, then one validation batch; ``compiled``: its model compiled, ``--model.compile true``);
    ``notes`` say what its ``--help`` did not offer (then that part is left out, or the check fails
    where the option is the point of it)."""
    accelerator = "gpu" if ctx_device.startswith("cuda") else "cpu"
    run_dir = root_dir / (f"{Path(script).stem}_{precision}_{devices}{'_' + strategy if strategy else ''}"
                          f"{'_compiled' if compiled else ''}_{steps}")
    every = "1" if steps == 1 else "2"
    cmd = [sys.executable, script, "--trainer.accelerator", accelerator, "--trainer.devices", str(devices),
           "--trainer.precision", precision, "--trainer.max_steps", str(steps),
           "--trainer.limit_val_batches", "1" if steps == 1 else "2",
           "--trainer.log_every_n_steps", every, "--trainer.enable_progress_bar", "false",
           "--trainer.default_root_dir", str(run_dir)]
    if steps == 1:
        cmd += ["--trainer.limit_train_batches", "1"]
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
                "--data.val_windows", "32"] + (["--trainer.val_check_interval", "3"] if steps > 1 else [])
    if compiled:
        cmd += ["--model.compile", "true"]
    if flags is not None:
        for monitor in ("--monitor.log_every_n_steps", "--attention.log_every_n_steps"):
            if monitor in flags:
                cmd += [monitor, every]
        if not any(f.startswith("--monitor.") for f in flags):
            notes.append("no --monitor.* option in its --help: no gradient monitor")
        unknown = [a for a in cmd if a.startswith("--") and a not in flags]
        if unknown:
            notes.append(f"its --help lacks {', '.join(unknown)}")
    return cmd, notes


_ACTIVE: set[int] = set()  # the sessions of the commands running now (see kill_active)


def kill_active() -> None:
    """Kill every command :func:`run_command` is running, with its children (a worker told to
    stop passes it on: its recipe's session is not its own)."""
    for pgid in list(_ACTIVE):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


def run_command(cmd: list[str], timeout: float, live: bool = False) -> tuple[int, str]:
    """``(status, the output)``; status 124 on a timeout. The command runs in a session of its
    own; a timeout sends it SIGTERM (a worker then kills its own command's session), then
    SIGKILL: a recipe's data workers must not go on holding the GPU after their row is written.
    ``live``: its stdout goes straight to ours (a worker's rows as they end), only stderr is kept."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=None if live else subprocess.PIPE,
                            stderr=subprocess.PIPE if live else subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    _ACTIVE.add(proc.pid)
    try:
        out, err = proc.communicate(timeout=max(timeout, 1))
        out = err if live else out
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
            try:
                proc.communicate(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        return 124, f"timed out after {timeout:.0f} s"
    finally:
        _ACTIVE.discard(proc.pid)
    return proc.returncode, out.strip()


def last_error(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.search(r"(Error|error:|Exception)", ln)]
    return (errors or lines or ["(no output)"])[-1][:300]


def recipe_check(cmd: list[str], timeout: float) -> Callable[[Any], tuple[str, str, dict]]:
    def run(ctx: Any) -> tuple[str, str, dict]:
        t0 = time.perf_counter()
        status, text = run_command(cmd, timeout)
        if status != 0:
            return "FAIL", f"exit {status}: {last_error(text)}", {"command": cmd}
        steps = cmd[cmd.index("--trainer.max_steps") + 1]
        return "PASS", f"{steps} step(s) in {time.perf_counter() - t0:.0f} s", {"command": cmd}
    return run


def pytest_check(timeout: float) -> Callable[[Any], tuple[str, str, dict]]:
    def run(ctx: Any) -> tuple[str, str, dict]:
        cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", "-rfs", "-x"]
        status, text = run_command(cmd, timeout)
        summary = next((ln for ln in reversed(text.splitlines())
                        if re.search(r"\d+ (passed|failed|skipped|error)", ln)), last_error(text)).strip("= ")
        if status == 0 and "passed" in summary:
            return "PASS", summary, {}
        if status == 0 and "skipped" in summary and ctx.device == "cpu":
            return "SKIP", summary + " (no GPU here)", {}
        return "FAIL", f"exit {status}: {summary}", {}
    return run


class _AllFlags(set):
    """Every flag counts as offered: the commands are built without reading the recipes'
    ``--help`` at run time (its cost was unbudgeted); the slow test checks them against it."""

    def __contains__(self, flag: object) -> bool:
        return True


ALL_FLAGS = _AllFlags()


