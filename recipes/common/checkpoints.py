"""``--ckpt_path``, checked before training: one error line naming the file and what differs.

A recipe checkpoint records the model's hyperparameters (``save_hyperparameters``), so a checkpoint
of another norm, QK-norm, architecture or head size is named by the options that differ; weights
that still do not fit (another ``--model.arch_kwargs`` or a hand-edited file) by their first
keys and shapes. An unreadable file (truncated, not a checkpoint) is named by
:func:`lightning_mrs.callbacks.checkpoint_file.read_checkpoint`, NormSwap's own reader.

A recipe states what each of its options is to a resumed run in one table, option ->
:data:`DEFINES_MODEL` (a checkpoint trained with another value is refused: the model would not be
the same) or :data:`MAY_CHANGE` (a new value applies from the resumed step on and is named in one
notice line); a new option is one line there. :class:`OptionsRecord` keeps the run's values in its
checkpoints, and :func:`check_resume` compares them with the resumed run's.

Example:
    >>> rules = {"--model.norm": DEFINES_MODEL, "--model.lr": MAY_CHANGE}
    >>> print(compare_options("last.ckpt", rules, {"--model.norm": "mrs", "--model.lr": 0.1},
    ...                       {"--model.norm": "mrs", "--model.lr": 0.003}))
    note: resuming last.ckpt with options that differ from the checkpoint's, from its step on: --model.lr 0.003 -> 0.1
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from lightning.pytorch.callbacks import Callback
from torch import nn
from typing_extensions import override

from lightning_mrs.callbacks.checkpoint_file import SHARD_METADATA, read_checkpoint
from recipes.common.errors import UsageError

__all__ = ["DEFINES_MODEL", "MAY_CHANGE", "MODEL_OPTIONS", "OptionsRecord", "check_checkpoint", "check_resume",
           "compare_options", "read_resume_checkpoint", "saved_options"]

#: an option whose value decides the model: resuming a checkpoint trained with another value is an error
DEFINES_MODEL = "defines the model"
#: an option a resumed run may change: named in one notice line, applied from the resumed step on
MAY_CHANGE = "may change on resume"

#: the image classifier's ``--model.*`` options that decide the weights' names and shapes
MODEL_OPTIONS = ("arch", "norm", "qk_norm", "num_classes", "cifar_stem", "arch_kwargs")
_SHOWN = 3


class OptionsRecord(Callback):
    """Keeps the run's option values (``{"--trainer.max_steps": 400, ...}``) in every checkpoint it writes.

    Example:
        >>> OptionsRecord({"--trainer.max_steps": 400}).state_dict()
        {'options': {'--trainer.max_steps': 400}}
    """

    def __init__(self, options: Mapping[str, Any]) -> None:
        self.options = dict(options)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"options": dict(self.options)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass  # the resumed run's own options are the ones to record from now on


def saved_options(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """The option values a checkpoint was trained with: ``--model.*`` from its hyperparameters, ``--data.*``
    from its data module's, and what :class:`OptionsRecord` kept (which takes precedence)."""
    found = {f"--model.{k}": v for k, v in (checkpoint.get("hyper_parameters") or {}).items()}
    found.update({f"--data.{k}": v for k, v in (checkpoint.get("datamodule_hyper_parameters") or {}).items()})
    record = (checkpoint.get("callbacks") or {}).get(OptionsRecord.__qualname__) or {}
    found.update(record.get("options") or {})
    return found


def read_resume_checkpoint(path: str) -> dict[str, Any]:
    """The checkpoint at ``path``: a ``.ckpt`` file, or the directory of shards ModelParallelStrategy writes
    (its metadata, without the weights); an unreadable one is a usage error naming it. Memory-mapped: the
    tensors (the optimizer state) stay in the file unless used; use the result, then drop it."""
    target = os.path.join(path, SHARD_METADATA) if os.path.isdir(path) else path
    if os.path.isdir(path) and not os.path.isfile(target):
        raise UsageError(f"--ckpt_path {path}: a directory without {SHARD_METADATA}, so not the checkpoint of a "
                         "sharded run; pass the .ckpt file (or directory) Lightning wrote.")
    return _read(target)


def _read(path: str) -> dict[str, Any]:
    """The ``--ckpt_path`` file, memory-mapped; an unreadable one is a usage error naming it."""
    try:
        return read_checkpoint(path, "cpu", owner="--ckpt_path", mmap=True)
    except (FileNotFoundError, ValueError) as err:
        raise UsageError(str(err)) from None


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def compare_options(path: str, rules: Mapping[str, str], current: Mapping[str, Any],
                    saved: Mapping[str, Any]) -> Optional[str]:
    """Refuse a :data:`DEFINES_MODEL` option that differs; the notice line naming the :data:`MAY_CHANGE` ones.

    Options the checkpoint did not record (an older recipe) are not compared.

    Raises:
        UsageError: the checkpoint was trained with other values of options that define the model.
    """
    def differs(option: str) -> bool:
        return option in saved and option in current and _same(saved[option]) != _same(current[option])

    defining = [o for o, rule in rules.items() if rule == DEFINES_MODEL and differs(o)]
    if defining:
        named = ", ".join(f"{o} {_show(saved[o])} (this run: {_show(current[o])})" for o in defining)
        raise UsageError(f"--ckpt_path {path}: the checkpoint was trained with {named}, which define the model; pass "
                         "the values it was trained with (its config.yaml is in the run's directory) or start a new "
                         "run without --ckpt_path.")
    changed = [o for o, rule in rules.items() if rule == MAY_CHANGE and differs(o)]
    if not changed:
        return None
    return (f"note: resuming {path} with options that differ from the checkpoint's, from its step on: "
            + ", ".join(f"{o} {_show(saved[o])} -> {_show(current[o])}" for o in changed))


def _same(value: Any) -> Any:
    """A value in a comparable form (a YAML list and a tuple are the same betas; no overrides, ``{}`` or
    ``None``, are the same config)."""
    if isinstance(value, (list, tuple)):
        return tuple(_same(v) for v in value)
    if isinstance(value, Mapping):
        return tuple(sorted((k, _same(v)) for k, v in value.items())) or None
    return value


def _weights_mismatch(where: str, checkpoint: Mapping[str, Any], model: nn.Module) -> None:
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


def check_resume(path: str, model: nn.Module, rules: Mapping[str, str], current: Mapping[str, Any]) -> Optional[str]:
    """:func:`compare_options` of the checkpoint at ``path`` with this run's ``current`` options, then its
    weights' names and shapes against ``model`` (a sharded checkpoint's weights are checked as they load).

    Returns:
        The notice line naming the options that may change and did, or ``None``.

    Raises:
        UsageError: an unreadable checkpoint, options that define the model differ, or weights that do not fit.
    """
    checkpoint = read_resume_checkpoint(path)
    notice = compare_options(os.fspath(path), rules, current, saved_options(checkpoint))
    if not os.path.isdir(path):
        _weights_mismatch(f"--ckpt_path {os.fspath(path)}", checkpoint, model)
    return notice


def check_checkpoint(path: str, model: nn.Module, hparams: Any,
                     current: Optional[Mapping[str, Any]] = None) -> Optional[str]:
    """Refuse ``path`` unless its weights load into ``model`` (whose saved hyperparameters are ``hparams``).

    Args:
        current: this run's values of the options that may change on resume (``{"--data.batch_size": 16}``).

    Returns:
        The notice line naming the ``current`` options that differ from the checkpoint's, or ``None``.

    Raises:
        UsageError: the file is unreadable, or was trained with other ``--model.*`` options, or its
            weights' names or shapes differ from this run's model.
    """
    checkpoint = _read(path)
    where = f"--ckpt_path {os.fspath(path)}"
    saved = checkpoint.get("hyper_parameters") or {}
    differ = [f"--model.{k} {saved[k]!r} (this run: {hparams.get(k)!r})" for k in MODEL_OPTIONS
              if k in saved and saved[k] != hparams.get(k)]
    if differ:
        raise UsageError(f"{where}: the checkpoint was trained with {', '.join(differ)}; pass the options it was "
                         "trained with (its config.yaml is in the run's directory) or another checkpoint.")
    _weights_mismatch(where, checkpoint, model)
    current = current or {}
    return compare_options(os.fspath(path), dict.fromkeys(current, MAY_CHANGE), current, saved_options(checkpoint))
