"""The norm classes of Hugging Face transformers whose code was read, checked by the probe.

Any model's norms are recognised by behaviour (:mod:`lightning_mrs.swap.probe`); for the classes
listed here the formula is also known from their source (transformers 4.45 - 5.24), and the
probe must agree with it: a disagreement (a future transformers changing a class) skips the
layer with both formulas in the reason instead of guessing. Nothing here imports transformers:
a class is recognised by its name and ``type(module).__module__`` (``transformers.*``).

========================================= =============================================
``LlamaRMSNorm``, ``MistralRMSNorm``,     ``rms(x) * w`` (``variance_epsilon``)
``Qwen2RMSNorm``, ``Qwen3RMSNorm``, ...
``GemmaRMSNorm``, ``Gemma2RMSNorm``,      ``rms(x) * (1 + w)``: the weight is an offset from 1
``Gemma3RMSNorm``
``OlmoLayerNorm``                         ``layer(x)``, no weight, eps 1e-5 (hard-coded)
``CohereLayerNorm``                       ``layer(x) * w`` (no bias)
``NemotronLayerNorm1P``                   ``layer(x) * (1 + w) + b``
========================================= =============================================
"""

from __future__ import annotations

from typing import Optional

from torch import nn

__all__ = ["KNOWN_NORMS", "derives_from_transformers", "is_transformers", "known_norm"]

_RMS = ("rms", "w")
_RMS_OFFSET = ("rms", "1+w")
#: class name -> ((kind, weight), eps when the class has no eps attribute)
KNOWN_NORMS: dict[str, tuple[tuple[str, str], Optional[float]]] = {
    **{f"{family}RMSNorm": (_RMS, None) for family in (
        "Llama", "Mistral", "Mixtral", "Ministral", "Qwen2", "Qwen2Moe", "Qwen3", "Qwen3Moe", "Olmo2", "Olmo3",
        "Olmoe", "Phi3", "Granite", "GraniteMoe", "DeepseekV3", "Glm", "Glm4", "SmolLM3", "Ernie4_5", "Exaone4",
        "Arcee", "Dots1",
    )},
    "T5LayerNorm": (_RMS, None),
    **{f"{family}RMSNorm": (_RMS_OFFSET, None) for family in ("Gemma", "Gemma2", "Gemma3")},
    "OlmoLayerNorm": (("layer", "none"), 1e-5),
    "CohereLayerNorm": (("layer", "w"), None),
    "NemotronLayerNorm1P": (("layer", "1+w"), None),
}


def is_transformers(module: object) -> bool:
    """``module``'s class (a module's, a config's) comes from the transformers package, without
    importing it: the one test of the project (the swap, the attention finder, the config record).
    A swapped model's ``LightningMRS<Base>`` class (:mod:`lightning_mrs.swap.hf_format`) counts as
    the class it extends."""
    cls = getattr(type(module), "_lightning_mrs_own", None) or type(module)
    return cls.__module__.startswith("transformers.")


#: transformers' base classes of every model and every config (``PretrainedConfig`` before transformers 5)
_BASES = {("transformers.modeling_utils", "PreTrainedModel"), ("transformers.configuration_utils", "PreTrainedConfig"),
          ("transformers.configuration_utils", "PretrainedConfig")}


def derives_from_transformers(obj: object) -> bool:
    """``obj`` is a transformers model or config, its class perhaps defined elsewhere (a user's ``class
    MyLlama(LlamaForCausalLM)``): transformers' ``PreTrainedModel`` or ``PreTrainedConfig`` is in its
    class's MRO. What decides whether a model holds a config to record its swap in; not any class
    of transformers in the MRO (PEFT's ``PeftModel`` derives from transformers' ``PushToHubMixin``
    and is a wrapper, not the model). Norm classes are recognised by :func:`is_transformers` alone."""
    return any((cls.__module__, cls.__name__) in _BASES for cls in type(obj).__mro__)


def known_norm(module: nn.Module) -> Optional[tuple[tuple[str, str], Optional[float]]]:
    """``((kind, weight), eps)`` of a transformers norm class listed in :data:`KNOWN_NORMS`."""
    return KNOWN_NORMS.get(type(module).__name__) if is_transformers(module) else None
