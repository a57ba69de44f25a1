"""A real ``tensorboard`` server on 127.0.0.1 serves the monitor's tags, its dashboard layout, and the
Time Series groups in the order a user reads them (summaries, ``train``, ``val``, then per-layer)."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

from helpers.lightning import fit, image_data
from helpers.tensorboard import compare_tags, get_json, tensorboard_server, time_series_groups
from lightning_mrs import MRSNorm2d
from lightning_mrs.callbacks import GradientHomogeneityMonitor


def net() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), MRSNorm2d(8), nn.ReLU(), nn.Conv2d(8, 6, 3, padding=1),
        nn.BatchNorm2d(6), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 5),
    )


def test_tag_order_is_tensorboards() -> None:
    # the cases of tensorboard/webapp/metrics/utils_test.ts: numbers by value, "/" before other characters
    assert compare_tags("a2b", "a10b") == -1 and compare_tags("a/a", "a+/a") == -1
    assert compare_tags("val/top1", "z-layers/phasor/net.1/grad_cv") == -1
    assert [g for g, _ in time_series_groups(["val/top1", "phasor/all/x", "train/loss", "z-layers/phasor/l/x"])] == [
        "phasor", "train", "val", "z-layers"]


def _has(tag: str):
    def ready(base: str) -> bool:
        return any(tag in tags for tags in get_json(f"{base}/data/plugin/scalars/tags").values())
    return ready


def test_tensorboard_server_serves_tags_and_layout(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path, name="run")
    fit(net, steps=2, logger=logger, data=image_data(16, (6, 6)), callbacks=[GradientHomogeneityMonitor()])

    with tensorboard_server(tmp_path, _has("phasor/all/grad_cv")) as base:
        scalars = get_json(f"{base}/data/plugin/scalars/tags")
        (run,) = [r for r, tags in scalars.items() if "phasor/all/grad_cv" in tags]
        for stat in ("grad_mean", "grad_cv", "starved_frac", "nonfinite"):
            assert f"phasor/all/{stat}" in scalars[run]
            for layer in ("net.1", "net.4"):
                assert f"z-layers/phasor/{layer}/{stat}" in scalars[run]
        points = get_json(f"{base}/data/plugin/scalars/scalars?run={run}&tag=z-layers/phasor/net.1/grad_cv")
        assert [p[1] for p in points] == [0, 1]  # [wall_time, step, value]
        layout = get_json(f"{base}/data/plugin/custom_scalars/layout")
        category, *per_block = layout["category"]
        assert category["title"] == "Phasor homogeneity"
        # each layer's lines in a chart of its block, a few layers each, named in the category's title
        assert [c["title"] for c in per_block] == ["Phasor homogeneity: net.1, net.4"]
        block = {c["title"]: c["multiline"]["tag"] for c in per_block[0]["chart"]}
        assert block["grad_cv: std/mean of G_i (0 = homogeneous)"] == [r"^z-layers/phasor/(net\.1|net\.4)/grad_cv$"]
        margins = [c["margin"]["series"][0] for c in category["chart"] if "margin" in c]
        assert {"value": "z-layers/phasor/net.4/grad_p50", "lower": "z-layers/phasor/net.4/grad_p05",
                "upper": "z-layers/phasor/net.4/grad_p95"} in margins
        multiline = {c["title"]: c["multiline"]["tag"] for c in category["chart"] if "multiline" in c}
        assert multiline["grad_cv: std/mean of G_i (0 = homogeneous)"] == [r"^phasor/all/grad_cv$"]  # the summary

        # Time Series: the summaries (and Lightning's epoch: a plain TensorBoardLogger), train/*, then every
        # per-layer card, histograms too, in one group at the end
        series = get_json(f"{base}/data/plugin/timeseries/tags")
        tags = [t for tags in series["scalars"]["runTagInfo"].values() for t in tags]
        tags += [t for tags in series["histograms"]["runTagInfo"].values() for t in tags]
        groups = dict(time_series_groups(tags))
        assert list(groups) == ["epoch", "phasor", "train", "z-layers"], groups
        assert all(t.startswith("phasor/all/") for t in groups["phasor"])
        assert "z-layers/phasor/net.1/G" in groups["z-layers"]
