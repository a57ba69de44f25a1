"""The recipe's data module: scikit-learn's digits, image folders, the split, and their one-line errors."""

from __future__ import annotations

import math
import socket
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from helpers.images import write_images
from recipes.cifar100 import CifarCLI
from recipes.vision.classifier import ImageClassifier
from recipes.vision.data import ImageDataModule
from recipes.vision.datasets import digits_images, stratified_split
from recipes.common.errors import UsageError

LAYOUT_HINT = "expected DIR/train/<class>/<image> and DIR/val/<class>/<image>"


@pytest.fixture(scope="module")
def sk_digits() -> tuple[np.ndarray, np.ndarray]:
    d = load_digits()
    return d.images, d.target  # (1797, 8, 8) in 0..16, (1797,)


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to open a network connection fails the test."""

    def refuse(self: socket.socket, *args: object) -> None:
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)


# ------------------------------------------------------------------ digits
@pytest.mark.parametrize("image_size", [8, 13, 32])
def test_digits_images_match_sklearn(image_size: int, sk_digits: tuple[np.ndarray, np.ndarray], offline: None) -> None:
    raw, target = sk_digits
    images, labels = digits_images(image_size)
    assert images.shape == (1797, 3, image_size, image_size) and images.dtype == torch.uint8
    assert labels.dtype == torch.int64 and labels.tolist() == target.tolist()
    assert torch.equal(images[:, 0], images[:, 1]) and torch.equal(images[:, 0], images[:, 2])  # grey
    assert images.min().item() == 0 and images.max().item() == 255  # 0 and 16 map to the ends
    if image_size == 8:  # no resize: exactly the 16 grey levels scaled to 0..255
        expected = torch.from_numpy(np.floor(raw / 16.0 * 255 + 0.5)).to(torch.uint8)  # (1797, 8, 8)
        torch.testing.assert_close(images[:, 0], expected, atol=0, rtol=0)
    else:  # the resized image keeps the scan's mean intensity (bilinear, half-pixel centres)
        mean = images[:, 0].double().mean(dim=(1, 2)) / 255  # (1797,)
        torch.testing.assert_close(mean, torch.from_numpy(raw.mean(axis=(1, 2)) / 16.0), atol=0.03, rtol=0)


def test_stratified_split_is_fixed_stratified_and_seeded(sk_digits: tuple[np.ndarray, np.ndarray]) -> None:
    labels = torch.from_numpy(sk_digits[1])
    train, val = stratified_split(labels, 0.2, seed=0)
    assert (len(train), len(val)) == (1438, 359)  # the sizes the docs state
    assert sorted(train + val) == list(range(1797))  # disjoint and complete
    counts = torch.bincount(labels, minlength=10)
    val_counts = torch.bincount(labels[val], minlength=10)
    for n, k in zip(counts.tolist(), val_counts.tolist()):
        assert k == math.floor(0.2 * n + 0.5)  # each class keeps its share (within half a sample)
        assert abs(k / n - 0.2) <= 0.5 / n
    assert stratified_split(labels, 0.2, seed=0) == (train, val)
    other_train, other_val = stratified_split(labels, 0.2, seed=1)
    assert other_val != val and len(other_val) == len(val)
    assert torch.equal(torch.bincount(labels[other_val], minlength=10), val_counts)


@pytest.mark.parametrize("fraction,expected", [(0.5, [1, 2, 2, 0]), (0.3, [1, 1, 1, 0]), (0.01, [1, 1, 1, 0]), (0.99, [1, 3, 2, 0])])
def test_stratified_split_small_classes(fraction: float, expected: list[int]) -> None:
    labels = [0, 0, 1, 1, 1, 1, 2, 2, 2, 3]  # class 3 has one sample: it can only train
    train, val = stratified_split(labels, fraction, seed=3)
    assert [sum(labels[i] == c for i in val) for c in range(4)] == expected
    assert set(labels[i] for i in train) == {0, 1, 2, 3}  # every class keeps a training sample


def test_digits_module_batches_normalised_and_split(offline: None) -> None:
    dm = ImageDataModule(dataset="digits", batch_size=64, image_size=16, augment=False)
    assert dm.num_classes == 10
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set)) == (1438, 359)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (64, 3, 16, 16) and x.dtype == torch.float32 and y.dtype == torch.int64
    # the training split is standardised by its own statistics: mean 0, std 1 over all its pixels
    xs = torch.stack([dm.train_set[i][0] for i in range(len(dm.train_set))]).double()  # (1438, 3, 16, 16)
    assert abs(xs.mean().item()) < 1e-4 and abs(xs.std().item() - 1) < 1e-3
    # train and validation images are disjoint samples of the bundled set
    train_idx, val_idx = dm.train_set.base.indices, dm.val_set.base.indices
    assert not set(train_idx) & set(val_idx)
    assert ImageDataModule(dataset="digits", split_seed=1).num_classes == 10


def test_digits_augmentation_translates_only() -> None:
    """Each augmented training image is its source shifted by at most image_size // 8 (zero fill)."""
    size = 16
    dm = ImageDataModule(dataset="digits", batch_size=8, image_size=size, augment=True)
    dm.setup("fit")
    base, raw = dm.train_set.base, dm.train_set.base.images  # raw: (1797, 3, S, S) uint8
    pixels = raw[base.indices].double() / 255  # the training split, 0..1
    mean, std = pixels.mean().item(), pixels.std().item()  # its normalisation, computed here
    pad = size // 8
    torch.manual_seed(0)
    shifted = 0
    for i in range(40):
        image = dm.train_set[i][0]  # (3, S, S) normalised
        source = torch.nn.functional.pad(raw[base.indices[i]].double() / 255, (pad,) * 4)  # (3, S+2p, S+2p)
        matches = [(dy, dx) for dy in range(2 * pad + 1) for dx in range(2 * pad + 1)
                   if torch.allclose(image.double(), (source[:, dy:dy + size, dx:dx + size] - mean) / std, atol=1e-5)]
        assert matches, f"sample {i} is not a translation of its source (a flip or another transform?)"
        shifted += (pad, pad) not in matches
    assert shifted > 20  # the translations do happen


def test_no_flip_for_digits_but_flip_for_the_others() -> None:
    def names(dm: ImageDataModule) -> list[str]:
        return [type(t).__name__ for t in dm._transforms(train=True).transforms]

    assert "RandomHorizontalFlip" not in names(ImageDataModule(dataset="digits"))
    assert "RandomHorizontalFlip" in names(ImageDataModule(dataset="synthetic"))
    assert names(ImageDataModule(dataset="digits", augment=False)) == ["ToImage", "ToDtype", "Normalize"]


@pytest.mark.parametrize("dataset", ["cifar100", "digits", "synthetic"])
def test_image_size_applies_to_every_dataset(dataset: str) -> None:
    dm = ImageDataModule(dataset=dataset, image_size=16, batch_size=4, synthetic_train_size=8, synthetic_val_size=8)
    if dataset == "cifar100":  # offline: its transforms on a CIFAR-sized PIL image
        from PIL import Image

        image = Image.new("RGB", (32, 32), (10, 20, 30))
        shapes = {tuple(dm._transforms(train=t)(image).shape) for t in (True, False)}
    else:
        dm.setup("fit")
        shapes = {tuple(dm.train_set[0][0].shape), tuple(dm.val_set[0][0].shape)}
    assert shapes == {(3, 16, 16)}


def test_batch_larger_than_the_data_is_named(tmp_path: Path) -> None:
    for c in range(2):
        write_images(tmp_path / f"c{c}", 3)
    dm = ImageDataModule(dataset="folder", root=str(tmp_path), batch_size=8, val_fraction=0.34)
    with pytest.raises(UsageError, match="--data.batch_size 8 is larger than the 4 training images"):
        dm.setup("fit")


def test_sklearn_missing_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # makes the import fail
    with pytest.raises(UsageError, match="scikit-learn"):
        ImageDataModule(dataset="digits")


# ------------------------------------------------------------------ image folders
def test_folder_train_val_layout(tmp_path: Path, offline: None) -> None:
    for split, n in (("train", 3), ("val", 2)):
        for c, name in enumerate(["cat", "dog", "zebra 2"]):
            write_images(tmp_path / split / name, n, colour=80 * c)
    (tmp_path / "train" / ".cache").mkdir()  # hidden folders are not classes
    dm = ImageDataModule(dataset="folder", root=str(tmp_path), batch_size=2, image_size=16)
    assert dm.num_classes == 3 and dm.classes == ["cat", "dog", "zebra 2"]
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set)) == (9, 6)
    x, y = dm.val_set[5]
    assert x.shape == (3, 16, 16) and x.dtype == torch.float32 and y == 2
    # validation: resize + centre crop, then ImageNet normalisation; the image is one colour
    red = (160 / 255 - 0.485) / 0.229
    torch.testing.assert_close(x[0], torch.full((16, 16), red), atol=1e-5, rtol=0)
    xb, yb = next(iter(dm.train_dataloader()))
    assert xb.shape == (2, 3, 16, 16) and yb.shape == (2,)


def test_folder_single_directory_is_split(tmp_path: Path) -> None:
    for c in range(3):
        write_images(tmp_path / f"c{c}", 5)
    dm = ImageDataModule(dataset="folder", root=str(tmp_path), val_fraction=0.4, split_seed=7, image_size=8,
                         batch_size=2)
    assert dm.num_classes == 3
    dm.setup("fit")
    val_labels = [dm.val_set[i][1] for i in range(len(dm.val_set))]
    assert sorted(val_labels) == [0, 0, 1, 1, 2, 2]  # two of each class's five images
    again = ImageDataModule(dataset="folder", root=str(tmp_path), val_fraction=0.4, split_seed=7, image_size=8,
                            batch_size=2)
    again.setup("fit")
    assert again.val_set.base.indices == dm.val_set.base.indices


@pytest.mark.parametrize("dataset,classes", [("folder", 4), ("digits", 10)])
def test_head_is_sized_to_the_data(dataset: str, classes: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["cifar100.py"])  # pytest's own arguments are not the CLI's
    for c in range(4):
        write_images(tmp_path / f"k{c}", 2)
    cli = CifarCLI(ImageClassifier, ImageDataModule, run=False, args=[
        "--trainer.accelerator", "cpu", "--trainer.logger", "false", "--model.arch", "timm:test_resnet",
        "--data.dataset", dataset, "--data.root", str(tmp_path), "--trainer.default_root_dir", str(tmp_path / "r")])
    assert cli.model.hparams.num_classes == classes
    assert cli.model(torch.randn(2, 3, 32, 32)).shape == (2, classes)


@pytest.mark.parametrize("layout", ["missing", "empty", "class missing from val", "no val", "empty class"])
def test_bad_folder_is_one_line(layout: str, tmp_path: Path, recipe_error: Callable[[list[str]], str]) -> None:
    root = tmp_path / "imgs"
    if layout != "missing":
        root.mkdir()
    if layout in ("class missing from val", "no val"):
        write_images(root / "train" / "a", 1)
        write_images(root / "train" / "b", 1)
    if layout == "class missing from val":
        write_images(root / "val" / "a", 1)
    if layout == "empty class":
        write_images(root / "a", 2)
        (root / "b").mkdir()
        (root / "b" / "notes.txt").write_text("not an image")
    line = recipe_error(["--data.dataset", "folder", "--data.root", str(root), "--trainer.accelerator", "cpu",
                         "--model.arch", "timm:test_resnet"])
    assert LAYOUT_HINT in line and "--data.root" in line
    named = {"missing": root, "empty": root, "class missing from val": root / "val", "no val": root / "val",
             "empty class": root / "b"}[layout]
    assert str(named) in line
    if layout == "class missing from val":
        assert "'b'" in line
