"""GradientHomogeneityMonitor under 2-process gloo DDP matches one process on the same global batch.

Run as a script (``python tests/callbacks/test_homogeneity_ddp.py STRATEGY OUT.json``) this
file is the DDP job itself, for each launcher: ``ddp`` re-runs the same command line for rank
1, ``ddp_spawn`` starts fresh interpreters that import this file as their main module (hence
the ``__main__`` guard), ``ddp_fork`` forks. Rank 0 writes what it logged to ``OUT.json``
from inside the training run (a callback), wherever that runs. Each test runs one job in a
subprocess (isolated from pytest, :func:`helpers.ddp.run_job`) and compares it with a
single-process run in the test process.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from helpers.ddp import assert_same_history, read_history, run_job, split_fit
from helpers.lightning import TinyModule, image_data, per_sample_net
from lightning_mrs.callbacks import GradientHomogeneityMonitor

GLOBAL_BATCH, STEPS = 8, 3


def run(strategy: str, devices: int, out: str = "") -> dict[str, dict[int, float]]:
    """Per-sample norms only (no cross-sample statistics), the global batch split over ranks."""
    return split_fit(TinyModule(per_sample_net), image_data(), global_batch=GLOBAL_BATCH, devices=devices,
                     strategy=strategy, steps=STEPS, callbacks=[GradientHomogeneityMonitor()], out=out)


@pytest.fixture(scope="module")
def single() -> dict[str, dict[int, float]]:
    return run("auto", devices=1)


@pytest.mark.parametrize("strategy", [
    "ddp", pytest.param("ddp_spawn", marks=pytest.mark.slow), pytest.param("ddp_fork", marks=pytest.mark.slow),
])
@pytest.mark.slow  # idle 2 cores: 10-45 s; the default suite keeps a faster sibling
def test_ddp_gloo_matches_single_process(tmp_path: Path, strategy: str, single: dict[str, Any]) -> None:
    out = tmp_path / "rank0.json"
    proc = run_job(Path(__file__).resolve(), strategy, str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    phasor = assert_same_history(read_history(out), single, "phasor/", STEPS, rel=1e-4, abs=1e-9)
    assert {"z-layers/phasor/net.1/grad_mean", "z-layers/phasor/net.4/grad_cv", "z-layers/phasor/net.9/wgrad_mean", "phasor/all/grad_cv"} <= phasor


if __name__ == "__main__":
    run(sys.argv[1], devices=2, out=sys.argv[2])
