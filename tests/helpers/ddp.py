"""Run a multi-process (gloo, CPU) Lightning job in a subprocess, isolated from pytest, and the
pieces such a job uses: a sampler that splits each global batch over ranks in order, and a
callback with which rank 0 dumps what it logged.

A DDP test module doubles as the job: run as a script it trains (Lightning's ``ddp``
launcher re-runs the same command line for the other ranks; ``ddp_spawn``/``ddp_fork``
start workers from it) and rank zero writes what it found to a JSON file.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import lightning.pytorch as pl
import torch
from torch.utils.data import Sampler

from helpers import ROOT
from helpers.recording_logger import RecordingLogger

__all__ = ["DumpHistory", "RankStride", "free_port", "run_job"]


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


class DumpHistory(pl.Callback):
    """Rank 0 writes its RecordingLogger's history to ``path`` when training ends."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            (rec,) = [logger for logger in trainer.loggers if isinstance(logger, RecordingLogger)]
            Path(self.path).write_text(json.dumps(rec.history))


class RankStride(Sampler):
    """Samples ``rank, rank + world, ...`` in order, the rank read when iteration starts (in the
    worker, whichever launcher made it): each step's local batches of the ranks are together
    the single-process batch. (Lightning's own distributed sampler shuffles training data.)"""

    def __init__(self, n: int) -> None:
        self.n = n

    def _split(self) -> tuple[int, int]:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return 0, 1

    def __iter__(self) -> Iterator[int]:
        rank, world = self._split()
        return iter(range(rank, self.n, world))

    def __len__(self) -> int:
        rank, world = self._split()
        return len(range(rank, self.n, world))
