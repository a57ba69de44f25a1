"""What defines a cell's computation besides the grid axes: ``settings.json`` and its comparison on resume.

A rerun into an existing ``--out`` must have the same settings (else its cells would mix), and a norm
sweep's settings keep their historical keys so older ``--out`` directories resume. A folder whose texts
name a file of ``recipes/`` that has since moved is told so, with the fix. Needs no torch.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any, Optional

__all__ = ["SETTINGS_FILE", "SPLIT_SEED", "VAL_FRACTION", "changed", "load", "sweep_settings"]

SETTINGS_FILE = "settings.json"
#: the split of digits and of a folder without train/ and val/: a fixed share of each class held out
VAL_FRACTION, SPLIT_SEED = 0.2, 0
_STRATIFIED = f"stratified per class, {100 * VAL_FRACTION:g} % held out for validation, split seed {SPLIT_SEED}"
_SPLITS = {
    "digits": _STRATIFIED,
    "cifar100": "the official 50000 training / 10000 test images (test used for validation)",
    "folder": f"the folder's train/ and val/, or without them {_STRATIFIED}",
    "synthetic": "generated training and validation sets",
    "stdlib": "the standard library's files split by file (recipes/text/data.py: 10 % of the files held out, split "
              "seed 0); random training windows, a fixed set of validation windows",
    "text": "the text files in --path split by file (recipes/text/data.py: 10 % of the files held out, split seed 0; "
            "one file: cut in two); random training windows, a fixed set of validation windows",
}
_KEEP = ("dataset", "image_size", "augment", "arch", "arch_kwargs", "cifar_stem", "epochs", "max_steps", "warmup_frac",
         "schedule", "weight_decay", "accelerator", "precision", "mrs_backend", "val_every", "limit_val_batches",
         "log_every", "synthetic_train_size", "synthetic_val_size")


def sweep_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Everything that defines what a cell computes, except the grid axes."""
    settings = {k: getattr(args, k) for k in _KEEP}
    if settings["precision"] is None:
        settings["precision"] = "32-true" if args.accelerator == "cpu" else "auto: bf16-mixed/16-mixed on GPUs"
    if args.dataset in ("folder", "text"):
        settings["root"] = os.path.abspath(args.root)
    settings.update(args.sweep.extra_settings(args))
    settings.update(optimizer=args.sweep.optimizer_text, split=_SPLITS[args.dataset], devices=1)
    return settings


def load(out: Path) -> Optional[dict[str, Any]]:
    """The settings recorded in ``out``, ``None`` when there are none yet."""
    path = out / SETTINGS_FILE
    return json.loads(path.read_text()) if path.exists() else None


def changed(old: dict[str, Any], new: dict[str, Any]) -> str:
    """What differs between recorded and current settings, as ``key: old there, new now; ...`` ('' if nothing).

    A text that differs only in the name of a file of ``recipes/`` (moved when ``recipes/`` was regrouped,
    issue 47: same computation) says so and how to resume.
    """
    diff = {k: (old.get(k), v) for k, v in new.items() if old.get(k) != v}
    text = "; ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in diff.items())
    renamed: dict[str, str] = {}
    for a, b in diff.values():
        if not (isinstance(a, str) and isinstance(b, str) and _FILE.sub("", a) == _FILE.sub("", b)):
            return text
        renamed.update((x, y) for x, y in zip(_FILE.findall(a), _FILE.findall(b)) if x != y)
    replace = ", ".join(f"{x} with {y}" for x, y in sorted(renamed.items()))
    return text + (f" - only files of recipes/ that have moved since (same computation): to resume, replace {replace} "
                   f"in its {SETTINGS_FILE}" if renamed else "")


_FILE = re.compile(r"recipes/[\w/]+\.py")  # a file of recipes/ named in a setting's text
