"""The language-model recipe's LightningDataModule: real text, offline, as bytes.

``--data.dataset``:

* ``stdlib`` (default): the ``.py`` files of the running interpreter's standard library
  (outside its test suites and installed packages: :func:`recipes.text.corpus.stdlib_files`;
  734 files, 12.1 MB on CPython 3.11.7), real text nobody here wrote;
* ``text``: your text files, ``--data.path FILE_OR_DIR`` (a folder: every non-hidden file under
  it, each UTF-8 text, or one error line naming the file that is not).

The sorted file list is split into training and validation BY FILE with ``--data.split_seed``
(``--data.val_fraction`` of the files; a single file is cut in two); the sizes, the split and
the Python version go to the log. Bytes are the tokens (vocabulary 256). A sample is a window
of ``seq_len + 1`` consecutive bytes (inputs and their next-byte targets):

* training: windows at uniformly random offsets of the training bytes, an endless stream
  (:class:`RandomWindows`), seeded by the run's seed (``seed_everything``), the process's
  global rank and the batch's index (not the DataLoader worker count); a resumed run continues the stream after the batches
  of the steps it has taken, so it sees exactly the windows the uninterrupted run would have;
  the run's length is ``--trainer.max_steps``, not epochs;
* validation: a fixed set of ``--data.val_windows`` windows at evenly spaced offsets of the
  validation bytes (:class:`FixedWindows`): every validation sees the same bytes.

Example:
    >>> dm = TextDataModule(dataset="stdlib", seq_len=16, batch_size=4, val_windows=8)
    >>> dm.setup("fit")
    >>> batch = next(iter(dm.train_dataloader()))
    >>> batch.shape, batch.dtype, len(dm.val_set)
    (torch.Size([4, 17]), torch.uint8, 8)
"""

from __future__ import annotations

import itertools
import os
import platform
from typing import Any, Iterator, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info
from typing_extensions import override

from recipes.common.errors import UsageError, check_loader_options
from recipes.text.corpus import Split, load_split, stdlib_files, text_files, unigram_entropy
from recipes.text.token_cache import TokenSplit

__all__ = ["TEXT_DATASETS", "FixedWindows", "RandomWindows", "TextDataModule"]

TEXT_DATASETS = ("stdlib", "text")


class RandomWindows(IterableDataset):
    """An endless stream of ``(length,)`` uint8 windows at uniformly random offsets of ``data``, batch by batch.

    Batch ``k``'s ``batch_size`` offsets are drawn from a generator seeded by ``(seed, k)`` alone, and
    DataLoader worker ``w`` of ``W`` serves batches ``w, w + W, ...`` (the DataLoader takes the workers'
    batches in turn); so batch ``k`` of the run is a function of ``seed``, ``batch_size`` and ``k``, not of
    the worker count (a CPU and a GPU machine, whose default counts differ, train the same windows; a run
    resumed with another ``--data.num_workers`` goes on as the uninterrupted one). ``start_batch`` starts the
    stream at batch ``k``: a run resumed after ``k`` batches gets exactly the windows an uninterrupted run
    would have had next.
    """

    def __init__(self, data: torch.Tensor, length: int, seed: int, batch_size: int = 1, start_batch: int = 0) -> None:
        if data.numel() < length:
            raise ValueError(f"RandomWindows: {data.numel()} bytes are fewer than one window of {length}")
        if batch_size < 1 or start_batch < 0:
            raise ValueError(f"RandomWindows: batch_size must be >= 1 and start_batch >= 0, got {batch_size}, "
                             f"{start_batch}")
        self.data, self.length, self.seed = data, length, seed
        self.batch_size, self.start_batch = batch_size, start_batch

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        high = self.data.numel() - self.length + 1
        g = torch.Generator()
        for batch in itertools.count(self.start_batch + worker, workers):  # the DataLoader asks worker 0 first
            g.manual_seed((self.seed * 1_000_003 + batch) % 2**63)
            for start in torch.randint(0, high, (self.batch_size,), generator=g).tolist():
                yield _window(self.data, start, self.length)  # (length,), or with its target bytes


class FixedWindows(Dataset):
    """``count`` windows of ``length`` bytes at evenly spaced offsets of ``data`` (first and last included)."""

    def __init__(self, data: torch.Tensor, length: int, count: int) -> None:
        if data.numel() < length:
            raise ValueError(f"FixedWindows: {data.numel()} bytes are fewer than one window of {length}")
        self.data, self.length = data, length
        self.starts = torch.linspace(0, data.numel() - length, count).round().long().tolist()

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> Any:
        return _window(self.data, self.starts[index], self.length)  # (length,), or with its target bytes


def _window(data: Union[torch.Tensor, TokenSplit], start: int, length: int) -> Any:
    """Bytes ``start : start + length``; of a tokenized split, ``(tokens, bytes their targets cover)``."""
    return data.window(start, length) if isinstance(data, TokenSplit) else data[start:start + length]


class TextDataModule(pl.LightningDataModule):
    """Byte windows of the standard library's sources or of your text files (see the module docstring).

    Args:
        dataset: ``stdlib`` (the interpreter's standard library ``.py`` files) or ``text``
            (``path``).
        path: ``text``: a UTF-8 text file or a folder of them (recursively; hidden files skipped).
        seq_len: bytes the model sees per sample (each window holds ``seq_len + 1``).
        batch_size: windows per device and step; the global batch is this times the number of
            processes (and gradient-accumulation steps).
        val_fraction: share of the files held out for validation (of the bytes, for one file).
        split_seed: seed of the split by file (same seed, same split everywhere).
        val_windows: validation windows (evenly spaced over the validation bytes; fixed).
        num_workers: DataLoader worker processes per device; ``None``: 0 on the CPU (the model
            needs the cores), else 2 (windows are slices of a tensor in memory: cheap).
        tokenizer: where the tokenizer comes from (the recipe links it to ``--model.pretrained``):
            the text is tokenized with it once into memory-mapped token files cached beside the
            data (:mod:`recipes.text.token_cache`) and a window is ``seq_len + 1`` tokens; ``None``
            (or a byte model's directory without a tokenizer): bytes.
        cache_dir: where the token files go; ``None``: a hidden ``.lightning_mrs_tokens`` folder
            beside ``--data.path`` (for ``stdlib``, and where that is not writable:
            ``$LIGHTNING_MRS_CACHE/tokens``, else ``~/.cache/lightning_mrs/tokens``).

    Raises:
        UsageError: a bad option; (when the data is loaded) a missing path, a folder without
            files, a file that is not text, or too little text for ``seq_len``: one line each.
    """

    def __init__(
        self,
        dataset: Literal["stdlib", "text"] = "stdlib",
        path: Optional[str] = None,
        seq_len: int = 128,
        batch_size: int = 32,
        val_fraction: float = 0.1,
        split_seed: int = 0,
        val_windows: int = 256,
        num_workers: Optional[int] = None,
        tokenizer: Optional[str] = None,
        cache_dir: Optional[str] = None,
    ) -> None:
        super().__init__()
        if dataset not in TEXT_DATASETS:
            raise UsageError(f"--data.dataset {dataset!r} is not valid; choose one of {list(TEXT_DATASETS)}.")
        if dataset == "text" and not path:
            raise UsageError("--data.dataset text needs --data.path FILE_OR_DIR (your UTF-8 text files).")
        if dataset == "stdlib" and path:
            raise UsageError(f"--data.path {path!r} is only read with --data.dataset text; drop it or add "
                             "--data.dataset text.")
        for name, value, low in (("seq_len", seq_len, 1), ("batch_size", batch_size, 1), ("val_windows", val_windows, 1)):
            if value < low:
                raise UsageError(f"--data.{name} must be >= {low}, got {value}.")
        check_loader_options(val_fraction, num_workers)
        self.save_hyperparameters()
        self.dataset, self.path, self.seq_len, self.batch_size = dataset, path, seq_len, batch_size
        self.val_fraction, self.split_seed, self.val_windows = val_fraction, split_seed, val_windows
        self.num_workers = num_workers
        self.tokenizer_source, self.cache_dir = tokenizer, cache_dir
        self.tokenizer: Optional[Any] = None  # the loaded tokenizer (None: bytes)
        self.root: Optional[str] = None
        self.train_split: Optional[Split] = None
        self.val_split: Optional[Split] = None
        self.val_set: Optional[FixedWindows] = None

    def describe(self) -> str:
        """Where the text comes from, its sizes and split, for the log (after :meth:`load`)."""
        assert self.train_split is not None and self.val_split is not None
        tr, va = self.train_split, self.val_split
        source = (f"stdlib of Python {platform.python_version()} ({self.root})" if self.dataset == "stdlib"
                  else f"text {self.root}")
        n = len(set(tr.files) | set(va.files))
        how = "one file cut in two" if n == 1 else f"split by file, seed {self.split_seed}"
        if isinstance(va.data, TokenSplit):
            unit = "tokens"
            tokens = (f"; {len(tr.data) + len(va.data):,} tokens ({(tr.nbytes + va.nbytes) / max(len(tr.data) + len(va.data), 1):.2f} "
                      f"bytes/token, {type(self.tokenizer).__name__} of {self.tokenizer_source})")
            unigram = va.data.unigram_bpb()
        else:
            unit, tokens, unigram = "bytes", "", unigram_entropy(va.data)
        return (f"data: {source}: {n} files, {(tr.nbytes + va.nbytes) / 1e6:.2f} MB{tokens}; {how}: train "
                f"{len(tr.files)} files {tr.nbytes / 1e6:.2f} MB, val {len(va.files)} files {va.nbytes / 1e6:.3f} MB "
                f"(unigram {unigram:.2f} bits/byte); windows of {self.seq_len} + 1 {unit}")

    def load(self) -> None:
        """Read and check the text and split it (once; the recipe calls it before the trainer is built)."""
        if self.train_split is not None:
            return
        if self.dataset == "stdlib":
            self.root, files = stdlib_files()
        else:
            self.root, files = os.path.abspath(self.path), text_files(self.path)
        self._load_tokenizer()
        if self.tokenizer is not None:
            train, val = self._tokenized(files)
        else:
            train, val = load_split(files, self.val_fraction, self.split_seed, check_text=self.dataset == "text")
        need = self.seq_len + 1
        if isinstance(train.data, TokenSplit) and min(len(train.data), len(val.data)) < need:
            raise UsageError(
                f"--data.seq_len {self.seq_len} needs at least {need} tokens in each split, but "
                f"{self.root if self.dataset == 'text' else 'the text'} ({len(files)} file{'s' * (len(files) > 1)}) "
                f"gives training {len(train.data)} and validation {len(val.data)} tokens: add text, lower "
                "--data.seq_len or change --data.val_fraction.")
        if min(train.nbytes, val.nbytes) < need:
            raise UsageError(
                f"--data.seq_len {self.seq_len} needs at least {need} bytes in each split, but "
                f"{self.root if self.dataset == 'text' else 'the text'} ({len(files)} file{'s' * (len(files) > 1)}, "
                f"{train.nbytes + val.nbytes} bytes) gives training {train.nbytes} and validation {val.nbytes} "
                "bytes: add text, lower --data.seq_len or change --data.val_fraction."
            )
        self.train_split, self.val_split = train, val
        self.val_set = FixedWindows(val.data, need, self.val_windows)
        rank_zero_info(self.describe())

    def _load_tokenizer(self) -> None:
        if self.tokenizer_source is not None and self.tokenizer is None:
            from recipes.text.pretrained import load_tokenizer

            self.tokenizer = load_tokenizer(self.tokenizer_source)

    def _cache(self) -> str:
        if self.cache_dir is not None:
            return self.cache_dir
        if self.dataset == "text":
            root = self.root if os.path.isdir(self.root) else os.path.dirname(self.root)
            if os.access(root, os.W_OK):
                return os.path.join(root, ".lightning_mrs_tokens")  # hidden: text_files skips it
        base = os.environ.get("LIGHTNING_MRS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "lightning_mrs")
        return os.path.join(base, "tokens")

    def _tokenized(self, files: list[str]) -> tuple[Split, Split]:
        """The files split as :func:`recipes.text.corpus.load_split` does, tokenized (cached)."""
        from recipes.text.corpus import split_by_file
        from recipes.text.token_cache import tokenize_files

        cache = self._cache()
        try:
            if len(files) == 1:
                whole = tokenize_files(files, self.tokenizer, cache)
                cut = int(round((1.0 - self.val_fraction) * len(whole)))
                return (Split(tuple(files), TokenSplit(whole.tokens[:cut], whole.nbytes[:cut])),
                        Split(tuple(files), TokenSplit(whole.tokens[cut:], whole.nbytes[cut:])))
            train_files, val_files = split_by_file(files, self.val_fraction, self.split_seed)
            return (Split(tuple(train_files), tokenize_files(train_files, self.tokenizer, cache, "tokenizing train")),
                    Split(tuple(val_files), tokenize_files(val_files, self.tokenizer, cache, "tokenizing val")))
        except ValueError as err:  # a file that is not UTF-8 text, a slow tokenizer
            raise UsageError(f"--data: {err}") from None

    @override
    def setup(self, stage: str) -> None:
        self.load()

    def _workers(self) -> int:
        if self.num_workers is not None:
            return self.num_workers
        trainer = self.trainer
        if trainer is None or type(trainer.accelerator).__name__ == "CPUAccelerator":
            return 0
        return 2

    def _loader(self, dataset: Dataset, **kwargs) -> DataLoader:
        workers = self._workers()
        return DataLoader(dataset, batch_size=self.batch_size, num_workers=workers, persistent_workers=workers > 0,
                          pin_memory=torch.cuda.is_available(), **kwargs)

    @override
    def train_dataloader(self) -> DataLoader:
        self.load()
        trainer = self.trainer
        rank = trainer.global_rank if trainer is not None else 0
        # a resumed run continues the stream after the batches of the steps it has taken
        start = trainer.global_step * trainer.accumulate_grad_batches if trainer is not None else 0
        seed = (torch.initial_seed() * 1_000_003 + rank * 10_007) % 2**62
        return self._loader(RandomWindows(self.train_split.data, self.seq_len + 1, seed, self.batch_size, start))

    @override
    def val_dataloader(self) -> DataLoader:
        self.load()
        return self._loader(self.val_set, shuffle=False)
