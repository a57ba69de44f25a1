"""Every cell's settings checked before the first cell runs: the data once, the model once per arm.

A mistake that would end a cell (a batch size larger than the training set, an unknown ``--arch``,
a model that does not take ``--image-size``, a QK-norm a model cannot take) is found here, so it is
one ``error:`` line and nothing is written: no ``settings.json``, no cell. The checks are cheap: the
data module is set up once, each arm's model is built once (learning rates and seeds do not change
its shape) and runs one forward pass on two blank images. Imports torch.
"""

from __future__ import annotations

import argparse
import os
import warnings
from typing import Any, Sequence

import torch

from recipes.common.errors import UsageError
from recipes.vision.models import check_input_size
from recipes.sweeps.cells.image import build_model, datamodule

__all__ = ["check_cells"]


def check_cells(args: argparse.Namespace, cells: Sequence[tuple[str, float, int, int]]) -> dict[str, Any]:
    """Check the data and every distinct model of ``cells``; raise :class:`UsageError` on the first mistake.

    Returns what the data are (``classes`` for digits and folders, ``train`` and ``val`` sizes, the
    folder's ``root``), for ``results.md``.
    """
    sizes = sorted({bs for _, _, bs, _ in cells})
    dm = datamodule(args, 1)
    dm.prepare_data()
    dm.setup("fit")
    n_train, n_val = len(dm.train_set), len(dm.val_set)  # type: ignore[arg-type]
    if n_val == 0:
        raise UsageError(f"--dataset {args.dataset}: no validation images (--root {args.root!r}); give each class at "
                         "least 2 images, or a val/ folder.")
    too_big = [bs for bs in sizes if bs > n_train]
    if too_big:
        raise UsageError(f"--batch-sizes {' '.join(map(str, too_big))}: larger than the {n_train} training images of "
                         f"--dataset {args.dataset} (the last partial batch is dropped, so such a cell never trains): "
                         "give batch sizes up to that.")
    image = torch.zeros(2, 3, args.image_size, args.image_size)  # (N, 3, S, S)
    for arm in dict.fromkeys(arm for arm, _, _, _ in cells):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = build_model(args, arm, args.lrs[0], dm.num_classes)
        check_input_size(model.model, args.image_size, option="--image-size")
        model.eval()
        try:
            with torch.no_grad():
                logits = model(image)  # (2, num_classes)
        except RuntimeError as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise UsageError(f"--arch {args.arch!r} ({args.sweep.flag} {arm}) cannot run on --image-size "
                             f"{args.image_size} images: {first}. Give a larger --image-size or other --arch-kwargs.")
        if tuple(logits.shape) != (2, dm.num_classes):
            raise UsageError(f"--arch {args.arch!r} gives outputs of shape {tuple(logits.shape)}, not (N, "
                             f"{dm.num_classes}): use a classification model.")
    data: dict[str, Any] = {"train": n_train, "val": n_val}
    if args.dataset in ("digits", "folder"):
        data["classes"] = list(dm.classes)
    if args.dataset == "folder":
        data["root"] = os.path.abspath(args.root)
    return data
