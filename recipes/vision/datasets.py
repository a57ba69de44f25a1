"""The offline image sources of the recipe's data module: scikit-learn's digits and an image folder.

* :func:`digits_images`: the 1,797 handwritten digits bundled with scikit-learn
  (``sklearn.datasets.load_digits``: real 8x8 grey scans with 16 grey levels, 10 classes, read
  from the installed package, never downloaded), resized to ``image_size`` and repeated to 3
  channels.
* :func:`scan_folder`: checks a user's ``torchvision.datasets.ImageFolder`` layout and finds its
  classes, with one-line errors (:class:`recipes.common.errors.UsageError`) naming the directory and the
  expected layout.
* :func:`stratified_split`: the fixed, seeded, per-class train/validation split used for digits
  and for a single image folder.

Example:
    >>> images, labels = digits_images(image_size=16)
    >>> images.shape, images.dtype, labels.shape
    (torch.Size([1797, 3, 16, 16]), torch.uint8, torch.Size([1797]))
    >>> train, val = stratified_split(labels, val_fraction=0.2, seed=0)
    >>> len(train), len(val)
    (1438, 359)
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from recipes.common.errors import UsageError

__all__ = ["FolderLayout", "TensorImages", "digits_images", "image_folder", "require_sklearn_digits", "scan_folder", "stratified_split"]

FOLDER_LAYOUT = (
    "expected DIR/train/<class>/<image> and DIR/val/<class>/<image> with the same classes, "
    "or DIR/<class>/<image> split by --data.val_fraction"
)


def stratified_split(labels: Sequence[int] | torch.Tensor, val_fraction: float,
                     seed: int) -> tuple[list[int], list[int]]:
    """A fixed, seeded train/validation split that keeps each class's share.

    Each class with ``n`` samples sends ``floor(val_fraction * n + 0.5)`` of them (at least one
    and at most ``n - 1`` when ``n >= 2``; none when ``n == 1``) to validation, chosen by a
    permutation drawn from ``seed``. The same labels and seed give the same split on every
    machine; the digits (``val_fraction=0.2``) split into 1,438 training and 359 validation images.

    Args:
        labels: the class of every sample.
        val_fraction: share of each class held out, in (0, 1).
        seed: seed of the permutation.

    Returns:
        ``(train_indices, val_indices)``, each sorted.
    """
    if not 0.0 < val_fraction < 1.0:
        raise UsageError(f"--data.val_fraction must lie in (0, 1), got {val_fraction}.")
    labels = torch.as_tensor(labels, dtype=torch.long)  # (N,)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(labels), generator=g)  # one permutation, read per class
    train: list[int] = []
    val: list[int] = []
    for cls in torch.unique(labels).tolist():
        members = order[labels[order] == cls].tolist()  # this class, in permuted order
        n = len(members)
        n_val = min(max(math.floor(val_fraction * n + 0.5), 1), n - 1) if n >= 2 else 0
        val += members[:n_val]
        train += members[n_val:]
    return sorted(train), sorted(val)


def require_sklearn_digits() -> Callable[[], Any]:
    """``sklearn.datasets.load_digits``, or a one-line :class:`UsageError` naming the package."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise UsageError(
            "--data.dataset digits needs the package scikit-learn (its bundled digits): pip install scikit-learn"
        ) from None
    return load_digits


def digits_images(image_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled handwritten digits as ``uint8`` RGB images.

    The 8x8 scans (ink high, background 0, 16 grey levels) are scaled to 0..1, resized
    bilinearly to ``image_size`` and repeated over 3 identical channels.

    Args:
        image_size: height and width of the returned images.

    Returns:
        ``(images, labels)``: ``(1797, 3, S, S)`` uint8 and ``(1797,)`` int64 (digits 0..9).

    Raises:
        UsageError: scikit-learn is not installed.
    """
    digits = require_sklearn_digits()()
    x = torch.from_numpy(digits.images).float()[:, None] / 16.0  # (1797, 1, 8, 8), 0..1
    if image_size != 8:
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    images = (x.clamp(0, 1) * 255 + 0.5).to(torch.uint8).expand(-1, 3, -1, -1).contiguous()  # (N, 3, S, S)
    return images, torch.from_numpy(digits.target).long()


class TensorImages(Dataset):
    """``(image, label)`` pairs from an image tensor, optionally restricted to ``indices``.

    Args:
        images: ``(N, C, H, W)`` images.
        labels: ``(N,)`` classes.
        indices: the samples of this split.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, indices: Sequence[int]) -> None:
        self.images, self.labels = images, labels
        self.indices = list(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        i = self.indices[index]
        return self.images[i], int(self.labels[i])


@dataclass(frozen=True)
class FolderLayout:
    """What :func:`scan_folder` found: the class names and where training/validation images live.

    ``val_dir`` is ``None`` for a single folder (split by ``--data.val_fraction``).
    """

    classes: tuple[str, ...]
    train_dir: str
    val_dir: Optional[str]


def image_folder(path: str, classes: Sequence[str]) -> Dataset:
    """torchvision's ``ImageFolder`` over ``path`` with exactly ``classes`` (hidden folders skipped).

    ``ImageFolder`` alone would take every subfolder (``.ipynb_checkpoints`` too) as a class.
    """
    from torchvision.datasets import ImageFolder

    class _Folder(ImageFolder):
        def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
            return list(classes), {name: i for i, name in enumerate(classes)}

    return _Folder(path)


def _class_dirs(path: str) -> list[str]:
    return sorted(e.name for e in os.scandir(path) if e.is_dir() and not e.name.startswith("."))


def _has_image(path: str) -> bool:
    from torchvision.datasets.folder import IMG_EXTENSIONS

    for _, _, files in os.walk(path, followlinks=True):  # ImageFolder also walks subfolders
        if any(f.lower().endswith(IMG_EXTENSIONS) for f in files):
            return True
    return False


def _classes_of(path: str, root: str) -> tuple[str, ...]:
    classes = _class_dirs(path)
    if not classes:
        raise UsageError(f"--data.root {root!r}: no class folders in {path}; {FOLDER_LAYOUT}.")
    empty = [c for c in classes if not _has_image(os.path.join(path, c))]
    if empty:
        raise UsageError(f"--data.root {root!r}: no images in {os.path.join(path, empty[0])} "
                         f"(image files: .jpg, .png, ...); {FOLDER_LAYOUT}.")
    return tuple(classes)


def scan_folder(root: Optional[str]) -> FolderLayout:
    """Check an ImageFolder layout under ``root`` and return its classes.

    ``root/train`` and ``root/val`` (both, with the same class folders) give a fixed split;
    otherwise every folder of ``root`` is a class, split later by ``--data.val_fraction``.
    Hidden folders (``.name``) are ignored. Every class folder needs at least one image.

    Raises:
        UsageError: the root is missing or empty, a class has no images, or ``train/`` and
            ``val/`` disagree; the one-line message names the directory and the layout.
    """
    if not root:
        raise UsageError(f"--data.dataset folder needs --data.root DIR; {FOLDER_LAYOUT}.")
    path = os.path.abspath(root)
    if not os.path.isdir(path):
        raise UsageError(f"--data.root {root!r}: no such directory ({path}); {FOLDER_LAYOUT}.")
    train_dir, val_dir = os.path.join(path, "train"), os.path.join(path, "val")
    has_train, has_val = os.path.isdir(train_dir), os.path.isdir(val_dir)
    if not (has_train or has_val):
        return FolderLayout(_classes_of(path, root), path, None)
    if not (has_train and has_val):
        missing = val_dir if has_train else train_dir
        raise UsageError(f"--data.root {root!r}: {missing} is missing; {FOLDER_LAYOUT}.")
    classes, val_classes = _classes_of(train_dir, root), _classes_of(val_dir, root)
    if classes != val_classes:
        only_train = sorted(set(classes) - set(val_classes))
        if only_train:
            raise UsageError(f"--data.root {root!r}: class {only_train[0]!r} of {train_dir} is missing from "
                             f"{val_dir}; {FOLDER_LAYOUT}.")
        extra = sorted(set(val_classes) - set(classes))[0]
        raise UsageError(f"--data.root {root!r}: class {extra!r} of {val_dir} is missing from {train_dir}; "
                         f"{FOLDER_LAYOUT}.")
    return FolderLayout(classes, train_dir, val_dir)
