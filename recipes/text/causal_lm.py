"""The language-model recipe's model: any transformers causal LM, built from a config, offline.

``--model.arch`` is a transformers ``model_type`` with a causal-LM head (``llama``, ``gpt2``,
``qwen3``, ``mistral``, ``gemma``, ``phi``, ``gpt_neox``, ...: the keys of
``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``); the model is ``AutoModelForCausalLM.from_config``,
randomly initialised, nothing downloaded. Its config is the model type's default config with
the small sizes of :data:`SMALL` (only the fields that config has, under its own names through
transformers' ``attribute_map``: ``hidden_size`` is GPT-2's ``n_embd``), then the user's
``--model.config`` overrides. Bytes are the tokens, so ``vocab_size`` is 256 and
``pad_token_id`` is None (a padding index would freeze the embedding of one byte), and
``max_position_embeddings`` defaults to the sequence length; a special token id outside the 256
bytes (GPT-2's 50256) becomes None.

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

from recipes.common.errors import UsageError

__all__ = ["HF_EXTRA", "SMALL", "build_causal_lm", "build_config", "causal_lm_types", "decoder_layers", "head_size",
           "require_transformers"]

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


def _settable(config_class: type, key: str) -> bool:
    """A field ``from_config`` can take: not a derived property without a setter (Falcon's ``head_dim``)."""
    attr = getattr(config_class, key, None)
    return not (isinstance(attr, property) and attr.fset is None)


def _validation_message(err: BaseException) -> str:
    """transformers' own sentence from a config validation error (its last line: the ValueError)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1].removeprefix("ValueError: ") if lines else type(err).__name__


def build_config(arch: str, overrides: Optional[dict[str, Any]] = None, seq_len: int = 128) -> Any:
    """``arch``'s config with :data:`SMALL` and ``overrides``, built and validated by transformers, and
    checked against what a byte model needs (before any weight exists).

    Every field goes through the config's constructor (``AutoConfig.for_model``), so the fields
    derived from others (Qwen3's ``layer_types`` from ``num_hidden_layers``) follow them, and
    transformers' own validation runs (``config.validate()``: "RoPE requires an even rotary
    dimension", "hidden size not a multiple of the number of attention heads", ...). A field is
    named by the config's own name or its alias (GPT-2's ``n_embd`` or ``hidden_size``).

    Raises:
        UsageError: transformers missing, an unknown ``arch`` (with the close ``model_type``s), an
            override the config does not have (with the close fields) or cannot take, a config
            transformers rejects, a vocabulary other than 256 bytes, fewer positions than
            ``seq_len``, or query heads that are not a multiple of the key/value heads.
    """
    require_transformers()
    from transformers import AutoConfig

    known = causal_lm_types()
    if arch not in known:
        raise UsageError(f"--model.arch {arch!r} is not a transformers model_type with a causal-LM head; "
                         f"{_suggest(arch, known)} ({len(known)} types: transformers' "
                         "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES).")
    default = AutoConfig.for_model(arch)
    aliases = dict(getattr(default, "attribute_map", {}) or {})  # standard name -> the config's own
    fields = sorted(set(default.to_dict()) | set(aliases))
    given: dict[str, Any] = {}
    for key, value in (overrides or {}).items():
        if not hasattr(default, key):
            raise UsageError(f"--model.config: {arch}'s config has no field {key!r}; {_suggest(key, fields)}")
        if not _settable(type(default), key):
            raise UsageError(f"--model.config: {arch}'s field {key!r} cannot be set (transformers derives it from "
                             "the other fields).")
        given[aliases.get(key, key)] = value
    small = {aliases.get(k, k): v for k, v in {**SMALL, "max_position_embeddings": seq_len}.items()
             if hasattr(default, k) and _settable(type(default), k)}
    values = {**small, **given}
    heads = values.get(aliases.get("num_attention_heads", "num_attention_heads"))
    hidden = values.get(aliases.get("hidden_size", "hidden_size"))
    if "num_key_value_heads" in small and "num_key_value_heads" not in given and heads:
        values["num_key_value_heads"] = heads  # as many key/value heads as query heads, unless given
    if "head_dim" in small and "head_dim" not in given and heads and hidden:
        values["head_dim"] = hidden // heads  # the width per head follows hidden_size
    for key in _TOKEN_IDS:  # GPT-2's 50256 and the like name no byte: transformers warns, generation would use them
        if key not in given and key not in values and _outside_bytes(getattr(default, key, None)):
            values[key] = None
    try:
        config = AutoConfig.for_model(arch, **values)
        if hasattr(config, "validate"):
            config.validate()
    except Exception as err:  # noqa: BLE001 - transformers' validators raise ValueError and huggingface_hub's own
        raise UsageError(f"--model.config {overrides or {}}: transformers rejects this {arch} config: "
                         f"{_validation_message(err)}") from None
    _check_byte_model(arch, config, overrides or {}, seq_len)
    return config


#: the config fields that name a token: a byte model's must be bytes (or None)
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id")


def _outside_bytes(token: Any) -> bool:
    tokens = token if isinstance(token, (list, tuple)) else [token]
    return any(isinstance(t, int) and not 0 <= t < 256 for t in tokens)


def _check_byte_model(arch: str, config: Any, overrides: dict[str, Any], seq_len: int) -> None:
    """What transformers does not check and a byte model on windows of ``seq_len`` needs."""
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and vocab != 256:
        raise UsageError(f"--model.config: vocab_size {vocab}: the tokens are bytes, so the vocabulary is 256; "
                         "drop vocab_size.")
    for key in _TOKEN_IDS:
        if key in overrides and _outside_bytes(overrides[key]):
            raise UsageError(f"--model.config: {key} {overrides[key]} is not a byte (0 to 255); give a byte or null.")
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and positions < seq_len:
        raise UsageError(f"--model.config: {arch}'s max_position_embeddings is {positions}, fewer than the "
                         f"{seq_len} positions of a window (--data.seq_len {seq_len}): raise it or drop it (it "
                         "defaults to --data.seq_len), or lower --data.seq_len.")
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv, int) and (kv < 1 or heads % kv):
        raise UsageError(f"--model.config: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                         f"{kv} (each key/value head serves a whole group of query heads); change one of them.")


def head_size(config: Any) -> Optional[int]:
    """The width of one attention head: ``head_dim`` where the config has one, else hidden / heads."""
    size = getattr(config, "head_dim", None)
    if isinstance(size, int):
        return size
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 else None


def build_causal_lm(arch: str, overrides: Optional[dict[str, Any]] = None, seq_len: int = 128,
                    attn_implementation: Optional[str] = None) -> nn.Module:
    """``AutoModelForCausalLM.from_config`` of :func:`build_config`'s config: randomly initialised, offline.

    Raises:
        UsageError: see :func:`build_config`; or a config the model's constructor rejects.
    """
    from transformers import AutoModelForCausalLM

    config = build_config(arch, overrides, seq_len)
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    try:
        return AutoModelForCausalLM.from_config(config, **kwargs)
    except (ValueError, TypeError, AssertionError, KeyError, AttributeError, RuntimeError) as err:
        raise UsageError(f"--model.config {overrides or {}} does not build a {arch} model: "
                         f"{type(err).__name__}: {err}") from None


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the modules of a class named in its ``_no_split_modules`` (transformers' own
    list), subclasses included (FSDP2's ``fully_shard`` turns a ``LlamaDecoderLayer`` into an
    ``FSDPLlamaDecoderLayer``)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]
