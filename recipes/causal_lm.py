"""The language-model recipe's model: any transformers causal LM, built from a config, offline.

``--model.arch`` is a transformers ``model_type`` with a causal-LM head (``llama``, ``gpt2``,
``qwen3``, ``mistral``, ``gemma``, ``phi``, ``gpt_neox``, ...: the keys of
``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``); the model is ``AutoModelForCausalLM.from_config``,
randomly initialised, nothing downloaded. Its config is the model type's default config with
the small sizes of :data:`SMALL` (only the fields that config has, under its own names through
transformers' ``attribute_map``: ``hidden_size`` is GPT-2's ``n_embd``), then the user's
``--model.config`` overrides. Bytes are the tokens, so ``vocab_size`` is 256 and
``pad_token_id`` is None (a padding index would freeze the embedding of one byte), and
``max_position_embeddings`` defaults to the sequence length.

Example:
    >>> model = build_causal_lm("llama", {"num_hidden_layers": 1}, seq_len=32)
    >>> type(model).__name__, model.config.hidden_size, model.config.vocab_size
    ('LlamaForCausalLM', 128, 256)
"""

from __future__ import annotations

import difflib
import importlib.util
from typing import Any, Optional

from torch import nn

from recipes.errors import UsageError

__all__ = ["HF_EXTRA", "SMALL", "build_causal_lm", "causal_lm_types", "decoder_layers", "require_transformers"]

HF_EXTRA = 'pip install -e ".[hf]"'
#: the small default sizes (4 layers of width 128, 4 heads of 32, a 4x MLP): 1.1 M parameters for llama
SMALL: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "intermediate_size": 512,
    "pad_token_id": None,
}


def require_transformers(option: str = "--model.arch") -> None:
    """A usage error naming the extra to install when transformers is missing."""
    if importlib.util.find_spec("transformers") is None:
        raise UsageError(f"{option}: the language-model recipe builds Hugging Face transformers models, and "
                         f"transformers is not installed: {HF_EXTRA} (or pip install transformers).")


def causal_lm_types() -> list[str]:
    """The ``model_type``s that have a causal-LM head in the installed transformers (sorted)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _suggest(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=5, cutoff=0.6)
    return f"did you mean {' or '.join(repr(c) for c in close)}?" if close else "no close name"


def build_causal_lm(arch: str, overrides: Optional[dict[str, Any]] = None, seq_len: int = 128,
                    attn_implementation: Optional[str] = None) -> nn.Module:
    """``AutoModelForCausalLM.from_config`` of ``arch``'s config with :data:`SMALL` and ``overrides``.

    Raises:
        UsageError: transformers missing, an unknown ``arch`` (with the close ``model_type``s),
            an override the config does not have (with the close fields), or a config the
            model rejects.
    """
    require_transformers()
    from transformers import AutoConfig, AutoModelForCausalLM

    known = causal_lm_types()
    if arch not in known:
        raise UsageError(f"--model.arch {arch!r} is not a transformers model_type with a causal-LM head; "
                         f"{_suggest(arch, known)} ({len(known)} types: transformers' "
                         "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES).")
    config = AutoConfig.for_model(arch)
    for key, value in {**SMALL, "max_position_embeddings": seq_len}.items():
        if hasattr(config, key):
            try:
                setattr(config, key, value)
            except AttributeError:  # a derived property (e.g. Falcon's head_dim)
                pass
    fields = sorted(set(config.to_dict()) | set(getattr(config, "attribute_map", {})))
    for key, value in (overrides or {}).items():
        if not hasattr(config, key):
            raise UsageError(f"--model.config: {arch}'s config has no field {key!r}; {_suggest(key, fields)}")
        try:
            setattr(config, key, value)
        except AttributeError as err:
            raise UsageError(f"--model.config: {arch}'s field {key!r} cannot be set ({err}).") from None
    heads = getattr(config, "num_attention_heads", None)
    if "head_dim" not in (overrides or {}) and hasattr(config, "head_dim") and heads:
        try:
            config.head_dim = config.hidden_size // heads  # the width per head follows hidden_size
        except AttributeError:
            pass
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    try:
        return AutoModelForCausalLM.from_config(config, **kwargs)
    except (ValueError, TypeError, AssertionError, KeyError, AttributeError, RuntimeError) as err:
        raise UsageError(f"--model.config {overrides or {}} does not build a {arch} model: "
                         f"{type(err).__name__}: {err}") from None


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the modules named in its ``_no_split_modules`` (transformers' own list)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]
