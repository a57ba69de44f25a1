"""What recipes/lm.py logs: the demo's monitors and learning curve, one CSV row per step, the step bar, notices."""

from __future__ import annotations

import csv
import logging
from pathlib import Path

import pytest
import torch

from helpers import ROOT
from helpers.lm import TINY, LMRun, final_weights
from helpers.tensorboard import event_scalars, time_series_groups

DEMO = ROOT / "recipes" / "configs" / "lm_demo.yaml"
# the demo's model, data and monitors; 4 steps of 4 windows, the monitors every 2
SHORT_DEMO = ["--config", str(DEMO), "--trainer.max_steps", "4", "--trainer.val_check_interval", "2",
              "--trainer.log_every_n_steps", "2", "--outlier.log_every_n_steps", "2", "--monitor.log_every_n_steps", "2",
              "--data.batch_size", "4", "--data.val_windows", "8", "--model.sample_bytes", "4",
              "--trainer.enable_progress_bar", "false"]


def test_a_short_demo_logs_the_outliers_the_homogeneity_and_the_learning_curve_first(tmp_path: Path,
                                                                                     lm: LMRun) -> None:
    status, out = lm([*SHORT_DEMO, "--trainer.default_root_dir", str(tmp_path)])
    assert status == 0, out[-3000:]
    run = tmp_path / "lightning_logs" / "version_0"
    scalars = event_scalars(run)
    outliers = {t for t in scalars if t.startswith("outlier/all/")}
    assert {"outlier/all/absmax", "outlier/all/outlier_ratio", "outlier/all/kurtosis"} <= outliers, sorted(scalars)
    assert [s for s, _ in scalars["outlier/all/absmax"]] == [1, 3]  # every 2 steps, with self.log's
    assert {"phasor/all/grad_cv", "phasor/all/starved_frac"} <= set(scalars)
    assert not [t for t in scalars if t.startswith("attention/")]  # not asked for
    # Time Series' first page: the learning curve, the model's run and the unigram baselines on each chart
    assert time_series_groups(scalars)[0] == ("bpb", ["bpb/train", "bpb/val"])
    assert scalars["bpb/val"] == [(s, pytest.approx(v, abs=1e-6)) for s, v in scalars["val/bpb"]]
    unigram = event_scalars(run / "unigram")
    from recipes.text.corpus import unigram_entropy
    from recipes.text.data import TextDataModule

    dm = TextDataModule(seq_len=128, val_windows=8)
    dm.load()
    for split, data in (("val", dm.val_split.data), ("train", dm.train_split.data)):
        assert [v for _, v in unigram[f"bpb/{split}"]] == pytest.approx([unigram_entropy(data)] * 3, rel=1e-6)
    assert [s for s, _ in unigram["bpb/val"]][0] == 0 and len(unigram["bpb/val"]) == 3  # a line from step 0
    assert "train/epoch" not in scalars and "data/val_unigram_bpb" not in scalars  # no flat or one-point charts
    assert "z-final/max_absmax" in scalars and "z-final/mean_grad_cv" in scalars


@pytest.mark.parametrize("monitors, present, absent", [
    ("[]", [], ["outlier/", "phasor/", "attention/"]),
    ("[attention]", ["attention/all/logit_max"], ["outlier/", "phasor/"]),
])
def test_monitors_switch(tmp_path: Path, lm: LMRun, monitors: str, present: list[str], absent: list[str]) -> None:
    status, out = lm([*TINY, "--model.norm", "none", "--monitors", monitors, "--trainer.default_root_dir",
                      str(tmp_path)])
    assert status == 0, out[-3000:]
    scalars = event_scalars(tmp_path / "lightning_logs" / "version_0")
    assert all(tag in scalars for tag in present), sorted(scalars)
    assert not [t for t in scalars if t.startswith(tuple(absent))]


def test_the_monitors_change_no_number(tmp_path: Path, lm: LMRun) -> None:
    """The monitors observe: the same run with them (every step) and without ends with the same weights."""
    weights = []
    for monitors in ("[outlier, homogeneity, attention]", "[]"):
        root = tmp_path / monitors.strip("[]").replace(", ", "-")
        status, out = lm([*TINY, "--monitors", monitors, "--trainer.default_root_dir", str(root)])
        assert status == 0, out[-3000:]
        weights.append(final_weights(root / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"))
    assert weights[0]["step"] == weights[1]["step"] == 3
    for name, tensor in weights[0]["state_dict"].items():
        assert torch.equal(tensor, weights[1]["state_dict"][name]), name


def test_csv_logger_writes_one_row_per_step(tmp_path: Path, lm: LMRun) -> None:
    status, out = lm([*TINY, "--trainer.logger", "CSVLogger", "--trainer.logger.save_dir", str(tmp_path)])
    assert status == 0, out[-3000:]
    with open(next(tmp_path.rglob("metrics.csv")), newline="") as f:
        rows = list(csv.DictReader(f))
    steps = [row["step"] for row in rows]
    assert len(steps) == len(set(steps)), steps  # the monitors', the lr's and self.log's figures in one row
    assert any(row["train/loss"] and row["outlier/all/absmax"] and row["train/lr/decay"] for row in rows)


def test_the_progress_bar_counts_the_runs_steps(tmp_path: Path, lm: LMRun) -> None:
    i = TINY.index("--trainer.enable_progress_bar")
    args = TINY[:i] + TINY[i + 2:]
    status, out = lm([*args, "--model.norm", "none", "--trainer.default_root_dir", str(tmp_path)])
    assert status == 0, out[-3000:]
    assert "train: 100%" in out and "3/3" in out, out[-3000:]
    assert "/-2" not in out and "Epoch 0/" not in out  # Lightning's own bar: "Epoch 0/-2" for a step-limited run


def test_more_cpu_processes_than_cores_is_one_notice(monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    import recipes.common.training
    from recipes.lm import build_cli

    monkeypatch.setattr(recipes.common.training, "usable_cpus", lambda: 2)
    monkeypatch.setattr("sys.argv", ["lm.py"])
    caplog.set_level(logging.INFO, logger="lightning.pytorch")
    build_cli([*TINY, "--trainer.devices", "4", "--trainer.default_root_dir", str(tmp_path)])  # nothing starts yet
    notes = [m for m in caplog.messages if m.startswith("note: --trainer.devices")]
    assert notes == ["note: --trainer.devices 4 on the CPU starts 4 processes on 2 cores: they share the cores, so "
                     "each step takes longer than with fewer processes (the global batch stays per-device batch x "
                     "processes)."]
    caplog.clear()
    build_cli([*TINY, "--trainer.devices", "2", "--trainer.default_root_dir", str(tmp_path)])
    assert not [m for m in caplog.messages if m.startswith("note: --trainer.devices")]
