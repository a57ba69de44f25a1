"""The sweep on the user's own images: ``--dataset folder --root DIR``, end to end on a tiny generated ImageFolder."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Callable

import pytest

from helpers import ROOT
from helpers.scripts import results_rows, run_script

SCRIPT = ROOT / "recipes" / "stress.py"
CLASSES = ("ants", "bees", "wasps")
_run = partial(run_script, SCRIPT, timeout=400)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """DIR/<class>/*.png: 3 classes of 6 random 12x10 RGB images (no train/ and val/: split by the rule)."""
    from PIL import Image
    import numpy as np

    rng = np.random.default_rng(0)
    root = tmp_path / "images"
    for c, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True)
        for i in range(6):
            pixels = rng.integers(0, 256, (10, 12, 3), dtype=np.uint8) // (c + 1)
            Image.fromarray(pixels).save(root / name / f"{i}.png")
    return root


def test_norm_sweep_on_an_image_folder(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    proc = _run(["--dataset", "folder", "--root", str(folder), "--epochs", "1", "--image-size", "8", "--norms", "mrs",
                 "--lrs", "0.1", "--batch-sizes", "4", "--seeds", "0", "--mrs-backend", "eager", "--jobs", "1",
                 "--accelerator", "cpu", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = results_rows(out)
    # the recipe's split of a single folder: floor(0.2 * 6 + 0.5) = 1 image of each class held out
    assert row["num_classes"] == "3" and row["dataset"] == "folder" and row["arch"] == "resnet18"
    assert row["steps"] == "3" and row["planned_steps"] == "3"  # 15 training images, batches of 4, last dropped
    md = (out / "results.md").read_text()
    assert f"- data: 3 classes (ants, bees, wasps); 15 training and 3 validation images in `{folder}`" in md
    assert "split: `the folder's train/ and val/, or without them stratified per class, 20 % held out" in md
    assert json.loads((out / "settings.json").read_text())["root"] == str(folder)
    assert json.loads((out / "data.json").read_text()) == {"train": 15, "val": 3, "classes": list(CLASSES),
                                                           "root": str(folder)}


@pytest.mark.slow  # idle 2 cores: 10-45 s; the default suite keeps a faster sibling
def test_qk_sweep_on_a_folder_sizes_the_vit_from_the_data(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "qk"
    small = '{"patch_size": 4, "embed_dim": 32, "depth": 1, "num_heads": 2}'  # no img_size: --image-size sets it
    proc = _run(["--sweep", "qk", "--dataset", "folder", "--root", str(folder), "--max-steps", "1", "--image-size",
                 "16", "--arch-kwargs", small, "--qk-norms", "mrs", "--lrs", "0.01", "--batch-sizes", "4", "--seeds",
                 "0", "--log-every", "1", "--mrs-backend", "eager", "--jobs", "1", "--accelerator", "cpu", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = results_rows(out)
    assert row["qk_norm"] == "mrs" and row["num_classes"] == "3" and float(row["max_logit"]) > 0


@pytest.mark.slow  # idle 2 cores: 10-45 s; the default suite keeps a faster sibling
def test_a_folder_sweep_needs_a_budget_and_a_folder(tmp_path: Path, error_line: Callable[[int, str], str]) -> None:
    proc = _run(["--dataset", "folder", "--root", str(tmp_path), "--out", str(tmp_path / "x")], timeout=60)
    assert "--epochs or --max-steps is required for --dataset folder" in error_line(proc.returncode, proc.stderr)
    proc = _run(["--dataset", "folder", "--root", str(tmp_path / "none"), "--epochs", "1", "--out",
                 str(tmp_path / "x")], warnings=True)
    line = error_line(proc.returncode, proc.stderr)
    assert str(tmp_path / "none") in line and "--data." not in line and not (tmp_path / "x").exists()
