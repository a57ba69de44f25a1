"""The recipes through their real command line: a script in a subprocess, and what a sweep wrote."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

from helpers import ROOT

__all__ = ["results_rows", "run_script"]


def run_script(script: Path, args: list[str], *, timeout: float, warnings: bool = False) -> subprocess.CompletedProcess:
    """``python script *args`` from the repository root, one thread; Python's warnings off unless
    ``warnings`` (the tests of "one error line, no warnings" keep them on)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not warnings:
        env["PYTHONWARNINGS"] = "ignore"
    return subprocess.run([sys.executable, str(script), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def results_rows(out: Path) -> list[dict[str, str]]:
    """The rows of a sweep's ``results.csv``, as written (strings)."""
    with open(out / "results.csv", newline="") as f:
        return list(csv.DictReader(f))
