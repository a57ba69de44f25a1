"""GradientHomogeneityMonitor under 2-process gloo DDP matches one process on the same global batch.

Run as a script (``python tests/test_homogeneity_ddp.py OUT.json``) this file is the DDP job
itself: Lightning's launcher re-runs the same command line for rank 1, and rank 0 writes what
it logged to ``OUT.json``. The test runs that job in a subprocess (isolated from pytest) and
compares it with a single-process run in the test process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_mrs.callbacks import GradientHomogeneityMonitor
from helpers import ROOT
from helpers.recording_logger import RecordingLogger
from lightning_mrs import MRSNorm, MRSNorm2d

GLOBAL_BATCH, STEPS = 8, 3


class Module(pl.LightningModule):
    """Per-sample norms only (MRSNorm2d, GroupNorm, MRSNorm, LayerNorm): no cross-sample stats."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), MRSNorm2d(8, spatial=True), nn.GELU(),
            nn.Conv2d(8, 6, 3, padding=1), nn.GroupNorm(2, 6), nn.GELU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 10), MRSNorm(10), nn.LayerNorm(10),
            nn.Linear(10, 5),
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def run(devices: int) -> dict[str, dict[int, float]]:
    torch.manual_seed(0)
    module = Module()
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 3, 7, 5, generator=gen), torch.randint(0, 5, (32,), generator=gen))
    rec = RecordingLogger()
    trainer = pl.Trainer(
        max_steps=STEPS, accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
        logger=rec, log_every_n_steps=1, callbacks=[GradientHomogeneityMonitor()],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
    )
    # rank r gets samples r, r + 2, ... (Lightning's own sampler would shuffle): each step's two
    # local batches of 4 are together the single-process batch of 8
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    sampler = DistributedSampler(data, num_replicas=devices, rank=rank, shuffle=False)
    trainer.fit(module, DataLoader(data, batch_size=GLOBAL_BATCH // devices, sampler=sampler))
    return rec.history


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_gloo_matches_single_process(tmp_path: Path) -> None:
    out = tmp_path / "ddp.json"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), str(out)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ddp = {tag: {int(k): v for k, v in series.items()} for tag, series in json.loads(out.read_text()).items()}
    single = run(devices=1)
    assert ddp.keys() == single.keys()
    assert {"phasor/net.1/grad_mean", "phasor/net.4/grad_cv", "phasor/net.9/wgrad_mean", "phasor/all/grad_cv"} <= ddp.keys()
    for tag, series in single.items():
        assert ddp[tag].keys() == set(range(STEPS)), tag
        for step, value in series.items():
            assert ddp[tag][step] == pytest.approx(value, rel=1e-4, abs=1e-9), (tag, step)


if __name__ == "__main__":
    history = run(devices=2)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        Path(sys.argv[1]).write_text(json.dumps(history))
