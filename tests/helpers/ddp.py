"""Run a multi-process (gloo, CPU) Lightning job in a subprocess, isolated from pytest, and the
pieces such a job uses: a sampler that splits each global batch over ranks in order, a
callback with which rank 0 dumps what it logged, the fit that uses both (:func:`split_fit`),
and the comparison of a job's history with one process's (:func:`assert_same_history`).

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
from typing import Callable, Iterable, Iterator

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import Sampler, TensorDataset

from helpers import ROOT
from helpers.lightning import fit
from helpers.recording_logger import RecordingLogger, monitor_tag

__all__ = ["DumpHistory", "RankStride", "assert_same_history", "ddp_matches_single_process", "free_port", "read_history",
           "run_job", "split_fit"]

History = dict[str, dict[int, float]]  # tag -> step -> value


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


def split_fit(module: pl.LightningModule, data: TensorDataset, *, global_batch: int, devices: int, strategy: str,
              steps: int, callbacks: Iterable[pl.Callback], out: str = "") -> History:
    """Fit ``module`` with each global batch of ``global_batch`` samples split over ``devices``
    ranks in order (:class:`RankStride`); rank 0 writes its history to ``out`` when given.
    Returns what this process logged."""
    rec = RecordingLogger()
    fit(module, steps=steps, logger=rec, data=data, sampler=RankStride(len(data)),
        batch_size=global_batch // devices, devices=devices, strategy=strategy, use_distributed_sampler=False,
        callbacks=[*callbacks, *([DumpHistory(out)] if out else [])])
    return rec.history


def read_history(path: Path) -> History:
    """The history :class:`DumpHistory` wrote (JSON turns the steps into strings)."""
    return {tag: {int(k): v for k, v in series.items()} for tag, series in json.loads(path.read_text()).items()}


def assert_same_history(ddp: History, single: History, prefix: str, steps: int, rel: float, abs: float) -> set[str]:
    """The tags under ``prefix`` are the same in both, logged at steps ``0 .. steps-1`` (as
    ``train/loss``) by the job, with the single process's values; returns those tags."""
    tags = {tag for tag in single if monitor_tag(tag, prefix)}
    assert {tag for tag in ddp if monitor_tag(tag, prefix)} == tags
    for tag in tags:
        assert ddp[tag].keys() == ddp["train/loss"].keys() == set(range(steps)), tag
        for step, value in single[tag].items():
            assert ddp[tag][step] == pytest.approx(value, rel=rel, abs=abs), (tag, step)
    return tags


def ddp_matches_single_process(script: Path, run: Callable[..., History], out: Path, prefix: str, steps: int,
                               rel: float, abs: float) -> tuple[set[str], History]:
    """Run ``script`` as a 2-process job writing rank 0's history to ``out`` (its ``__main__``
    calls ``run(devices=2, out=...)``), then ``run(devices=1)`` here, and check both logged the
    same tags under ``prefix`` (:func:`assert_same_history`); returns the tags and the single
    process's history."""
    proc = run_job(script, str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    single = run(devices=1)
    return assert_same_history(read_history(out), single, prefix, steps, rel=rel, abs=abs), single

