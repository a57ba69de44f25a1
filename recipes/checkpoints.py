"""``--ckpt_path``, checked before training: one error line naming the file and what differs.

A recipe checkpoint records the model's hyperparameters (``save_hyperparameters``), so a checkpoint
of another norm, QK-norm, architecture or head size is named by the options that differ; weights
that still do not fit (another ``--model.arch_kwargs`` or a hand-edited file) by their first
keys and shapes. An unreadable file (truncated, not a checkpoint) is named by
:func:`lightning_mrs.callbacks.checkpoint_file.read_checkpoint`, NormSwap's own reader.
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from lightning_mrs.callbacks.checkpoint_file import read_checkpoint
from recipes.errors import UsageError

__all__ = ["MODEL_OPTIONS", "check_checkpoint"]

#: the ``--model.*`` options that decide the weights' names and shapes
MODEL_OPTIONS = ("arch", "norm", "qk_norm", "num_classes", "cifar_stem", "arch_kwargs")
_SHOWN = 3


def check_checkpoint(path: str, model: nn.Module, hparams: Any) -> None:
    """Refuse ``path`` unless its weights load into ``model`` (whose saved hyperparameters are ``hparams``).

    Raises:
        UsageError: the file is unreadable, or was trained with other ``--model.*`` options, or its
            weights' names or shapes differ from this run's model.
    """
    try:
        checkpoint = read_checkpoint(path, "cpu", owner="--ckpt_path")
    except (FileNotFoundError, ValueError) as err:
        raise UsageError(str(err)) from None
    where = f"--ckpt_path {os.fspath(path)}"
    saved = checkpoint.get("hyper_parameters") or {}
    differ = [f"--model.{k} {saved[k]!r} (this run: {hparams.get(k)!r})" for k in MODEL_OPTIONS
              if k in saved and saved[k] != hparams.get(k)]
    if differ:
        raise UsageError(f"{where}: the checkpoint was trained with {', '.join(differ)}; pass the options it was "
                         "trained with (its config.yaml is in the run's directory) or another checkpoint.")
    weights = checkpoint.get("state_dict")
    if not isinstance(weights, dict):
        raise UsageError(f"{where}: the file holds no 'state_dict' (not a Lightning checkpoint of this recipe).")
    own = model.state_dict()
    lines = [f"missing {k}" for k in own if k not in weights]
    lines += [f"unexpected {k}" for k in weights if k not in own]
    lines += [f"{k} {tuple(weights[k].shape)} (this run: {tuple(v.shape)})" for k, v in own.items()
              if k in weights and hasattr(weights[k], "shape") and tuple(weights[k].shape) != tuple(v.shape)]
    if lines:
        more = f" and {len(lines) - _SHOWN} more" if len(lines) > _SHOWN else ""
        raise UsageError(f"{where}: its weights do not fit this run's model: {'; '.join(lines[:_SHOWN])}{more}; pass "
                         "the --model.* options it was trained with (its config.yaml) or another checkpoint.")
