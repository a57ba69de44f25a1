"""Text tokenized into cached memory-mapped files: ids that decode back, bytes that add up exactly."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from helpers.tokenizers import STDLIB_SAMPLE, tiny_tokenizer
from recipes.text import token_cache
from recipes.text.token_cache import tokenize_files


def test_tokens_decode_to_the_files_and_bytes_add_up(tmp_path):
    tokenizer = tiny_tokenizer()
    split = tokenize_files(STDLIB_SAMPLE, tokenizer, tmp_path)
    assert split.tokens.dtype == np.uint16 and isinstance(split.tokens, np.memmap)
    assert split.total_bytes == sum(os.path.getsize(f) for f in STDLIB_SAMPLE)
    eos = tokenizer.eos_token_id
    ids = split[0:len(split)].tolist()
    bounds = [i for i, t in enumerate(ids) if t == eos]
    assert len(bounds) == len(STDLIB_SAMPLE)  # one EOS after each file, covering no byte
    start = 0
    for path, end in zip(STDLIB_SAMPLE, bounds):
        assert tokenizer.decode(ids[start:end]) == Path(path).read_text()
        assert split.covered_bytes(start, end + 1) == os.path.getsize(path)  # per file, exactly
        start = end + 1
    assert len(split) < 0.6 * split.total_bytes  # a BPE: fewer tokens than bytes


def test_multibyte_characters_are_counted_in_utf8_bytes(tmp_path):
    text = tmp_path / "u.txt"
    text.write_text("naïve café — 東京 😀 ok\n" * 3, encoding="utf-8")
    split = tokenize_files([str(text)], tiny_tokenizer(), tmp_path / "cache")
    assert split.total_bytes == text.stat().st_size
    assert all(split.covered_bytes(0, k) <= split.covered_bytes(0, k + 1) for k in range(len(split)))


def test_the_cache_is_reused_and_renewed_when_a_file_changes(tmp_path, monkeypatch):
    data = tmp_path / "a.txt"
    data.write_text("def f(x):\n    return x\n")
    first = tokenize_files([str(data)], tiny_tokenizer(), tmp_path / "cache")
    calls = []
    monkeypatch.setattr(token_cache, "_write", lambda *a: calls.append(a) or (_ for _ in ()).throw(AssertionError))
    again = tokenize_files([str(data)], tiny_tokenizer(), tmp_path / "cache")  # nothing encoded
    assert not calls and np.array_equal(again.tokens, first.tokens)
    monkeypatch.undo()
    data.write_text("def g(y):\n    return y * 2\n")
    changed = tokenize_files([str(data)], tiny_tokenizer(), tmp_path / "cache")
    assert changed.total_bytes == data.stat().st_size and len(list((tmp_path / "cache").iterdir())) == 2


def test_another_tokenizer_gets_another_cache(tmp_path):
    a = tokenize_files(STDLIB_SAMPLE[:1], tiny_tokenizer(300), tmp_path)
    b = tokenize_files(STDLIB_SAMPLE[:1], tiny_tokenizer(384), tmp_path)
    assert len(a) != len(b) and a.total_bytes == b.total_bytes


def test_an_interrupted_encoding_leaves_no_cache(tmp_path, monkeypatch):
    def boom(text, tokenizer):
        raise KeyboardInterrupt

    monkeypatch.setattr(token_cache, "_encode", boom)
    with pytest.raises(KeyboardInterrupt):
        tokenize_files(STDLIB_SAMPLE, tiny_tokenizer(), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_bad_input_is_one_clear_error(tmp_path):
    binary = tmp_path / "b.bin"
    binary.write_bytes(b"\xff\xfe\x00abc")
    with pytest.raises(ValueError, match="is not UTF-8 text"):
        tokenize_files([str(binary)], tiny_tokenizer(), tmp_path / "cache")
    slow = type("Slow", (), {"is_fast": False})()
    with pytest.raises(ValueError, match="not a fast tokenizer"):
        tokenize_files(STDLIB_SAMPLE, slow, tmp_path / "cache")
