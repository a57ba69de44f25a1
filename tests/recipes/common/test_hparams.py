"""Runs in TensorBoard's HParams dashboard: a tiny stress sweep served by a real ``tensorboard``
(its HTTP API lists the cells with their settings and final metrics), and the HParamsSummary callback
against what the run logged."""

from __future__ import annotations

import math
import signal
from pathlib import Path

import lightning.pytorch as pl
import pytest
from torch import nn

from helpers import ROOT
from helpers.lightning import fit, image_data
from helpers.recording_logger import RecordingLogger
from helpers.scripts import results_rows, run_script
from helpers.tensorboard import get_json, post_json, tensorboard_server, time_series_groups
from lightning_mrs import MRSNorm2d
from lightning_mrs.callbacks import GradientHomogeneityMonitor
from recipes.common.hparams import CLASSIFIER_SUMMARY, HParamsSummary, flatten_params, log_hparams

GRID = ["--dataset", "digits", "--norms", "layer", "mrs", "--lrs", "0.1", "--batch-sizes", "16", "--seeds", "0",
        "--max-steps", "3", "--log-every", "1", "--mrs-backend", "eager", "--accelerator", "cpu", "--jobs", "1"]
ALL_STATUSES = ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"]


def _sessions(base: str) -> list[dict]:
    body = {"experimentName": "", "allowedStatuses": ALL_STATUSES, "colParams": [], "startIndex": 0, "sliceSize": 100}
    return post_json(f"{base}/data/plugin/hparams/session_groups", body).get("sessionGroups", [])


@pytest.mark.slow  # idle 2 cores: 10-45 s; the default suite keeps a faster sibling
def test_sweep_cells_in_the_hparams_dashboard(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    proc = run_script(ROOT / "recipes" / "stress.py", [*GRID, "--out", str(out)], timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["norm"]: r for r in results_rows(out)}

    with tensorboard_server(out / "tb", lambda base: len(_sessions(base)) == 2) as base:
        plugins = get_json(f"{base}/data/plugins_listing")
        assert plugins["hparams"]["enabled"], plugins["hparams"]
        experiment = post_json(f"{base}/data/plugin/hparams/experiment", {"experimentName": ""})
        hparams = {h["name"] for h in experiment["hparamInfos"]}
        assert {"sweep", "norm", "lr", "batch_size", "seed", "arch", "dataset", "precision", "max_steps",
                "optimizer", "image_size"} <= hparams, hparams
        metrics = [m["name"]["tag"] for m in experiment["metricInfos"]]
        assert metrics == ["z-final/final_top1", "z-final/best_top1", "z-final/final_val_loss",
                           "z-final/final_train_loss", "z-final/diverged", "z-final/mean_grad_cv",
                           "z-final/mean_starved_frac"]
        groups = _sessions(base)
        assert sorted(g["hparams"]["norm"] for g in groups) == ["layer", "mrs"]
        for group in groups:
            row = rows[group["hparams"]["norm"]]
            assert group["hparams"]["lr"] == 0.1 and group["hparams"]["batch_size"] == 16
            assert group["hparams"]["precision"] == "32-true" and group["hparams"]["arch"] == row["arch"]
            values = {m["name"]["tag"]: m["value"] for m in group["metricValues"]}
            assert set(values) == set(metrics)
            for column in ("final_top1", "best_top1", "final_val_loss", "mean_grad_cv", "mean_starved_frac"):
                assert values[f"z-final/{column}"] == pytest.approx(float(row[column]), rel=1e-5), column
            assert values["z-final/diverged"] == 0.0
            assert all(m["trainingStep"] == 3 for m in group["metricValues"])

        # no empty hp_metric; the Time Series: the result, summaries, train/*, val/*, the run's summary, layers
        series = get_json(f"{base}/data/plugin/timeseries/tags")
        tags = [t for tags in series["scalars"]["runTagInfo"].values() for t in tags]
        assert "hp_metric" not in tags and "epoch" not in tags
        assert [g for g, _ in time_series_groups(tags)] == ["accuracy", "phasor", "train", "val", "z-final",
                                                           "z-layers"]


def net() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), MRSNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, 5))


def test_summary_reduces_what_was_logged(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rec = RecordingLogger()
    tb = TensorBoardLogger(tmp_path, name="run", default_hp_metric=False)
    summary = {"z-final/train_loss": ("train/loss", "last"), "z-final/best_loss": ("train/loss", "min"),
               "z-final/mean_grad_cv": ("phasor/all/grad_cv", "mean"), "z-final/max_ratio":
               ("phasor/all/grad_max_ratio", "max"), "z-final/diverged": ("train/loss", "nonfinite"),
               "z-final/max_logit": ("attention/all/logit_max", "max")}  # no attention: not logged
    hp = HParamsSummary(summary, extra={"study": "unit"})
    fit(net, steps=4, logger=[tb, rec], data=image_data(16, (6, 6)), callbacks=[GradientHomogeneityMonitor(), hp])

    loss = [v for _, v in sorted(rec.history["train/loss"].items())]
    cv = list(rec.history["phasor/all/grad_cv"].values())
    ratio = list(rec.history["phasor/all/grad_max_ratio"].values())
    expected = {"z-final/train_loss": loss[-1], "z-final/best_loss": min(loss),
                "z-final/mean_grad_cv": sum(cv) / len(cv), "z-final/max_ratio": max(ratio), "z-final/diverged": 0.0}
    assert rec.history.keys() >= expected.keys() and "z-final/max_logit" not in rec.history  # every logger got them
    acc = EventAccumulator(tb.log_dir)
    acc.Reload()
    for tag, value in expected.items():
        (event,) = acc.Scalars(tag)
        assert event.step == 4 and event.value == pytest.approx(value, rel=1e-6), tag
    from tensorboard.plugins.hparams import metadata

    content = acc.PluginTagToContent("hparams")
    start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
    assert start.hparams["study"].string_value == "unit" and start.hparams["max_steps"].number_value == 4
    exp = metadata.parse_experiment_plugin_data(content[metadata.EXPERIMENT_TAG])
    assert [m.name.tag for m in exp.metric_infos] == list(summary)  # every column, measured or not
    assert hp.state_dict()["series"]["train/loss"]["count"] == len(loss)


def test_summary_checks_its_table() -> None:
    with pytest.raises(ValueError, match=r"summary\['x'\] must be \(logged tag, reduction\) with a reduction in"):
        HParamsSummary({"x": ("val/top1", "median")})
    assert set(CLASSIFIER_SUMMARY) >= {"z-final/top1", "z-final/best_top1", "z-final/val_loss", "z-final/diverged",
                                       "z-final/mean_grad_cv", "z-final/mean_starved_frac", "z-final/max_logit"}
    assert flatten_params({"a": {"b": True}, "_private": 1, "c": math.pi}) == {"a/b": "True", "c": math.pi}


class _StopAt(pl.Callback):
    """Raises ``error`` after ``step`` optimizer steps (Ctrl-C is a KeyboardInterrupt)."""

    def __init__(self, step: int, error: BaseException) -> None:
        self.step, self.error = step, error

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            raise self.error


def _session(log_dir: str) -> tuple[dict, str, dict]:
    """(hyperparameters, session status, final metrics) of the HParams session in ``log_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import api_pb2, metadata

    acc = EventAccumulator(log_dir)
    acc.Reload()
    content = acc.PluginTagToContent("hparams")
    start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
    end = metadata.parse_session_end_info_plugin_data(content[metadata.SESSION_END_INFO_TAG])
    params = {k: (v.string_value or v.number_value) for k, v in start.hparams.items()}
    finals = {tag: acc.Scalars(tag)[-1] for tag in acc.Tags()["scalars"] if tag.startswith("z-final/")}
    return params, api_pb2.Status.Name(end.status), finals


@pytest.mark.parametrize("error, ended", [(KeyboardInterrupt(), "interrupted"), (RuntimeError("boom"), "failed: RuntimeError")])
def test_an_interrupted_or_failed_fit_keeps_its_session(tmp_path: Path, error: BaseException, ended: str) -> None:
    from lightning.pytorch.loggers import TensorBoardLogger

    rec = RecordingLogger()
    tb = TensorBoardLogger(tmp_path, name="run", default_hp_metric=False)
    summary = {"z-final/train_loss": ("train/loss", "last"), "z-final/best_loss": ("train/loss", "min")}
    handler = signal.getsignal(signal.SIGINT)  # Lightning ignores Ctrl-C from then on: restored below
    try:
        with pytest.raises(SystemExit if isinstance(error, KeyboardInterrupt) else RuntimeError):
            fit(net, steps=6, logger=[tb, rec], data=image_data(16, (6, 6)), batch_size=2,
                callbacks=[HParamsSummary(summary), _StopAt(3, error)])
    finally:
        signal.signal(signal.SIGINT, handler)
    params, status, finals = _session(tb.log_dir)
    assert params["ended"] == ended and status == "STATUS_FAILURE"
    loss = [v for _, v in sorted(rec.history["train/loss"].items())]
    assert 0 < len(loss) < 6  # the steps logged before the interruption, not a whole run
    assert finals["z-final/train_loss"].value == pytest.approx(loss[-1], rel=1e-6)
    assert finals["z-final/best_loss"].value == pytest.approx(min(loss), rel=1e-6)
    assert finals["z-final/train_loss"].step == 3


def test_a_completed_fit_is_a_successful_session(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import TensorBoardLogger

    tb = TensorBoardLogger(tmp_path, name="run", default_hp_metric=False)
    fit(net, steps=2, logger=tb, data=image_data(16, (6, 6)), callbacks=[HParamsSummary({"z-final/loss": ("train/loss", "last")})])
    params, status, _ = _session(tb.log_dir)
    assert params["ended"] == "completed" and status == "STATUS_SUCCESS"


def test_log_hparams_checks_the_status() -> None:
    with pytest.raises(ValueError, match=r"log_hparams: status must be 'success' or 'failure', got 'ok'"):
        log_hparams([], {}, {}, status="ok")
