"""A swapped transformers model saved in the format transformers documents for custom models.

``swap_norms`` makes a swapped transformers model an instance of ``LightningMRS<Base>``, a subclass
of its own class (``isinstance`` checks hold) that changes two things:

* ``save_pretrained`` writes the swap, read off the live modules (every norm layer whose class is
  not the one the model's class builds, QK-norms added included), as the ``lightning_mrs`` record
  of a *copy* of the config, of class ``LightningMRS<BaseConfig>`` (its own ``model_type``:
  ``lightning_mrs_<family>``), with an ``auto_map`` naming ``AutoConfig`` and every Auto class of
  the family (``AutoModel``, ``AutoModelForCausalLM``, ``AutoModelForSequenceClassification``...).
  Both classes are registered with ``register_for_auto_class``, so transformers' own
  ``save_pretrained`` copies their module (:mod:`lightning_mrs.swap.modeling_lightning_mrs`, which
  calls the one public entry point :func:`transformers_class`) beside the weights. The model's own
  config is never written to: ``AutoModelForCausalLM.from_config(model.config)`` builds the plain
  model, and a model with no swapped layer saves in its family's own format;
* its ``__init__`` rebuilds the recorded layers before the weights load, the record's names
  mapped onto the class built (a causal LM's directory loads as ``AutoModel`` or a classifier, as
  transformers maps the weights' keys). The model's config is the family's (``model_type`` too),
  and ``is_custom_code`` is the extended class's: transformers loads, initialises and saves it as
  the family (checkpoint conversions, buffers a parent's ``_init_weights`` fills);
* a record travels with a guard (:mod:`~lightning_mrs.swap.hf_guard`) that the family's own class
  refuses, and its ``peft_config`` gives a task-less PEFT adapter config the task of its Auto class,
  so that ``AutoPeftModelFor<Task>`` opens the adapter.

A user's subclass (``class MyClassifier(LlamaForSequenceClassification)``) keeps its class in
memory and saves as its transformers base (``LightningMRSLlamaForSequenceClassification``), the
head transformers would load from its unswapped directory.

Example:
    >>> import importlib
    >>> transformers = importlib.import_module("transformers")
    >>> cls = swapped_class(transformers.LlamaForCausalLM)
    >>> cls.__name__, cls.config_class.model_type, cls._auto_class
    ('LightningMRSLlamaForCausalLM', 'lightning_mrs_llama', 'AutoModelForCausalLM')
    >>> transformers_class("LightningMRSLlamaForCausalLM", 2) is cls
    True
"""

from __future__ import annotations

import copy
import copyreg
import importlib
import threading
from typing import Any, Optional

import torch
from torch import nn

from lightning_mrs.swap.hf import derives_from_transformers
from lightning_mrs.swap.hf_guard import GUARDED_KEYS, guard_text, guarded, unguarded
from lightning_mrs.swap.hf_peft import peft_config
from lightning_mrs.swap.layer_record import LayerRecord, layer_record
from lightning_mrs.swap.registry import norm_spec
from lightning_mrs.swap.spec import rebuild
from lightning_mrs.version import __version__

__all__ = ["FORMAT", "PREFIX", "RECORD_KEY", "adopt", "auto_map", "config_base", "family_config", "live_layers", "plain_config",
           "recorded_layers", "rooted", "saved_config", "swapped_class", "transformers_class"]

RECORD_KEY = "lightning_mrs"
#: the record format this release writes and reads (1: lightning-mrs 0.2.0's guarded config, no longer read)
FORMAT = 2
#: the lightning-mrs release that first wrote each record format (what a refusal tells to install)
FORMAT_RELEASES = {1: "0.2.0", 2: "0.3.0"}
PREFIX = "LightningMRS"
TYPE_PREFIX = "lightning_mrs_"  # a LightningMRS<BaseConfig>'s model_type: lightning_mrs_<family>
#: the module ``save_pretrained`` copies beside the weights (the swapped classes' ``__module__``)
CODE = "lightning_mrs.swap.modeling_lightning_mrs"
_CLASSES: dict[type, type] = {}
_LOCK = threading.RLock()


def _transformers() -> Any:
    return importlib.import_module("transformers")


def transformers_class(name: str, record_format: int = FORMAT) -> type:
    """``LightningMRS<Base>`` or ``LightningMRS<BaseConfig>`` for the transformers class ``Base``:
    the public entry point that the saved ``modeling_lightning_mrs.py`` calls.

    Args:
        name: the class name ``config.json``'s ``auto_map`` or ``architectures`` holds.
        record_format: the record format of the file that asks (a newer one is refused).

    Raises:
        ImportError: the file was written for another record format (a newer one: upgrade lightning-mrs).
        AttributeError: no such class.

    Example:
        >>> cls = transformers_class("LightningMRSLlamaForSequenceClassification", 2)
        >>> cls.__mro__[1].__name__, cls.config_class.__name__
        ('LlamaForSequenceClassification', 'LightningMRSLlamaConfig')
    """
    base = getattr(_transformers(), name[len(PREFIX):], None) if name.startswith(PREFIX) else None
    if not isinstance(base, type):
        raise AttributeError(f"module {CODE!r} has no attribute {name!r}")
    if record_format != FORMAT:
        raise ImportError(f"this model's modeling_lightning_mrs.py was written for lightning-mrs record format "
                          f"{record_format}; lightning-mrs {__version__} reads format "
                          f"{FORMAT}{_written_by(FORMAT)}: "
                          f"{'pip install -U lightning-mrs' if record_format > FORMAT else 're-save it'}")
    if issubclass(base, nn.Module):
        return swapped_class(base)
    if any(c.__module__ == "transformers.configuration_utils" for c in base.__mro__):
        return config_class(base)
    raise AttributeError(f"module {CODE!r} has no attribute {name!r}")


def _written_by(record_format: Any) -> str:
    """`` (written since lightning-mrs X)`` for a format :data:`FORMAT_RELEASES` knows."""
    release = FORMAT_RELEASES.get(record_format) if isinstance(record_format, int) else None
    return f" (written since lightning-mrs {release})" if release else ""


def recorded_layers(record: Any, where: str = "") -> dict[str, LayerRecord]:
    """The layers of ``record`` (a config's :data:`RECORD_KEY`): ``name -> layer record``.

    Raises:
        ValueError: a record of another format (``where`` starts the message), naming the release it needs.

    Example:
        >>> recorded_layers({"format": 2, "version": "0.2.0", "layers": {"norm": {"kind": "mrs"}}})
        {'norm': {'kind': 'mrs'}}
    """
    got = record.get("format") if isinstance(record, dict) else None
    if got == FORMAT:
        return dict(record.get("layers") or {})
    saved_by = record.get("version", "?") if isinstance(record, dict) else "?"
    if isinstance(got, int) and got > FORMAT:
        raise ValueError(f"{where}config.json's {RECORD_KEY} record has format {got}, written by lightning-mrs {saved_by}; "
                         f"lightning-mrs {__version__} reads format {FORMAT}{_written_by(FORMAT)}: "
                         f"pip install -U 'lightning-mrs>={saved_by}'")
    raise ValueError(f"{where}config.json's {RECORD_KEY} record has format {got!r}, saved by lightning-mrs {saved_by}; "
                     f"lightning-mrs {__version__} reads format {FORMAT}{_written_by(FORMAT)}: load it with "
                     f"lightning-mrs {FORMAT_RELEASES.get(got, saved_by)}, save the model's state_dict, then swap_norms "
                     "a fresh model as recorded and save_pretrained it")


def _own(cls: type) -> type:
    """The class a swapped class extends (``cls`` when it is not one)."""
    return getattr(cls, "_lightning_mrs_own", cls)


def family_base(cls: type) -> Optional[type]:
    """The first class of ``cls``'s MRO that transformers exports (``LlamaForSequenceClassification``
    for ``class MyClassifier(LlamaForSequenceClassification)``): what a swapped ``cls`` saves as."""
    transformers = _transformers()
    for c in _own(cls).__mro__:
        if c.__module__.startswith("transformers.models.") and getattr(transformers, c.__name__, None) is c:
            return c
    return None


def family_autos(config_cls: type) -> dict[str, type]:
    """Every Auto class (``AutoModel``, ``AutoModelForCausalLM``...) that builds a model for
    ``config_cls``, and the transformers class it builds."""
    transformers, found = _transformers(), {}
    for name in sorted(n for n in dir(transformers) if n.startswith("AutoModel")):
        mapping = getattr(getattr(transformers, name, None), "_model_mapping", None)
        try:
            cls = mapping[config_cls] if mapping is not None and config_cls in mapping else None
        except (KeyError, ImportError, AttributeError):  # a model whose optional dependency is missing
            continue
        if isinstance(cls, type) and getattr(transformers, cls.__name__, None) is cls:
            found[name] = cls
    return found


def auto_map(config_cls: type) -> dict[str, str]:
    """``config.json``'s ``auto_map`` for a swapped model of config class ``config_cls``."""
    code = CODE.rpartition(".")[2]
    autos = {name: f"{code}.{PREFIX}{cls.__name__}" for name, cls in family_autos(config_cls).items()}
    return {"AutoConfig": f"{code}.{PREFIX}{config_cls.__name__}", **autos}


def config_base(cls: type) -> type:
    """The family's config class of a ``LightningMRS<BaseConfig>`` (``cls`` when it is not one)."""
    return getattr(cls, "_lightning_mrs_config_base", None) or cls


def config_class(base: type) -> type:
    """``LightningMRS<BaseConfig>``: ``base`` with the ``model_type`` ``lightning_mrs_<base's>``."""
    base = config_base(base)
    with _LOCK:
        cls = _CLASSES.get(base)
        if cls is None:
            name = PREFIX + base.__name__
            importlib.import_module(CODE)  # in sys.modules: transformers' custom_object_save copies its file
            cls = type(name, (base,), {"model_type": TYPE_PREFIX + base.model_type, "__module__": CODE,
                                       "__qualname__": name, "_lightning_mrs_config_base": base,
                                       "from_dict": classmethod(_config_from_dict), "to_dict": _config_to_dict,
                                       "__doc__": f"``{base.__name__}`` of a model whose norms lightning-mrs swapped."})
            cls.register_for_auto_class("AutoConfig")
            _CLASSES[base] = cls
    return cls


def family_config(model_type: Any, swapped: bool = True) -> tuple[str, Optional[type]]:
    """``model_type``'s family (``lightning_mrs_<family>``'s if ``swapped``) and its config class, else ``None``."""
    families, family = _transformers().CONFIG_MAPPING, str(model_type).removeprefix(TYPE_PREFIX if swapped else "")
    return family, families[family] if family in families else None  # a lazy mapping: its get() finds nothing


def _config_from_dict(cls: type, config_dict: dict[str, Any], **kwargs: Any) -> Any:
    """The config of the family ``config_dict`` names, as ``AutoConfig`` reads it: a family whose model
    class is another's (``exaone``: ``LlamaForCausalLM``) keeps its own config class, whose ``model_type``
    finds its checkpoint conversion."""
    family = family_config(config_dict.get("model_type", ""))[1]
    cls = cls if family in (None, cls._lightning_mrs_config_base) else config_class(family)
    return super(cls, cls).from_dict.__func__(cls, config_dict, **kwargs)


def _config_to_dict(self: Any) -> dict[str, Any]:
    """The family's ``to_dict``, with the guard in :data:`~lightning_mrs.swap.hf_guard.GUARDED_KEYS` when the
    config holds a record: ``config.json`` refuses the family's own class, whoever writes it."""
    out = config_base(type(self)).to_dict(self)
    record = out.get(RECORD_KEY)
    if record is not None:
        out.update(dict.fromkeys(GUARDED_KEYS, guard_text(record.get("format") if isinstance(record, dict) else FORMAT)))
    return out


def swapped_class(own: type) -> type:
    """``LightningMRS<Base>``: ``own`` (a transformers model class, or a subclass of one) whose
    ``save_pretrained`` writes the custom-model format and whose ``__init__`` rebuilds a recorded swap."""
    if _own(own) is not own:  # swapped already (perhaps under a wrapper's subclass: FSDP2's)
        return own
    with _LOCK:
        cls = _CLASSES.get(own)
        if cls is None:
            base = family_base(own)
            name = PREFIX + (base or own).__name__  # a user's subclass saves as its transformers base
            body = {"__module__": CODE, "__qualname__": name, "__init__": _init, "save_pretrained": _save_pretrained,
                    "__reduce_ex__": _reduce_ex, "is_custom_code": classmethod(_is_custom_code),
                    "peft_config": peft_config,
                    "_lightning_mrs_own": own,
                    "__doc__": f"``{own.__name__}`` whose norms lightning-mrs swapped."}
            if base is not None and getattr(base, "config_class", None) is not None:
                body["config_class"] = config_class(base.config_class)
            importlib.import_module(CODE)
            cls = type(name, (own,), body)
            autos = [a for a, c in family_autos(base.config_class).items() if c is base] if base is not None else []
            if autos:
                cls.register_for_auto_class(min(autos, key=lambda a: (a != "AutoModelForCausalLM", a)))
            _CLASSES[own] = cls
    return cls


def _is_custom_code(cls: type) -> bool:
    """The answer of the class a swapped class extends (``False`` for a transformers class): its code is
    that class's, so transformers loads, initialises and saves it as that class (the family's checkpoint
    conversions, a parent's ``_init_weights`` that fills its children's buffers: FalconH1's ``mup_vector``)."""
    return _own(cls).is_custom_code()


def _new_swapped(own: type) -> nn.Module:
    cls = swapped_class(own)
    return cls.__new__(cls)


def _reduce_ex(self: nn.Module, protocol: int) -> Any:
    """Pickles and copies name the class a swapped class extends (a user's class has no name in :data:`CODE`)."""
    reduced = object.__reduce_ex__(self, protocol)
    if isinstance(reduced, tuple) and reduced[0] is copyreg.__newobj__:
        return (_new_swapped, (_own(type(self)),), *reduced[2:])
    return reduced


def rooted(layers: dict[str, LayerRecord], model: nn.Module) -> dict[str, LayerRecord]:
    """The recorded names as ``model``'s: a head's record loaded into its base model loses the base
    model's prefix (``model.``), a base model's loaded into a head gains it, as transformers maps the
    weights' keys; a head's own layers are dropped for a base model (as its weights are)."""
    prefix = getattr(model, "base_model_prefix", "")
    if not prefix:
        return layers
    has_prefix = any(name.startswith(f"{prefix}.") for name in layers)
    expects = isinstance(getattr(model, prefix, None), nn.Module)
    if has_prefix and not expects:
        return {name[len(prefix) + 1:]: r for name, r in layers.items() if name.startswith(f"{prefix}.")}
    if expects and not has_prefix:
        return {f"{prefix}.{name}": r for name, r in layers.items()}
    return layers


def plain_config(config: Any) -> Any:
    """``config`` as its family's class, without the record, the ``auto_map`` and the guard
    (:mod:`~lightning_mrs.swap.hf_guard`): a copy; ``config`` itself when it holds none of them."""
    base = config_base(type(config))
    if base is type(config) and RECORD_KEY not in vars(config) and not guarded(config):
        return config
    config = copy.deepcopy(config)
    config.__class__ = base
    for key in (RECORD_KEY, "auto_map", "model_type"):  # a loaded config.json's model_type: lightning_mrs_<family>
        vars(config).pop(key, None)
    return unguarded(config)


def _init(self: nn.Module, config: Any, *args: Any, **kwargs: Any) -> None:
    """Build the model from the family's config (as the unswapped model holds: the heads build their
    base model from it, and ``from_config(model.config)`` builds the plain model), then the record."""
    record = getattr(config, RECORD_KEY, None)
    layers = recorded_layers(record) if record is not None else {}  # a record of another format: refused first
    _own(type(self)).__init__(self, plain_config(config), *args, **kwargs)
    if layers:
        rebuild(self, None, rooted(layers, self))  # on the device the weights load to, before they load
        adopt(self)  # the base model inside too, as after swap_norms


def live_layers(model: nn.Module) -> dict[str, LayerRecord]:
    """Every norm layer of ``model`` (a transformers model) whose class is not the one its transformers
    class (:func:`family_base`, which the directory names) builds at that name, QK-norms added included;
    the reference is built on the meta device from a copy of the config."""
    config = copy.deepcopy(plain_config(model.config))  # the class's own layers, not a loaded record's
    with torch.device("meta"):
        fresh = (family_base(type(model)) or _own(type(model)))(config)
    kinds = {name: type(m) for name, m in fresh.named_modules()}
    layers: dict[str, LayerRecord] = {}
    for name, module in model.named_modules():
        if kinds.get(name) is type(module):
            continue
        spec = norm_spec(module)
        if spec is not None and spec.unsupported is None:
            layers[name] = layer_record(name, module, spec)
    return layers


def saved_config(model: nn.Module) -> Any:
    """The config ``save_pretrained`` writes for ``model``: a ``LightningMRS<BaseConfig>`` copy with
    the record of its live layers and the ``auto_map``, or a copy in the family's own class when no
    layer is swapped. ``model.config`` is not changed.

    Raises:
        ValueError: a swapped model whose class extends no class transformers exports (remote code).
    """
    layers = live_layers(model)
    config = copy.deepcopy(plain_config(model.config))
    if not layers:
        return config
    if family_base(type(model)) is None:
        raise ValueError(f"{_own(type(model)).__qualname__}.save_pretrained: lightning-mrs saves a swapped model as a "
                         "custom model of the transformers class it extends, and this class extends none (remote "
                         "code?): save its state_dict, and swap a fresh model before loading it")
    plain = type(config)
    config.__class__ = config_class(plain)
    # transformers finds the family's checkpoint conversion (reverted on save) by the config's model_type;
    # config.json holds the class's (lightning_mrs_<family>)
    config.model_type = plain.model_type
    setattr(config, RECORD_KEY, {"format": FORMAT, "version": __version__, "layers": layers})
    config.auto_map = auto_map(plain)
    return config


def _save_pretrained(self: nn.Module, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
    """``save_pretrained`` of the class this one extends, with :func:`saved_config` as the config."""
    cls, own, shared = type(self), _own(type(self)), self.config
    self.config = saved_config(self)
    if RECORD_KEY not in vars(self.config):  # no layer swapped (any more): the family's own format, no code
        self.__class__ = own
    try:
        return own.save_pretrained(self, save_directory, *args, **kwargs)
    finally:
        self.__class__, self.config = cls, shared


def adopt(model: nn.Module) -> None:
    """Make every transformers model in ``model`` a ``LightningMRS<Base>`` (in place): the outermost
    ones and those inside them (a head's base model, whose ``save_pretrained`` saves its own swap)."""
    for module in model.modules():
        # a subclass counts (a user's model class); not a wrapper (PEFT's PeftModel is no PreTrainedModel)
        if (derives_from_transformers(module) and callable(getattr(module, "save_pretrained", None))
                and derives_from_transformers(getattr(module, "config", None))):
            module.__class__ = swapped_class(type(module))
