"""Text tokenized once into memory-mapped token files, cached beside the data.

A pretrained model reads its own tokenizer's ids, and a corpus larger than memory cannot be held
as a tensor. :func:`tokenize_files` encodes a list of text files with a Hugging Face tokenizer
into two flat arrays, memory-mapped from ``<cache>/<key>/``:

* ``tokens.bin``: the token ids, ``uint16`` when the vocabulary fits, else ``uint32``;
* ``bytes.bin``: for each token, the UTF-8 bytes of text its end moves past (``uint32``): the
  bytes a run of tokens covers is the sum over it, exactly (it telescopes), which is what bits
  per *byte* divides by, whatever the tokenizer (:func:`covered_bytes`).

Each file is encoded on its own (no token spans two files) and followed by the tokenizer's EOS
token when it has one (a file boundary the model sees; it covers no bytes). The key is a hash of
the files (path, size, modification time) and of the tokenizer (its serialised vocabulary and
rules, or its class, name and vocabulary), so a changed file or tokenizer gives a new cache and
an unchanged one is read back without encoding anything. Encoding shows a progress bar; the
arrays are written to a temporary directory and renamed into place, so an interrupted run leaves
no half cache behind.

Example:
    >>> from tokenizers import Tokenizer, models, pre_tokenizers  # doctest: +SKIP
    >>> split = tokenize_files(["a.txt"], tokenizer, "cache")  # doctest: +SKIP
    >>> split[0:4], split.covered_bytes(0, len(split)) == os.path.getsize("a.txt")  # doctest: +SKIP
    (tensor([17, 5, 230, 9]), True)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, Union

import numpy as np
import torch
from tqdm.auto import tqdm

__all__ = ["TokenSplit", "tokenize_files", "tokenizer_key"]

_FORMAT = 1


@dataclass(frozen=True)
class TokenSplit:
    """A tokenized list of files: ``tokens`` (ids) and ``nbytes`` (the bytes each token covers),
    both ``(n,)`` numpy memory maps, read a window at a time (nothing is loaded whole).

    ``split[a:b]`` is the ids of tokens ``a:b`` as an int64 tensor.
    """

    tokens: np.ndarray
    nbytes: np.ndarray

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def numel(self) -> int:
        """The number of tokens (as a tensor's ``numel``: the recipe's windows read either)."""
        return len(self)

    def __getitem__(self, index: slice) -> torch.Tensor:
        return torch.from_numpy(np.asarray(self.tokens[index], dtype=np.int64))

    def covered_bytes(self, start: int, stop: int) -> int:
        """The UTF-8 bytes of text covered by tokens ``start:stop``."""
        return int(np.asarray(self.nbytes[start:stop], dtype=np.int64).sum())

    @property
    def total_bytes(self) -> int:
        return self.covered_bytes(0, len(self))

    def unigram_bpb(self) -> float:
        """Bits per byte of a model that predicts every token by its frequency here (ignoring the context)."""
        counts = np.bincount(np.asarray(self.tokens, dtype=np.int64)).astype(np.float64)
        counts = counts[counts > 0]
        p = counts / counts.sum()
        return float(-(counts * np.log2(p)).sum() / max(self.total_bytes, 1))

    def window(self, start: int, length: int) -> tuple[torch.Tensor, int]:
        """Tokens ``start : start + length`` and the bytes their targets (all but the first) cover."""
        return self[start:start + length], self.covered_bytes(start + 1, start + length)


def tokenizer_key(tokenizer: Any) -> str:
    """What identifies a tokenizer's encoding: its serialised fast tokenizer (vocabulary, merges,
    normalisation) where it has one, else its class, name and vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        text = backend.to_str()
    else:
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        text = json.dumps([type(tokenizer).__qualname__, getattr(tokenizer, "name_or_path", ""),
                           sorted(vocab.items())])
    eos = getattr(tokenizer, "eos_token_id", None)
    return hashlib.sha256(f"{text}\0{eos}".encode()).hexdigest()[:16]


def _files_key(files: Sequence[str]) -> str:
    h = hashlib.sha256()
    for path in files:
        stat = os.stat(path)
        h.update(f"{os.path.abspath(path)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _encode(text: str, tokenizer: Any) -> tuple[list[int], list[int]]:
    """Token ids and the bytes each one's end moves past (from the tokenizer's character offsets)."""
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoding["input_ids"], encoding["offset_mapping"]
    # byte position of every character boundary: UTF-8 lengths, cumulated
    char_bytes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    widths = 1 + (char_bytes >= 0x80) + (char_bytes >= 0x800) + (char_bytes >= 0x10000)
    ends = np.concatenate([[0], np.cumsum(widths)])  # (chars + 1,)
    nbytes, previous = [], 0
    for _, end in offsets:
        position = max(previous, int(ends[end]))  # offsets of sub-character tokens may repeat
        nbytes.append(position - previous)
        previous = position
    if ids:
        nbytes[-1] += int(ends[-1]) - previous  # text after the last token's end (stripped spaces)
    return ids, nbytes


def tokenize_files(files: Sequence[str], tokenizer: Any, cache_dir: Union[str, Path], desc: str = "tokenizing") -> TokenSplit:
    """``files`` encoded with ``tokenizer`` into a cached :class:`TokenSplit` (see the module docstring).

    Raises:
        ValueError: the tokenizer gives no character offsets (a slow, non-``Fast`` tokenizer), or
            a file is not UTF-8 text.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"{type(tokenizer).__name__} is not a fast tokenizer: bits per byte need the character offsets "
                         "of each token (AutoTokenizer.from_pretrained(..., use_fast=True))")
    vocab = len(tokenizer)
    dtype = np.uint16 if vocab <= np.iinfo(np.uint16).max + 1 else np.uint32
    root = Path(cache_dir) / f"tokens-{_files_key(files)}-{tokenizer_key(tokenizer)}"
    meta_path = root / "meta.json"
    if not meta_path.exists():
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=root.parent))
        try:
            count = _write(files, tokenizer, tmp, dtype, desc)
            (tmp / "meta.json").write_text(json.dumps({"format": _FORMAT, "count": count, "dtype": np.dtype(dtype).name,
                                                       "files": len(files), "vocab": vocab}))
            try:
                tmp.rename(root)
            except OSError:  # another process wrote the same cache first
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    meta = json.loads(meta_path.read_text())
    count = int(meta["count"])
    if not count:  # np.memmap cannot map an empty file
        return TokenSplit(np.zeros(0, meta["dtype"]), np.zeros(0, np.uint32))
    return TokenSplit(np.memmap(root / "tokens.bin", dtype=meta["dtype"], mode="r", shape=(count,)),
                      np.memmap(root / "bytes.bin", dtype=np.uint32, mode="r", shape=(count,)))


def _write(files: Sequence[str], tokenizer: Any, out: Path, dtype: Any, desc: str) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    count = 0
    with open(out / "tokens.bin", "wb") as tok_file, open(out / "bytes.bin", "wb") as byte_file:
        for path in tqdm(files, desc=desc, unit="file", disable=None):
            raw = Path(path).read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{path} is not UTF-8 text (byte {err.start}); give text files only") from err
            ids, nbytes = _encode(text, tokenizer)
            if eos is not None:
                ids, nbytes = [*ids, eos], [*nbytes, 0]
            np.asarray(ids, dtype=dtype).tofile(tok_file)
            np.asarray(nbytes, dtype=np.uint32).tofile(byte_file)
            count += len(ids)
    return count
