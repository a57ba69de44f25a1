"""Reading a Lightning checkpoint file with one error that names the file and what is wrong.

``NormSwap.restore`` reads its checkpoints with :func:`read_checkpoint`, and the recipes read
``--ckpt_path`` with it, so a missing, empty, truncated or foreign file reads the same everywhere.
:func:`read_metadata` and :func:`load_weights` take ModelParallelStrategy's (FSDP2's) directory of
shards as well as a file: the metadata from its ``meta.pt``, the weights consolidated into an
unsharded model in one process (no process group).
"""

from __future__ import annotations

import os
from typing import Any, Union

import torch

__all__ = ["SHARD_METADATA", "is_sharded", "load_weights", "read_checkpoint", "read_metadata"]

#: what ModelParallelStrategy writes beside its shards (Lightning's ``_METADATA_FILENAME``)
SHARD_METADATA = "meta.pt"


def read_checkpoint(path: Union[str, os.PathLike], map_location: Any = "cpu", *,
                    owner: str = "NormSwap.restore") -> dict[str, Any]:
    """``torch.load`` of a Lightning checkpoint, with one error naming ``owner``, the file and what is wrong
    (missing, a directory, empty, truncated, not a torch file, not a dict). The recipes read ``--ckpt_path``
    with it (``owner="--ckpt_path"``).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: anything else that keeps the file from being a checkpoint.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"{owner}: no checkpoint at {os.fspath(path)} (no such file).")
    if os.path.isdir(path):
        raise ValueError(f"{owner}: {os.fspath(path)} is a directory; pass the .ckpt file (or the "
                         f"directory of shards that ModelParallelStrategy writes, with its {SHARD_METADATA}).")
    if os.path.getsize(path) == 0:
        raise ValueError(f"{owner}: {os.fspath(path)} is empty (0 bytes); save or copy it again.")
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as err:  # noqa: BLE001 - torch raises many kinds (RuntimeError, UnpicklingError, EOFError, ...)
        with open(path, "rb") as f:
            zipped = f.read(4) == b"PK\x03\x04"  # torch.save writes a zip archive
        reason = f"{type(err).__name__}: {str(err).split('. ')[0].strip()}"  # torch's first sentence
        what = ("is truncated or corrupted ({}); save or copy it again." if zipped else
                "is not a torch checkpoint file ({}); pass the .ckpt file that Lightning wrote.")
        raise ValueError(f"{owner}: {os.fspath(path)} " + what.format(reason)) from None
    if not isinstance(checkpoint, dict):
        raise ValueError(f"{owner}: {os.fspath(path)} holds a {type(checkpoint).__name__}, not a Lightning "
                         "checkpoint (a dict with 'state_dict' and 'callbacks'): save it with trainer.save_checkpoint.")
    return checkpoint


def is_sharded(path: Union[str, os.PathLike]) -> bool:
    """``path`` is ModelParallelStrategy's directory of shards (it holds :data:`SHARD_METADATA`)."""
    return os.path.isfile(os.path.join(path, SHARD_METADATA))


def read_metadata(path: Union[str, os.PathLike], map_location: Any = "cpu", *, owner: str = "NormSwap.restore") -> dict[str, Any]:
    """The checkpoint dict of a file, or the ``meta.pt`` of a directory of shards (no weights in it)."""
    return read_checkpoint(os.path.join(path, SHARD_METADATA) if is_sharded(path) else path, map_location, owner=owner)


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
