"""The language-model recipe's text: file lists, the split by file, the windows, bad input."""

from __future__ import annotations

import itertools
import math
import os
import platform
import sysconfig
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from recipes.common.errors import UsageError
from recipes.text.corpus import (STDLIB_EXCLUDED_DIRS, cut_single, load_split, read_bytes, split_by_file,
                                 stdlib_files, text_files, unigram_entropy)
from recipes.text.data import FixedWindows, RandomWindows, TextDataModule


def _letters_corpus(root: Path, n: int = 10, size: int = 300) -> dict[str, str]:
    """``n`` files, file i made of one letter only (so a window says which files it came from)."""
    root.mkdir(parents=True, exist_ok=True)
    letters = {}
    for i in range(n):
        letter = chr(ord("a") + i)
        (root / f"f{i:02d}.txt").write_text((letter * 49 + "\n") * (size // 50))
        letters[str(root / f"f{i:02d}.txt")] = letter
    return letters


def test_stdlib_files_are_the_interpreters_sources_sorted_and_without_tests() -> None:
    root, files = stdlib_files()
    assert root == sysconfig.get_paths()["stdlib"]
    assert files == stdlib_files()[1]  # deterministic
    assert len(files) > 100 and all(f.endswith(".py") and f.startswith(root) for f in files)
    parts = [set(Path(os.path.relpath(f, root)).parts[:-1]) for f in files]
    assert not any(p & STDLIB_EXCLUDED_DIRS for p in parts)
    assert os.path.join(root, "os.py") in files and os.path.join(root, "json", "decoder.py") in files
    # the walk's order: sorted within each folder, the folder's files before its subfolders
    assert [f for f in files if os.path.dirname(f) == root] == sorted(f for f in files if os.path.dirname(f) == root)


@pytest.mark.parametrize("n", [2, 3, 10, 37])
@pytest.mark.parametrize("fraction", [0.1, 0.5])
def test_split_by_file_is_a_seeded_partition(n: int, fraction: float) -> None:
    files = [f"file{i}" for i in range(n)]
    train, val = split_by_file(files, fraction, seed=3)
    assert sorted(train + val) == sorted(files) and not set(train) & set(val)
    assert len(val) == min(n - 1, max(1, math.ceil(fraction * n)))
    assert train == [f for f in files if f in train]  # each side keeps the sorted order
    assert (train, val) == split_by_file(files, fraction, seed=3)
    if n >= 10:
        assert {tuple(split_by_file(files, fraction, seed=s)[1]) for s in range(5)} != {tuple(val)}


def test_single_file_is_cut_at_a_line_start() -> None:
    data = torch.tensor(list(b"aaaa\nbbbb\ncccc\ndddd\n"), dtype=torch.uint8)
    train, val = cut_single(data, 0.3)  # 14 of 20 bytes -> the next line start, 15
    assert bytes(train.tolist()) == b"aaaa\nbbbb\ncccc\n" and bytes(val.tolist()) == b"dddd\n"


def test_text_files_and_read_bytes(tmp_path: Path) -> None:
    letters = _letters_corpus(tmp_path / "corpus", n=3)
    (tmp_path / "corpus" / ".hidden").write_bytes(b"\x00\x01")  # hidden: skipped
    (tmp_path / "corpus" / "sub").mkdir()
    (tmp_path / "corpus" / "sub" / "z.md").write_text("zz\n")
    files = text_files(tmp_path / "corpus")
    assert files == sorted(letters) + [str(tmp_path / "corpus" / "sub" / "z.md")]
    data = read_bytes(files)
    assert bytes(data.tolist()) == b"".join(Path(f).read_bytes() for f in files)
    assert text_files(files[0]) == [files[0]]


def test_unigram_entropy_against_hand_computation() -> None:
    data = torch.tensor(list(b"aaab" * 5 + b"cd"), dtype=torch.uint8)
    counts = Counter(data.tolist())
    expected = -sum(c / data.numel() * math.log2(c / data.numel()) for c in counts.values())
    assert unigram_entropy(data) == pytest.approx(expected, rel=1e-12)


def test_random_windows_are_seeded_slices() -> None:
    data = torch.arange(200, dtype=torch.int64).to(torch.uint8)  # byte k at offset k
    take = lambda seed: [w.clone() for _, w in zip(range(50), RandomWindows(data, 9, seed))]  # noqa: E731
    a, b, c = take(1), take(1), take(2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))
    for w in a:  # contiguous, inside the data
        assert w.shape == (9,) and torch.equal(w, data[int(w[0]):int(w[0]) + 9])
    assert len({int(w[0]) for w in a}) > 30  # offsets spread over the data


def test_fixed_windows_are_evenly_spaced_and_cover_both_ends() -> None:
    data = torch.arange(100, dtype=torch.int64).to(torch.uint8)
    windows = FixedWindows(data, 10, 4)
    assert windows.starts == [0, 30, 60, 90] and len(windows) == 4
    assert torch.equal(windows[3], data[90:100])


def test_data_module_splits_by_file_and_is_deterministic(tmp_path: Path) -> None:
    letters = _letters_corpus(tmp_path / "corpus", n=10)
    dm = TextDataModule(dataset="text", path=str(tmp_path / "corpus"), seq_len=16, batch_size=8, val_windows=12,
                        val_fraction=0.2, split_seed=1)
    dm.setup("fit")
    train_letters = {letters[f] for f in dm.train_split.files}
    val_letters = {letters[f] for f in dm.val_split.files}
    assert len(dm.val_split.files) == 2 and not train_letters & val_letters
    assert set(dm.train_split.files) | set(dm.val_split.files) == set(letters)
    torch.manual_seed(0)  # the training stream follows the run's seed
    train = [b.clone() for _, b in zip(range(5), dm.train_dataloader())]
    torch.manual_seed(0)
    again = [b.clone() for _, b in zip(range(5), dm.train_dataloader())]
    assert all(torch.equal(x, y) for x, y in zip(train, again))
    assert train[0].shape == (8, 17) and train[0].dtype == torch.uint8
    seen = {chr(c) for b in train for c in b.flatten().tolist()} - {"\n"}
    assert seen <= train_letters and len(seen) > 1  # windows come from the training files only
    val = torch.cat(list(dm.val_dataloader()))
    assert val.shape == (12, 17)
    assert {chr(c) for c in val.flatten().tolist()} - {"\n"} <= val_letters
    dm2 = TextDataModule(dataset="text", path=str(tmp_path / "corpus"), seq_len=16, val_windows=12,
                         val_fraction=0.2, split_seed=1)
    dm2.setup("fit")
    assert dm2.val_split.files == dm.val_split.files and torch.equal(torch.cat(list(dm2.val_dataloader())), val)


def test_stdlib_data_module_logs_sizes_and_python_version(caplog: pytest.LogCaptureFixture) -> None:
    dm = TextDataModule(seq_len=32, val_windows=4)
    with caplog.at_level("INFO"):
        dm.load()
    text = dm.describe()
    assert f"Python {platform.python_version()}" in text and "split by file, seed 0" in text
    n = len(stdlib_files()[1])
    assert f": {n} files" in text
    assert dm.train_split.nbytes + dm.val_split.nbytes == sum(os.path.getsize(f) for f in stdlib_files()[1])
    train, val = load_split(stdlib_files()[1], 0.1, 0, check_text=False)
    assert train.files == dm.train_split.files and val.files == dm.val_split.files


@pytest.mark.parametrize("case", ["missing", "empty_dir", "binary_nul", "binary_utf8", "too_short", "empty_file"])
def test_bad_text_is_one_message_naming_the_path(tmp_path: Path, case: str) -> None:
    target = tmp_path / "corpus"
    if case != "missing":
        target.mkdir()
    if case.startswith("binary"):
        _letters_corpus(target, n=2)
        (target / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00" if case == "binary_nul" else b"caf\xe9 au lait")
    if case == "too_short":
        (target / "a.txt").write_text("x" * 20)
        (target / "b.txt").write_text("y" * 40)
    if case == "empty_file":
        target = target / "empty.txt"
        target.write_text("")
    dm = TextDataModule(dataset="text", path=str(target), seq_len=32)
    with pytest.raises(UsageError) as err:
        dm.load()
    message = str(err.value)
    expected = {
        "missing": f"--data.path {target}: no such file or directory",
        "empty_dir": f"--data.path {target}: the folder holds no text files",
        "binary_nul": f"--data.path: {target / 'image.png'} is not UTF-8 text (a binary byte at offset 8)",
        "binary_utf8": f"--data.path: {target / 'image.png'} is not UTF-8 text (a binary byte at offset 3)",
        "too_short": "--data.seq_len 32 needs at least 33 bytes in each split, but",
        "empty_file": "--data.seq_len 32 needs at least 33 bytes in each split, but",
    }[case]
    assert message.startswith(expected), message
    if case == "too_short":
        assert f"{target} (2 files, 60 bytes) gives training 40 and validation 20 bytes" in message  # val: a.txt (seed 0)
    if case == "empty_file":
        assert "(1 file, 0 bytes) gives training 0 and validation 0 bytes" in message


@pytest.mark.parametrize("kwargs, expected", [
    ({"dataset": "text"}, "--data.dataset text needs --data.path FILE_OR_DIR"),
    ({"dataset": "stdlib", "path": "x"}, "--data.path 'x' is only read with --data.dataset text"),
    ({"dataset": "books"}, "--data.dataset 'books' is not valid; choose one of ['stdlib', 'text']"),
    ({"seq_len": 0}, "--data.seq_len must be >= 1, got 0."),
    ({"val_fraction": 1.0}, "--data.val_fraction must lie in (0, 1), got 1.0."),
])
def test_bad_options(kwargs: dict, expected: str) -> None:
    with pytest.raises(UsageError) as err:
        TextDataModule(**kwargs)
    assert str(err.value).startswith(expected), str(err.value)


def test_training_windows_differ_by_rank_and_a_resumed_run_continues_the_stream() -> None:
    from types import SimpleNamespace

    dm = TextDataModule(seq_len=16, batch_size=4, val_windows=4, num_workers=0)

    def batches(rank: int, step: int, accumulate: int = 1, n: int = 1) -> list[torch.Tensor]:
        dm.trainer = SimpleNamespace(global_rank=rank, global_step=step, accumulate_grad_batches=accumulate)
        torch.manual_seed(0)
        return list(itertools.islice(dm.train_dataloader(), n))

    run = batches(0, 0, n=12)
    assert torch.equal(run[0], batches(0, 0)[0])
    assert not torch.equal(run[0], batches(1, 0)[0])  # each DDP process its own windows
    # resumed after 5 steps: the windows the uninterrupted run took next, not the first ones again
    assert all(torch.equal(a, b) for a, b in zip(batches(0, 5, n=7), run[5:]))
    assert all(torch.equal(a, b) for a, b in zip(batches(0, 3, accumulate=2, n=6), run[6:]))  # 2 batches a step


@pytest.mark.parametrize("workers", [0, 2, 3])
def test_random_windows_start_batch_continues_every_worker_stream(workers: int) -> None:
    data = torch.arange(250, dtype=torch.int64).to(torch.uint8)

    def starts(start: int, n: int) -> list[list[int]]:
        loader = DataLoader(RandomWindows(data, 5, 7, 3, start), batch_size=3, num_workers=workers)
        return [b[:, 0].tolist() for b in itertools.islice(loader, n)]

    full = starts(0, 400)  # 1200 windows: past the first block of 1024 offsets of every stream
    for start in (1, 5, 341, 399):
        assert starts(start, 400 - start) == full[start:], start
