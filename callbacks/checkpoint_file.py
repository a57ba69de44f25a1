"""Reading a Lightning checkpoint file with one error that names the file and what is wrong.

``NormSwap.restore`` reads its checkpoints with :func:`read_checkpoint`, and the recipes read
``--ckpt_path`` with it, so a missing, empty, truncated or foreign file reads the same everywhere.
:func:`read_metadata` and :func:`load_weights` take ModelParallelStrategy's (FSDP2's) directory of
shards as well as a file: the metadata from its ``meta.pt``, the weights consolidated into an
unsharded model in one process (no process group).

Files are read with ``torch.load(weights_only=True)``: tensors and plain data only, so a downloaded
checkpoint cannot run code while it is read; readers of the record, the options or the weights pass
``mmap=True``, so the optimizer state stays on disk. Only an archive that is not whole (truncated,
damaged) or a pickle that does not unpickle is called "truncated or corrupted" / "not a torch checkpoint
file"; a ``map_location`` this machine lacks says so, and other errors stay torch's. NormSwap's record
is plain data, and so is what Lightning writes (weights, loops, optimizer and callback states,
``hyper_parameters`` of plain values). A file that holds other Python objects (e.g. an OmegaConf
``hyper_parameters``, a custom class) is refused with a message naming it and the opt-in,
``weights_only=False``, which only a file from a trusted source should get: unpickling runs whatever
code the file names.
"""

from __future__ import annotations

import os
import pickle
import re
import struct
import zipfile
from typing import Any, NoReturn, Optional, Union

import torch

__all__ = ["SHARD_METADATA", "is_sharded", "load_weights", "read_checkpoint", "read_metadata"]

#: what ModelParallelStrategy writes beside its shards (Lightning's ``_METADATA_FILENAME``)
SHARD_METADATA = "meta.pt"


def read_checkpoint(path: Union[str, os.PathLike], map_location: Any = "cpu", *,
                    owner: str = "NormSwap.restore", weights_only: bool = True,
                    opt_in: str = "weights_only=False", mmap: bool = False) -> dict[str, Any]:
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
        mmap: ``torch.load``'s: the tensors stay in the file (memory-mapped) until used, so reading
            the record or the weights never reads the optimizer state. Only while the file is not
            rewritten: use the result, then drop it.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file is not a checkpoint (empty, truncated or corrupted, not a torch file, not a dict),
            holds objects that ``weights_only=True`` refuses (naming them and ``opt_in``), or ``map_location``
            names a device this machine lacks. Other errors (a class a trusted load cannot import) are torch's.

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
    with open(path, "rb") as f:
        zipped = f.read(4) == b"PK\x03\x04"  # torch.save writes a zip archive (older torch: a bare pickle)
    try:  # mmap: tensors stay in the file until used (a record or the weights, not the optimizer state, are read)
        checkpoint = torch.load(path, map_location=map_location, weights_only=weights_only, mmap=mmap and zipped)
    except Exception as err:  # noqa: BLE001 - sorted below: only unpickling and archive errors are the file's fault
        _raise_unreadable(path, zipped, err, map_location, owner=owner, weights_only=weights_only, opt_in=opt_in)
    if not isinstance(checkpoint, dict):
        raise ValueError(f"{owner}: {os.fspath(path)} holds a {type(checkpoint).__name__}, not a Lightning "
                         "checkpoint (a dict with 'state_dict' and 'callbacks'): save it with trainer.save_checkpoint.")
    return checkpoint


#: what unpickling bytes that are not a (whole) pickle raises, besides pickle.UnpicklingError
_UNPICKLING = (pickle.UnpicklingError, EOFError, IndexError, KeyError, UnicodeDecodeError, struct.error)


def _raise_unreadable(path: Union[str, os.PathLike], zipped: bool, err: Exception, map_location: Any, *, owner: str,
                      weights_only: bool, opt_in: str) -> NoReturn:
    """One error for a failed ``torch.load``: the file's fault (archive, pickle) named as such; a ``map_location``
    this machine cannot serve named as that; anything else (e.g. a class a trusted load cannot import) re-raised."""
    where = f"{owner}: {os.fspath(path)}"
    refused = _refused(err) if weights_only else None
    reason = f"{type(err).__name__}: {refused or str(err).split('. ')[0].strip()}"  # torch's first sentence
    if isinstance(err, RuntimeError) and str(err).startswith("Attempting to deserialize object on"):
        raise ValueError(f"{where}: map_location={map_location!r} names a device this machine does not have "
                         f"({reason}); pass map_location='cpu' or one of its devices.") from None
    if refused is not None and zipped:
        raise ValueError(
            f"{where} holds Python objects other than tensors and plain data ({refused}), which a safe load "
            "(torch.load(weights_only=True)) refuses: unpickling them can run any code. Only if you trust the file's "
            f"source, pass {opt_in}, or allow those classes with torch.serialization.add_safe_globals([...])."
        ) from None
    if not zipped:  # torch read it as a bare pickle (its format before 1.6)
        if isinstance(err, (*_UNPICKLING, ValueError, RuntimeError, MemoryError)):  # what junk makes unpickling raise
            raise ValueError(f"{where} is not a torch checkpoint file ({reason}); pass the .ckpt file that Lightning "
                             "wrote.") from None
        raise err
    archive = _archive(path)
    if archive == "not torch":
        raise ValueError(f"{where} is not a torch checkpoint file (a zip archive without data.pkl); pass the .ckpt "
                         "file that Lightning wrote.") from None
    if archive == "broken" or isinstance(err, _UNPICKLING) or "PytorchStreamReader" in str(err):
        raise ValueError(f"{where} is truncated or corrupted ({reason}); save or copy it again.") from None
    raise err


def _archive(path: Union[str, os.PathLike]) -> str:
    """``"broken"`` (no readable zip directory: truncated or damaged), ``"not torch"`` (a zip without a
    pickle in torch's layout) or ``"ok"``."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, EOFError, ValueError):
        return "broken"
    return "ok" if any(name.endswith("/data.pkl") for name in names) else "not torch"


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
                  weights_only: bool = True, opt_in: str = "weights_only=False", mmap: bool = False) -> dict[str, Any]:
    """The checkpoint dict of a file, or the ``meta.pt`` of a directory of shards (no weights in it);
    the arguments are :func:`read_checkpoint`'s."""
    return read_checkpoint(os.path.join(path, SHARD_METADATA) if is_sharded(path) else path, map_location,
                           owner=owner, weights_only=weights_only, opt_in=opt_in, mmap=mmap)


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
