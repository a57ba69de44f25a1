"""A small byte-level BPE tokenizer trained offline on the standard library's own sources.

``tiny_tokenizer(vocab_size)`` is a ``PreTrainedTokenizerFast`` (``<|endoftext|>`` is its EOS and
padding token) trained with the ``tokenizers`` library on a few stdlib files, built once per
process and vocabulary size; :func:`save_tokenizer` writes it as a pretrained directory would hold
it (``save_pretrained``).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

__all__ = ["STDLIB_SAMPLE", "save_tokenizer", "tiny_tokenizer"]

#: a few real text files, the same on every CPython 3.11
STDLIB_SAMPLE = [os.path.join(os.path.dirname(os.__file__), name) for name in ("abc.py", "bisect.py", "colorsys.py")]


@functools.lru_cache(maxsize=None)
def tiny_tokenizer(vocab_size: int = 384) -> "transformers.PreTrainedTokenizerFast":
    """A byte-level BPE of ``vocab_size`` tokens (256 bytes, merges, ``<|endoftext|>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train(STDLIB_SAMPLE, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>",
                                                pad_token="<|endoftext|>")


def save_tokenizer(path: Path, vocab_size: int = 384) -> Path:
    """:func:`tiny_tokenizer` saved into ``path`` (made if missing)."""
    tiny_tokenizer(vocab_size).save_pretrained(path)
    return path
