"""Reading a Lightning checkpoint file with one error that names the file and what is wrong.

``NormSwap.restore`` reads its checkpoints with :func:`read_checkpoint`, and the recipes read
``--ckpt_path`` with it, so a missing, empty, truncated or foreign file reads the same everywhere.
:func:`read_metadata` and :func:`load_weights` take ModelParallelStrategy's (FSDP2's) directory of
shards as well as a file: the metadata from its ``meta.pt``, the weights consolidated into an
unsharded model in one process (no process group).

Files are read with ``torch.load(weights_only=True)``: tensors and plain data only, so a downloaded
checkpoint cannot run code while it is read. NormSwap's record is plain data, and so is what
Lightning writes (weights, loops, optimizer and callback states, ``hyper_parameters`` of plain
values). A file that holds other Python objects (e.g. an OmegaConf ``hyper_parameters``, a custom
class) is refused with a message naming it and the opt-in, ``weights_only=False``, which only a
file from a trusted source should get: unpickling runs whatever code the file names.
"""

from __future__ import annotations

import os
import pickle
import re
from typing import Any, Optional, Union

import torch

__all__ = ["SHARD_METADATA", "is_sharded", "load_weights", "read_checkpoint", "read_metadata"]

#: what ModelParallelStrategy writes beside its shards (Lightning's ``_METADATA_FILENAME``)
SHARD_METADATA = "meta.pt"


def read_checkpoint(path: Union[str, os.PathLike], map_location: Any = "cpu", *,
                    owner: str = "NormSwap.restore", weights_only: bool = True,
                    opt_in: str = "weights_only=False") -> dict[str, Any]:
    """``torch.load`` of a Lightning checkpoint, with one error naming ``owner``, the file and what is wrong
    (missing, a directory, empty, truncated, not a torch file, not a dict, objects a safe load refuses).
    The recipes read ``--ckpt_path`` with it (``owner="--ckpt_path"``).

    Args:
        path: the file.
        map_location: passed to ``torch.load``.
        owner: who reads it, the start of every message.
        weights_only: ``torch.load``'s: ``True`` (tensors and plain data only) unless the caller
            trusts the file.
        opt_in: how the caller passes ``weights_only=False``, named in the refusal.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: anything else that keeps the file from being a checkpoint; a file holding
            objects that ``weights_only=True`` refuses, naming them and ``opt_in``.

    Example:
        >>> checkpoint = read_checkpoint("last.ckpt")  # doctest: +SKIP
        >>> checkpoint["state_dict"]  # doctest: +SKIP
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"{owner}: no checkpoint at {os.fspath(path)} (no such file).")
    if os.path.isdir(path):
        raise ValueError(f"{owner}: {os.fspath(path)} is a directory; pass the .ckpt file (or the "
                         f"directory of shards that ModelParallelStrategy writes, with its {SHARD_METADATA}).")
    if os.path.getsize(path) == 0:
        raise ValueError(f"{owner}: {os.fspath(path)} is empty (0 bytes); save or copy it again.")
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=weights_only)
    except Exception as err:  # noqa: BLE001 - torch raises many kinds (RuntimeError, UnpicklingError, EOFError, ...)
        with open(path, "rb") as f:
            zipped = f.read(4) == b"PK\x03\x04"  # torch.save writes a zip archive
        refused = _refused(err) if weights_only else None
        if refused is not None and zipped:
            raise ValueError(
                f"{owner}: {os.fspath(path)} holds Python objects other than tensors and plain data ({refused}), "
                "which a safe load (torch.load(weights_only=True)) refuses: unpickling them can run any code. Only "
                f"if you trust the file's source, pass {opt_in}, or allow those classes with "
                "torch.serialization.add_safe_globals([...])."
            ) from None
        reason = f"{type(err).__name__}: {refused or str(err).split('. ')[0].strip()}"  # torch's first sentence
        what = ("is truncated or corrupted ({}); save or copy it again." if zipped else
                "is not a torch checkpoint file ({}); pass the .ckpt file that Lightning wrote.")
        raise ValueError(f"{owner}: {os.fspath(path)} " + what.format(reason)) from None
    if not isinstance(checkpoint, dict):
        raise ValueError(f"{owner}: {os.fspath(path)} holds a {type(checkpoint).__name__}, not a Lightning "
                         "checkpoint (a dict with 'state_dict' and 'callbacks'): save it with trainer.save_checkpoint.")
    return checkpoint


def _refused(err: BaseException) -> Optional[str]:
    """What a weights-only load refused (torch's ``WeightsUnpickler error: ...``, its first sentence), or
    ``None`` when ``err`` is not such a refusal."""
    if not isinstance(err, pickle.UnpicklingError):
        return None
    found = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\. Please use|\n|$)", str(err))
    return found.group(1).strip().rstrip(".") if found else None


def is_sharded(path: Union[str, os.PathLike]) -> bool:
    """``path`` is ModelParallelStrategy's directory of shards (it holds :data:`SHARD_METADATA`)."""
    return os.path.isfile(os.path.join(path, SHARD_METADATA))


def read_metadata(path: Union[str, os.PathLike], map_location: Any = "cpu", *, owner: str = "NormSwap.restore",
                  weights_only: bool = True, opt_in: str = "weights_only=False") -> dict[str, Any]:
    """The checkpoint dict of a file, or the ``meta.pt`` of a directory of shards (no weights in it);
    the arguments are :func:`read_checkpoint`'s."""
    return read_checkpoint(os.path.join(path, SHARD_METADATA) if is_sharded(path) else path, map_location,
                           owner=owner, weights_only=weights_only, opt_in=opt_in)


def load_weights(model: torch.nn.Module, path: Union[str, os.PathLike], checkpoint: dict[str, Any], strict: bool = True) -> None:
    """Load the weights of ``path`` (what :func:`read_metadata` gave as ``checkpoint``) into the
    unsharded ``model``: a file's ``state_dict``, or a directory's shards gathered into its tensors."""
    if is_sharded(path):
        import torch.distributed.checkpoint as dcp

        state = {"state_dict": model.state_dict()}
        dcp.load(state, checkpoint_id=os.fspath(path), no_dist=True)  # into these tensors, in one process
        model.load_state_dict(state["state_dict"], strict=strict)
    else:
        model.load_state_dict(checkpoint.get("state_dict", checkpoint), strict=strict)
