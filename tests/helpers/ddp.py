"""Run a multi-process (gloo, CPU) Lightning job in a subprocess, isolated from pytest.

A DDP test module doubles as the job: run as a script it trains (Lightning's ``ddp``
launcher re-runs the same command line for the other ranks; ``ddp_spawn``/``ddp_fork``
start workers from it) and rank zero writes what it found to a JSON file.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from helpers import ROOT

__all__ = ["free_port", "run_job"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(script: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python script *args`` with a loopback rendezvous, one thread per process, and the
    repository and ``tests/`` importable."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
