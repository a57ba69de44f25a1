"""A real ``tensorboard`` server on 127.0.0.1 serves the monitor's tags and dashboard layout."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

from helpers.ddp import free_port
from helpers.lightning import fit, image_data
from lightning_mrs import MRSNorm2d
from lightning_mrs.callbacks import GradientHomogeneityMonitor

START_TIMEOUT_S = 90


def net() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), MRSNorm2d(8), nn.ReLU(), nn.Conv2d(8, 6, 3, padding=1),
        nn.BatchNorm2d(6), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 5),
    )


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - localhost only
        return json.loads(response.read().decode())


def test_tensorboard_server_serves_tags_and_layout(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path, name="run")
    fit(net, steps=2, logger=logger, data=image_data(16, (6, 6)), callbacks=[GradientHomogeneityMonitor()])

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(tmp_path), "--host", "127.0.0.1",
         "--port", str(port), "--reload_interval", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}/data/plugin"
    try:
        deadline, scalars = time.monotonic() + START_TIMEOUT_S, {}
        while time.monotonic() < deadline:
            assert server.poll() is None, f"tensorboard exited: {server.stderr.read().decode()[-2000:]}"
            try:
                scalars = _get_json(f"{base}/scalars/tags")
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                scalars = {}
            if any("phasor/all/grad_cv" in tags for tags in scalars.values()):
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"tensorboard did not serve the tags within {START_TIMEOUT_S} s: {scalars}")
        (run,) = [r for r, tags in scalars.items() if "phasor/all/grad_cv" in tags]
        for layer in ("net.1", "net.4", "all"):
            for stat in ("grad_mean", "grad_cv", "starved_frac", "nonfinite"):
                assert HOMOGENEITY.tag(layer, stat) in scalars[run]
        points = _get_json(f"{base}/scalars/scalars?run={run}&tag=phasor/net.1/grad_cv")
        assert [p[1] for p in points] == [0, 1]  # [wall_time, step, value]
        layout = _get_json(f"{base}/custom_scalars/layout")
        (category,) = layout["category"]
        assert category["title"] == "Phasor homogeneity"
        margins = [c["margin"]["series"][0] for c in category["chart"] if "margin" in c]
        assert {"value": "z-layers/phasor/net.4/grad_p50", "lower": "z-layers/phasor/net.4/grad_p05",
                "upper": "z-layers/phasor/net.4/grad_p95"} in margins
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=15)
        server.stderr.close()
