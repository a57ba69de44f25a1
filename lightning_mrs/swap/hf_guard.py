"""What keeps the family's own class from loading a swapped directory as the plain model.

A swapped model's ``config.json`` names ``LightningMRS<Base>`` for the Auto classes, but
``GemmaForCausalLM.from_pretrained(directory)`` never reads ``auto_map``: it reads the config with
the family's config class and builds the family's plain norms, then loads the weights into them.
For ``rms-half`` the weights fit exactly (no missing, unexpected or mismatched key); for ``layer``,
``dyt`` and QK-norms transformers only reports "unexpected keys". The logits differ every time.

The record therefore travels with a *guard*: ``config.json`` (and every ``LightningMRS<BaseConfig>``
in memory, which is what ``AutoConfig.from_pretrained(directory, trust_remote_code=True)`` gives)
holds :func:`guard_text` as its ``attn_implementation`` and ``experts_implementation``. Every
transformers 5 ``PreTrainedModel.__init__`` checks both before it builds a layer and refuses an
implementation it does not know, with the value in its one-line ``ValueError``: the family's class
(any head), given the directory or a config read from it, is refused with this text, which says
why and how to load it. Passing ``attn_implementation=`` replaces only the first key; the second
is replaced only by ``experts_implementation=`` (which nobody passes to a dense model).
``LightningMRS<Base>`` builds its model from :func:`unguarded` (in
:func:`~lightning_mrs.swap.hf_format.plain_config`), so the guard never reaches a model: a
loaded swapped model's config is the family's, with the default implementations.

The weights are not renamed: a directory must stay loadable by the Auto classes, PEFT, pipelines
and ``state_dict`` tools under the family's parameter names, and a rename would only turn the
silent load into "missing keys" (transformers re-initialises them), not into a refusal.
"""

from __future__ import annotations

from typing import Any

from lightning_mrs.version import __version__

__all__ = ["GUARDED_KEYS", "guard_text", "guarded", "is_guard", "unguarded"]

#: the config keys that hold the guard (``config.json``'s; ``_<key>`` on a config object)
GUARDED_KEYS = ("attn_implementation", "experts_implementation")
#: in every guard, whatever the release (no ``/``, ``|``, ``flash``, ``sdpa``: transformers reads those as kernels)
_MARK = "swapped the norms of this model"


def guard_text(record_format: int) -> str:
    """The guard this release writes for a record of ``record_format``: the message a plain load shows.

    Example:
        >>> guard_text(2).startswith("lightning-mrs ") and is_guard(guard_text(2))
        True
    """
    return (f"lightning-mrs {__version__} {_MARK} (config.json's lightning_mrs record, format {record_format}); "
            "the family's own class would build its plain norms, another model: load it with "
            "lightning_mrs.from_pretrained(directory) or an Auto class with trust_remote_code=True")


def is_guard(value: Any) -> bool:
    """Whether ``value`` (a config's ``_attn_implementation``) is the guard of any lightning-mrs release."""
    return isinstance(value, str) and _MARK in value


def guarded(config: Any) -> bool:
    """Whether ``config`` (a config object) holds the guard in any of :data:`GUARDED_KEYS`."""
    return any(is_guard(getattr(config, f"_{key}", None)) for key in GUARDED_KEYS)


def unguarded(config: Any) -> Any:
    """``config`` (changed in place) with each guarded implementation back to ``None``, transformers'
    default; an implementation the caller chose (``attn_implementation="eager"``) stays."""
    for key in GUARDED_KEYS:
        if is_guard(getattr(config, f"_{key}", None)):
            setattr(config, f"_{key}", None)  # the setter resets the sub-configs too
    return config
