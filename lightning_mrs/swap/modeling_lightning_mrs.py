"""A swapped transformers model as a custom architecture that transformers loads by itself.

transformers supports custom architectures through code saved beside the weights: a class with an
``_auto_class`` has its module copied into the directory by ``save_pretrained``, and
``config.json``'s ``auto_map`` names it, so that ``AutoModelForCausalLM.from_pretrained(path,
trust_remote_code=True)``, PEFT's ``AutoPeftModel*``, ``pipeline(..., trust_remote_code=True)`` and
lm-evaluation-harness's ``hf`` model build it. A swap that changes what a transformers model
computes (:mod:`lightning_mrs.swap.hf_record`) therefore makes the model an instance of
``LightningMRS<Base>``, a subclass of its own class (``LightningMRSLlamaForCausalLM`` of
``LlamaForCausalLM``: every ``isinstance`` check still holds) that adds one thing: its
``__init__`` re-applies the swap recorded in the config before the weights load. This file is
that module; it is what a saved directory holds as ``modeling_lightning_mrs.py``, and it needs
lightning-mrs installed where it runs.

The classes are made on demand, one per base class, and the module resolves their names
(``getattr(module, "LightningMRSLlamaForCausalLM")``), so pickles and transformers' loader find
them. Without ``trust_remote_code=True`` a plain ``from_pretrained`` of the directory still ends
with the guard's message (``lightning_mrs.swap.hf_record.GUARD``), never with other weights.

Example:
    >>> import importlib
    >>> transformers = importlib.import_module("transformers")
    >>> cls = swapped_class(transformers.LlamaForCausalLM)
    >>> cls.__name__, issubclass(cls, transformers.LlamaForCausalLM), cls._auto_class
    ('LightningMRSLlamaForCausalLM', True, 'AutoModelForCausalLM')
    >>> swapped_class(cls) is cls
    True
"""

from __future__ import annotations

import importlib
import threading
from typing import Any, Optional

from torch import nn

from lightning_mrs.swap.hf_record import RECORD_KEY, hf_roots, recorded_layers, swap_record, unguard
from lightning_mrs.swap.spec import rebuild

__all__ = ["PREFIX", "adopt", "auto_map", "base_class", "swapped_class"]

#: the prefix of a swapped class's name: ``LightningMRS`` + its base class's name
PREFIX = "LightningMRS"
_CLASSES: dict[type, type] = {}
_LOCK = threading.Lock()


def _transformers() -> Any:
    return importlib.import_module("transformers")


def base_class(cls: type) -> type:
    """The transformers class a swapped class extends (``cls`` itself when it is not one)."""
    while cls.__name__.startswith(PREFIX) and getattr(cls, "_lightning_mrs_base", None) is not None:
        cls = cls._lightning_mrs_base
    return cls


def _auto_classes(base: type) -> list[str]:
    """The Auto classes (``AutoModelForCausalLM``, ...) that build ``base`` for its config type."""
    transformers = _transformers()
    model_type = getattr(getattr(base, "config_class", None), "model_type", None)
    found = []
    for name in dir(transformers):
        if not name.startswith("AutoModel"):
            continue
        names = getattr(getattr(getattr(transformers, name, None), "_model_mapping", None), "_model_mapping", None)
        value = names.get(model_type) if isinstance(names, dict) else None
        if value == base.__name__ or (isinstance(value, (tuple, list)) and base.__name__ in value):
            found.append(name)
    return sorted(found, key=lambda n: (n != "AutoModelForCausalLM", n))


def _rebuild_recorded(model: nn.Module, config: Any) -> None:
    record = getattr(config, RECORD_KEY, None)
    if isinstance(record, dict):
        rebuild(model, None, recorded_layers(record))  # the recorded layers, built on the device the weights load to


def _init(self: nn.Module, config: Any, *args: Any, **kwargs: Any) -> None:
    unguard(config)  # the guards config.json holds for a plain load; an implementation the caller named stays
    base_class(type(self)).__init__(self, config, *args, **kwargs)
    _rebuild_recorded(self, config)


def swapped_class(base: type) -> type:
    """``LightningMRS<Base>``: ``base`` whose ``__init__`` re-applies the swap its config records.

    Args:
        base: a transformers model class (``LlamaForCausalLM``...); a swapped class is returned as is.
    """
    if base.__name__.startswith(PREFIX) and getattr(base, "_lightning_mrs_base", None) is not None:
        return base
    with _LOCK:
        cls = _CLASSES.get(base)
        if cls is None:
            autos = _auto_classes(base)
            name = PREFIX + base.__name__
            cls = type(name, (base,), {
                "__init__": _init,
                "__module__": __name__,
                "__qualname__": name,
                "__doc__": f"``{base.__name__}`` with the norm swap recorded in its config (lightning-mrs).",
                "_lightning_mrs_base": base,
                "_auto_class": autos[0] if autos else None,
            })
            _CLASSES[base] = cls
    return cls


def auto_map(base: type) -> dict[str, str]:
    """``config.json``'s ``auto_map`` for a model of class ``base`` swapped: every Auto class that
    builds ``base`` names ``modeling_lightning_mrs.LightningMRS<Base>``."""
    return {auto: f"{__name__.rpartition('.')[2]}.{PREFIX}{base.__name__}" for auto in _auto_classes(base)}


def adopt(model: nn.Module) -> None:
    """Make every swapped transformers model in ``model`` a ``LightningMRS<Base>`` (in place).

    Every model with a record changes (a record of only *plain* layers too, so that
    ``trust_remote_code=True`` gives back the very layers, while a plain load computes the same),
    unless transformers does not export its class (a model that is itself remote code keeps its
    class and is saved with the guard alone); its config gets the ``auto_map`` that names this module.
    """
    for _, root in hf_roots(model):
        if swap_record(root) is None:
            continue
        base = base_class(type(root))
        if getattr(_transformers(), base.__name__, None) is not base:
            continue
        root.__class__ = swapped_class(base)
        root.config.auto_map = {**(getattr(root.config, "auto_map", None) or {}), **auto_map(base)}


def __getattr__(name: str) -> type:
    """``LightningMRS<Base>`` for any transformers class ``Base`` (pickles and transformers' loader)."""
    if name.startswith(PREFIX):
        base: Optional[type] = getattr(_transformers(), name[len(PREFIX):], None)
        if isinstance(base, type) and issubclass(base, nn.Module):
            return swapped_class(base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
