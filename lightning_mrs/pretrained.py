"""``from_pretrained``: load a transformers model saved after a norm swap, exactly as it was saved.

A swapped transformers model records its swap in its config (:mod:`lightning_mrs.swap.hf_record`),
so ``model.save_pretrained(path)`` writes it into ``config.json``. :func:`from_pretrained` builds
the model from that config through transformers' own ``from_pretrained`` (so ``dtype``,
``device_map``, offloading... work as there), re-applies the recorded swap to the freshly built
model *before* its weights load (as transformers' quantizers replace modules), and loads the
weights strictly: a missing, unexpected or mismatched key is an error, never a silent
re-initialisation. A directory without a record loads as transformers would load it.

Example:
    >>> import tempfile, torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from lightning_mrs import swap_norms
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...                                      num_hidden_layers=1, num_attention_heads=4))
    >>> _ = swap_norms(model, "mrs", qk_norm="mrs")
    >>> path = tempfile.mkdtemp()
    >>> model.save_pretrained(path)
    >>> again = from_pretrained(path)
    >>> ids = torch.tensor([[1, 2, 3]])
    >>> torch.equal(model(ids).logits, again(ids).logits)
    True
"""

from __future__ import annotations

import importlib
from typing import Any, Optional

from torch import nn

from lightning_mrs.swap.hf_record import RECORD_KEY, is_guard
from lightning_mrs.swap.modeling_lightning_mrs import PREFIX, swapped_class

__all__ = ["from_pretrained"]

#: keyword arguments of transformers' ``from_pretrained`` that also apply to reading the config
_CONFIG_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder",
                  "trust_remote_code", "proxies")


def _transformers() -> Any:
    try:
        return importlib.import_module("transformers")
    except ImportError as err:  # the [hf] extra is optional
        raise ImportError("lightning_mrs.from_pretrained needs transformers: pip install 'lightning-mrs[hf]'") from err


def _model_class(transformers: Any, config: Any, auto_class: Optional[type]) -> type:
    """The class that was saved (``config.architectures[0]``), else ``AutoModelForCausalLM``'s."""
    if auto_class is not None:
        return auto_class._model_mapping[type(config)] if hasattr(auto_class, "_model_mapping") else auto_class
    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name.removeprefix(PREFIX), None)  # a swapped class saves as LightningMRS<Base>
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            return cls
    return transformers.AutoModelForCausalLM._model_mapping[type(config)]


def from_pretrained(pretrained_model_name_or_path: str, *, auto_class: Optional[type] = None, **kwargs: Any) -> nn.Module:
    """Load a (swapped or plain) transformers model from a directory or hub name.

    Args:
        pretrained_model_name_or_path: what transformers' ``from_pretrained`` takes.
        auto_class: the class to build (``AutoModelForSequenceClassification``, a model class);
            default: the class that was saved (``config.architectures``), else a causal LM.
        **kwargs: transformers' ``from_pretrained`` keywords (``dtype``, ``device_map``,
            ``attn_implementation``, ``revision``...).

    Returns:
        The model, its recorded norm swap re-applied and its weights loaded.

    Raises:
        ValueError: the saved weights do not fit the rebuilt model (missing, unexpected or
            mismatched keys, listed), or the record does not fit the architecture.
        ImportError: transformers is not installed.
    """
    transformers = _transformers()
    config = kwargs.pop("config", None)
    if config is None:
        config_kwargs = {k: kwargs[k] for k in _CONFIG_KWARGS if k in kwargs}
        config = transformers.AutoConfig.from_pretrained(pretrained_model_name_or_path, **config_kwargs)
    record = getattr(config, RECORD_KEY, None)
    if is_guard(getattr(config, "_attn_implementation", None)):  # read from config.json as the attention to use
        config._attn_implementation = None
    if kwargs.get("attn_implementation") is not None:
        config._attn_implementation = kwargs.pop("attn_implementation")
    base = _model_class(transformers, config, auto_class)
    if not isinstance(record, dict):
        return base.from_pretrained(pretrained_model_name_or_path, config=config, **kwargs)
    if record.get("format") != 1:
        raise ValueError(f"{pretrained_model_name_or_path}: config.json's {RECORD_KEY} record has format "
                         f"{record.get('format')!r}; this lightning-mrs reads format 1 (upgrade lightning-mrs)")

    # the swapped class: its __init__ re-applies the record to the freshly built model before the weights load
    building = swapped_class(base)
    kwargs["ignore_mismatched_sizes"] = True  # transformers reports them to us; the check below refuses any
    model, info = building.from_pretrained(pretrained_model_name_or_path, config=config, output_loading_info=True,
                                           **kwargs)
    problems = [f"missing {sorted(info['missing_keys'])[:5]}" if info["missing_keys"] else "",
                f"unexpected {sorted(info['unexpected_keys'])[:5]}" if info["unexpected_keys"] else "",
                f"mismatched {sorted(k for k, *_ in info['mismatched_keys'])[:5]}" if info["mismatched_keys"] else "",
                "; ".join(info["error_msgs"][:3])]
    problems = [p for p in problems if p]
    if problems:
        raise ValueError(f"{pretrained_model_name_or_path}: the saved weights do not fit the model rebuilt from its "
                         f"{RECORD_KEY} record ({'; '.join(problems)}); was config.json edited, or saved by another "
                         "lightning-mrs?")
    return model
