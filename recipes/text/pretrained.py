"""The LM recipe on a pretrained checkpoint: its weights, config and tokenizer, with one-line mistakes.

``--model.pretrained PATH_OR_NAME`` is what transformers' ``from_pretrained`` takes: a local
directory (``save_pretrained``'s: ``config.json`` and the weights), or a hub name where the network
allows. The model is loaded with :func:`lightning_mrs.from_pretrained`, so a directory this recipe
exported after a norm swap comes back swapped, exactly. Its tokenizer (``AutoTokenizer`` from the
same place) tokenizes the text (:mod:`recipes.text.token_cache`); a model of 256 tokens without a
tokenizer (a byte model this recipe trained) reads bytes, as without ``--model.pretrained``.

Every mistake is one :class:`~recipes.common.errors.UsageError` line: a path that does not exist or is not
a model directory, a hub name while offline (naming ``HF_HUB_OFFLINE`` and the local-directory
alternative), a directory without a tokenizer for a model whose vocabulary is not bytes, a tokenizer
with more tokens than the model's embeddings, windows longer than the model's positions.

Example:
    >>> model = load_pretrained("my-llama/", seq_len=128)  # doctest: +SKIP
    >>> tokenizer = load_tokenizer("my-llama/", vocab=model.get_input_embeddings().num_embeddings)  # doctest: +SKIP
"""

from __future__ import annotations

import os
from typing import Any, Optional

from torch import nn

from recipes.text.causal_lm import require_transformers
from recipes.common.errors import UsageError

__all__ = ["BYTES", "check_vocab", "load_pretrained", "load_tokenizer"]

#: the vocabulary of a byte model: the recipe feeds it UTF-8 bytes, no tokenizer
BYTES = 256
_OPTION = "--model.pretrained"


def _check_source(source: str) -> None:
    if os.path.isdir(source):
        if not os.path.isfile(os.path.join(source, "config.json")):
            raise UsageError(f"{_OPTION} {source!r} is a directory but not a model directory (no config.json); give "
                             "the directory save_pretrained wrote (config.json and the weights).")
        return
    if os.path.exists(source):
        raise UsageError(f"{_OPTION} {source!r} is a file; give the model's directory (config.json and the weights).")
    if source.startswith((".", "/", "~")) or source.endswith("/") or source.count("/") > 1:
        raise UsageError(f"{_OPTION} {source!r}: no such directory.")


def _offline(source: str, err: BaseException) -> UsageError:
    env = os.environ.get("HF_HUB_OFFLINE")
    why = "HF_HUB_OFFLINE=1 is set" if env and env not in ("0", "false", "False") else "the hub cannot be reached"
    return UsageError(f"{_OPTION} {source!r} is not a local directory, and {why} ({type(err).__name__}); download it "
                      "where the network allows (e.g. `hf download NAME --local-dir DIR`) and give the DIR, or unset "
                      "HF_HUB_OFFLINE where the network is there.")


def load_pretrained(source: str, seq_len: int, attn_implementation: Optional[str] = None) -> nn.Module:
    """The pretrained causal LM at ``source`` (float32, its recorded norm swap re-applied).

    Raises:
        UsageError: see the module docstring.
    """
    require_transformers(_OPTION)
    from lightning_mrs import from_pretrained

    _check_source(source)
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    try:
        model = from_pretrained(source, **kwargs)
    except OSError as err:  # transformers' "can't load ... make sure ... is a correct model identifier" and offline
        if os.path.isdir(source):
            raise UsageError(f"{_OPTION} {source!r}: transformers cannot load it ({str(err).splitlines()[0][:160]})") \
                from None
        raise _offline(source, err) from None
    except ValueError as err:  # lightning_mrs.from_pretrained's strict loading, an unknown model type
        raise UsageError(f"{_OPTION} {source!r}: {str(err).splitlines()[0][:200]}") from None
    model = model.float().train()
    positions = getattr(model.config, "max_position_embeddings", None)
    if isinstance(positions, int) and positions < seq_len:
        raise UsageError(f"{_OPTION} {source!r}: the model has {positions} positions, fewer than a window's "
                         f"{seq_len} (--data.seq_len); lower --data.seq_len to at most {positions}.")
    return model


def load_tokenizer(source: str) -> Optional[Any]:
    """``AutoTokenizer.from_pretrained(source)``, or ``None`` for a byte model's directory without one.

    Raises:
        UsageError: no tokenizer there for a model whose vocabulary is not 256 bytes.
    """
    require_transformers(_OPTION)
    from transformers import AutoTokenizer, PretrainedConfig

    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, TypeError, KeyError) as err:
        try:  # config.json as data: a swapped model's directory is custom code, which this must not run
            vocab = PretrainedConfig.get_config_dict(source)[0].get("vocab_size")
        except (OSError, ValueError):
            vocab = None
        if vocab == BYTES:
            return None  # a byte model: the recipe's bytes are its tokens
        raise UsageError(f"{_OPTION} {source!r} has no tokenizer, and the recipe's bytes "
                         f"({BYTES} ids) cannot feed a model with a vocabulary of {vocab}; save the tokenizer there "
                         "(tokenizer.save_pretrained(DIR)).") from None


def check_vocab(tokenizer: Any, model: nn.Module, source: str) -> None:
    """A tokenizer's ids must all have an embedding row."""
    rows = model.get_input_embeddings().num_embeddings
    if tokenizer is not None and len(tokenizer) > rows:
        raise UsageError(f"{_OPTION} {source!r}: its tokenizer has {len(tokenizer)} tokens but the model embeds only "
                         f"{rows}; give the tokenizer the model was trained with.")
