"""The mistakes of issue 22 §4 through ``recipes/cifar100.py`` as a user runs it: a checkpoint of another
model, a truncated or garbage ``--ckpt_path``, an image folder of one class or with an unreadable image,
fewer than 5 classes, and ``--trainer.precision 16-mixed`` on the CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch

from helpers import ROOT
from helpers.images import write_images
from helpers.scripts import run_script
from helpers.tensorboard import event_scalars
from recipes.vision.classifier import ImageClassifier

SCRIPT = ROOT / "recipes" / "cifar100.py"
BASE = ["--trainer.accelerator", "cpu", "--model.arch", "timm:test_resnet", "--data.dataset", "digits",
        "--trainer.enable_progress_bar", "false"]


def _checkpoint(path: Path, **model: object) -> Path:
    """A checkpoint as the recipe writes it (its weights and hyperparameters), of the given classifier."""
    m = ImageClassifier(**{"arch": "timm:test_resnet", "num_classes": 10, **model})
    torch.save({"state_dict": m.state_dict(), "hyper_parameters": dict(m.hparams), "epoch": 0}, path)
    return path


def _make(kind: str, tmp: Path) -> Path:
    if kind == "other norm":
        return _checkpoint(tmp / "layer.ckpt", norm="layer")
    if kind == "other arch":
        return _checkpoint(tmp / "resnet10t.ckpt", arch="timm:resnet10t")
    if kind == "other weights":  # same options, weights edited: named by key and shape
        path = _checkpoint(tmp / "edited.ckpt")
        ckpt = torch.load(path, weights_only=False)
        key = next(k for k in ckpt["state_dict"] if k.endswith("fc.weight"))
        ckpt["state_dict"][key] = torch.zeros(7, 3)
        torch.save(ckpt, path)
        return path
    if kind == "truncated":
        path = _checkpoint(tmp / "cut.ckpt")
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
        return path
    path = tmp / "garbage.ckpt"
    path.write_bytes(b"not a checkpoint at all\n" * 40)
    return path


CKPT_CASES = {
    "other norm": ["the checkpoint was trained with --model.norm 'layer' (this run: 'mrs')", "config.yaml"],
    "other arch": ["--model.arch 'timm:resnet10t' (this run: 'timm:test_resnet')"],
    "other weights": ["its weights do not fit this run's model", "fc.weight (7, 3) (this run: (10,"],
    "truncated": ["is truncated or corrupted", "save or copy it again"],
    "garbage": ["is not a torch checkpoint file", "pass the .ckpt file that Lightning wrote"],
}


# one case in the default suite (14 s each on 2 idle cores), the others with -m slow
@pytest.mark.parametrize("kind", [k if k == "truncated" else pytest.param(k, marks=pytest.mark.slow) for k in CKPT_CASES])
def test_bad_checkpoint_is_one_line(kind: str, tmp_path: Path, error_line: Callable[[int, str], str]) -> None:
    path = _make(kind, tmp_path)
    proc = run_script(SCRIPT, [*BASE, "--ckpt_path", str(path), "--trainer.default_root_dir", str(tmp_path / "r")],
                      timeout=300, warnings=True)
    line = error_line(proc.returncode, proc.stdout + proc.stderr)
    assert str(path) in line and "--ckpt_path" in line
    for needle in CKPT_CASES[kind]:
        assert needle in line, line


def test_single_class_folder_is_one_line(tmp_path: Path, error_line: Callable[[int, str], str]) -> None:
    write_images(tmp_path / "imgs" / "cats", 4)
    proc = run_script(SCRIPT, [*BASE, "--data.dataset", "folder", "--data.root", str(tmp_path / "imgs"),
                               "--trainer.default_root_dir", str(tmp_path / "r")], timeout=300, warnings=True)
    line = error_line(proc.returncode, proc.stdout + proc.stderr)
    assert "one class folder ('cats')" in line and "at least 2 classes" in line and str(tmp_path / "imgs") in line


def test_unreadable_image_is_skipped_and_named_and_no_top5_under_5_classes(tmp_path: Path) -> None:
    root = tmp_path / "imgs"
    for c, name in enumerate(("a", "b", "c")):
        write_images(root / "train" / name, 6, colour=80 * c)
        write_images(root / "val" / name, 2, colour=80 * c)
    bad = root / "train" / "b" / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10)  # a PNG signature, then nothing readable
    proc = run_script(SCRIPT, [*BASE, "--data.dataset", "folder", "--data.root", str(root), "--data.batch_size", "19",
                               "--trainer.max_epochs", "1", "--trainer.default_root_dir", str(tmp_path / "r")],
                      timeout=300, warnings=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    warned = [line for line in out.splitlines() if "skipped the unreadable image" in line]
    assert warned and all(str(bad) in line for line in warned) and "1 skipped so far" in warned[0], out[-3000:]
    scalars = event_scalars(tmp_path / "r" / "lightning_logs" / "version_0")
    assert "val/top1" in scalars and "val/top5" not in scalars  # 3 classes: top-5 would always be 100 %
    assert scalars["train/epoch"]  # one epoch of 18 readable images went through (a batch of 19 minus the broken)


def test_fp16_on_the_cpu_is_real_fp16_with_a_scaler(tmp_path: Path) -> None:
    proc = run_script(SCRIPT, [*BASE, "--trainer.precision", "16-mixed", "--trainer.max_steps", "1",
                               "--data.image_size", "16", "--data.batch_size", "16", "--trainer.log_every_n_steps", "1",
                               "--trainer.limit_val_batches", "1", "--trainer.default_root_dir", str(tmp_path)],
                      timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "precision 16-mixed on the CPU: float16 autocast with a GradScaler" in out
    assert "bfloat16" not in out  # Lightning's own warning about running bf16 instead
    scalars = event_scalars(tmp_path / "lightning_logs" / "version_0")
    # the monitor logs the GradScaler's scale: there is one (65536 to start, torch's default)
    assert scalars["phasor/all/loss_scale"][0][1] == 65536.0


def test_more_cpu_processes_than_cores_is_one_notice_in_the_image_recipe(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    import logging

    import recipes.common.training
    from recipes.cifar100 import build_cli

    monkeypatch.setattr(recipes.common.training, "usable_cpus", lambda: 2)
    monkeypatch.setattr("sys.argv", ["cifar100.py"])
    caplog.set_level(logging.INFO, logger="lightning.pytorch")
    args = ["--trainer.accelerator", "cpu", "--model.arch", "timm:test_resnet", "--data.dataset", "synthetic",
            "--trainer.default_root_dir", str(tmp_path)]
    build_cli([*args, "--trainer.devices", "4"])  # nothing starts yet
    assert [m for m in caplog.messages if m.startswith("note: --trainer.devices")] == [
        "note: --trainer.devices 4 on the CPU starts 4 processes on 2 cores: they share the cores, so each step "
        "takes longer than with fewer processes (the global batch stays per-device batch x processes)."]
    caplog.clear()
    build_cli([*args, "--trainer.devices", "2"])
    assert not [m for m in caplog.messages if m.startswith("note: --trainer.devices")]
