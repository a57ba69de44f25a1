"""The language-model recipe's text on disk: which files, split how, read as bytes.

* :func:`stdlib_files`: the ``.py`` source files of the standard library of the running
  interpreter (``sysconfig.get_paths()["stdlib"]``), walked in sorted order. Left out: the
  test suites (any directory named ``test``, ``tests`` or ``idle_test``: mostly generated
  or adversarial code, a third of the tree), installed packages (``site-packages``,
  ``dist-packages``: not the standard library, and they differ from machine to machine) and
  ``__pycache__``. ``idlelib`` itself stays: it is ordinary library code. On CPython 3.11.7
  that is 734 files, 12.1 MB.
* :func:`text_files`: a user's file, or every regular file under a user's directory
  (recursively, sorted; hidden files and directories, named ``.*``, are skipped). Each must be
  UTF-8 text: a binary file (a NUL byte, or not UTF-8) is an error naming it, never skipped.
* :func:`split_by_file`: a seeded shuffle of the file list puts ``ceil(val_fraction * n)``
  files (at least one) in validation and the rest in training, so no file is in both. A
  single file is cut in two instead: its first ``1 - val_fraction`` in training, the rest
  (from the next line start) in validation.
* :func:`read_bytes`: the files concatenated as they are (no separator: source files end with
  a newline) into one ``uint8`` tensor; bytes are the tokens (vocabulary 256).

Example:
    >>> root, files = stdlib_files()
    >>> train, val = split_by_file(files, val_fraction=0.1, seed=0)
    >>> len(train) + len(val) == len(files), set(train).isdisjoint(val)
    (True, True)
"""

from __future__ import annotations

import math
import os
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, Union

import torch

from recipes.common.errors import UsageError

__all__ = ["STDLIB_EXCLUDED_DIRS", "Split", "cut_single", "load_split", "read_bytes", "split_by_file", "stdlib_files",
           "text_files", "unigram_entropy"]

#: directory names left out of ``--data.dataset stdlib`` (see the module docstring)
STDLIB_EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class Split:
    """One side of the split: the files it draws from and their bytes (``data``: ``(L,)`` uint8), or
    their tokens (a :class:`recipes.text.token_cache.TokenSplit`)."""

    files: tuple[str, ...]
    data: Any

    @property
    def nbytes(self) -> int:
        total = getattr(self.data, "total_bytes", None)
        return int(total) if total is not None else int(self.data.numel())


def stdlib_files() -> tuple[str, list[str]]:
    """The standard library's root and its ``.py`` files (sorted, absolute; see the module docstring)."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in STDLIB_EXCLUDED_DIRS)
        out += [os.path.join(folder, f) for f in sorted(files) if f.endswith(".py")]
    if not out:
        raise UsageError(f"--data.dataset stdlib: no .py files under {root} (this interpreter ships without "
                         "its standard library sources); use --data.dataset text --data.path FILE_OR_DIR.")
    return root, out


def text_files(path: Union[str, Path]) -> list[str]:
    """``path`` itself, or every non-hidden regular file under the directory ``path`` (sorted).

    Raises:
        UsageError: ``path`` does not exist, or the directory holds no file.
    """
    path = os.path.abspath(path)
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise UsageError(f"--data.path {path}: no such file or directory; give a text file or a folder of them.")
    out = []
    for folder, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        out += [os.path.join(folder, f) for f in sorted(files)
                if not f.startswith(".") and os.path.isfile(os.path.join(folder, f))]
    if not out:
        raise UsageError(f"--data.path {path}: the folder holds no text files (hidden files are skipped); "
                         "put UTF-8 text files in it or point --data.path at one.")
    return out


def _check_text(path: str, raw: bytes) -> None:
    where = raw.find(b"\x00")  # valid UTF-8, but no text file holds a NUL
    if where < 0:
        try:
            raw.decode("utf-8")
            return
        except UnicodeDecodeError as err:
            where = err.start
    raise UsageError(f"--data.path: {path} is not UTF-8 text (a binary byte at offset {where}); remove it "
                     "from the folder, convert it to UTF-8, or point --data.path elsewhere.")


def read_bytes(files: Sequence[str], check_text: bool = True) -> torch.Tensor:
    """The files' bytes, concatenated in order, as a ``(L,)`` uint8 tensor (each checked to be text)."""
    chunks = []
    for path in files:
        with open(path, "rb") as f:
            raw = f.read()
        if check_text:
            _check_text(path, raw)
        chunks.append(raw)
    joined = b"".join(chunks)
    return torch.frombuffer(bytearray(joined), dtype=torch.uint8) if joined else torch.empty(0, dtype=torch.uint8)


def split_by_file(files: Sequence[str], val_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Training and validation files (each list in the input's order) from a seeded shuffle.

    Raises:
        ValueError: fewer than two files (:func:`load_split` cuts a single file instead).
    """
    if len(files) < 2:
        raise ValueError("split_by_file needs at least two files")
    order = list(range(len(files)))
    random.Random(seed).shuffle(order)
    n_val = min(len(files) - 1, max(1, math.ceil(val_fraction * len(files))))
    val = set(order[:n_val])
    return [f for i, f in enumerate(files) if i not in val], [f for i, f in enumerate(files) if i in val]


def cut_single(data: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One file's bytes cut at the first line start after ``(1 - val_fraction)`` of them."""
    cut = int(round((1.0 - val_fraction) * data.numel()))
    newlines = (data[cut:] == ord("\n")).nonzero()
    if newlines.numel():
        cut += int(newlines[0]) + 1
    return data[:cut], data[cut:]


def load_split(files: Sequence[str], val_fraction: float, seed: int, check_text: bool = True) -> tuple[Split, Split]:
    """Read ``files`` and split them into training and validation (see the module docstring)."""
    if len(files) == 1:
        train, val = cut_single(read_bytes(files, check_text), val_fraction)
        return Split(tuple(files), train), Split(tuple(files), val)
    train_files, val_files = split_by_file(files, val_fraction, seed)
    return (Split(tuple(train_files), read_bytes(train_files, check_text)),
            Split(tuple(val_files), read_bytes(val_files, check_text)))


def unigram_entropy(data: torch.Tensor) -> float:
    """Entropy of the byte frequencies of ``data`` in bits per byte (the bpb of a model without context)."""
    counts = torch.bincount(data.long(), minlength=256).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log2()).sum())
