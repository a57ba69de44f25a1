"""``from_pretrained``: load a transformers model saved after a norm swap, exactly as it was saved.

A swapped transformers model saves as a custom model (:mod:`lightning_mrs.swap.hf_format`): its
swap is recorded in ``config.json``. :func:`from_pretrained` is the same mechanism as
``AutoModel*.from_pretrained(path, trust_remote_code=True)``, run from the installed lightning-mrs
(never the file in the directory): it calls the ``from_pretrained`` of ``LightningMRS<Base>``, for
the class that was saved or the one asked for (``auto_class=``), whose ``__init__`` re-applies the
recorded swap to the freshly built model *before* its weights load (so ``dtype``, ``device_map``,
offloading... work as there), and it loads the swapped layers strictly: a missing, unexpected or mismatched key of a recorded layer is an error
naming it, never a silent re-initialisation, whatever ``ignore_mismatched_sizes`` says. Every other
key, and every keyword, is transformers' business: a new classification head is re-initialised and
reported as transformers does. A directory without a record loads as transformers would load it.

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
import os
from typing import Any, Optional, Union

from torch import nn

from lightning_mrs.swap.attention_info import is_qk_name
from lightning_mrs.swap.hf_format import PREFIX, RECORD_KEY, config_base, family_config, recorded_layers, rooted, swapped_class
from lightning_mrs.swap.registry import norm_spec

__all__ = ["from_pretrained"]

#: keyword arguments of transformers' ``from_pretrained`` that also apply to reading the config
_CONFIG_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder",
                  "trust_remote_code", "proxies")


def _transformers() -> Any:
    try:
        return importlib.import_module("transformers")
    except ImportError as err:  # the [hf] extra is optional
        raise ImportError("lightning_mrs.from_pretrained needs transformers: pip install 'lightning-mrs[hf]'") from err


def _model_class(transformers: Any, source: Any, config_type: type, architectures: Any, auto_class: Optional[type]) -> type:
    """The class that was saved (``config.json``'s ``architectures``), else ``AutoModelForCausalLM``'s."""
    if auto_class is not None and not hasattr(auto_class, "_model_mapping"):
        return auto_class
    auto = auto_class or transformers.AutoModelForCausalLM
    if auto_class is None and architectures:
        cls = getattr(transformers, architectures[0].removeprefix(PREFIX), None)  # a swapped class saves as LightningMRS<Base>
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ValueError(f"{_name(source)}: config.json's architectures name {architectures[0]}, which transformers does "
                             "not define: pass auto_class= (AutoModelForSequenceClassification, your own class...)")
        return cls
    if config_type not in auto._model_mapping:
        raise ValueError(f"{_name(source)}: {auto.__name__} has no model for model_type {config_type.model_type!r}; "
                         "pass auto_class= (the Auto class or model class to build)")
    return auto._model_mapping[config_type]


def _looks_local(text: str) -> bool:
    """A name that can only mean a directory (a hub id is ``name`` or ``org/name``), as the LM recipe decides."""
    seps = tuple(s for s in (os.sep, os.altsep) if s)
    return (text.startswith((".", "~", *seps)) or text.endswith(seps) or sum(text.count(s) for s in seps) > 1
            or (len(text) > 1 and text[1] == ":"))  # a Windows drive


def _no_such_directory(text: str, why: str = "") -> FileNotFoundError:
    return FileNotFoundError(f"lightning_mrs.from_pretrained({text!r}): no such directory{why}; give the directory "
                             "save_pretrained wrote (config.json and the weights), or a hub name 'org/model'.")


def _check_source(source: Union[str, os.PathLike, None]) -> None:
    if source is None:
        return
    text = os.fspath(source)
    if os.path.isdir(text):
        return
    if os.path.exists(text):
        raise FileNotFoundError(f"lightning_mrs.from_pretrained({text!r}) is a file; give the model's directory "
                                "(config.json and the weights).")
    if isinstance(source, os.PathLike) or _looks_local(text):
        raise _no_such_directory(text)


def _read_config(transformers: Any, source: Any, config: Any, kwargs: dict[str, Any]) -> tuple[Any, type, Any]:
    """The saved config's record, its family's config class and ``architectures``, read only to find the
    class (transformers reads the config itself)."""
    if isinstance(config, transformers.PretrainedConfig):
        return getattr(config, RECORD_KEY, None), config_base(type(config)), getattr(config, "architectures", None)
    where = config if config is not None else source
    if where is None:
        raise ValueError("lightning_mrs.from_pretrained(None): give a directory, or config= (and state_dict=)")
    try:
        hub = {k: kwargs[k] for k in _CONFIG_KWARGS if k in kwargs}
        saved, _ = transformers.PretrainedConfig.get_config_dict(where, **hub)
        record = saved.get(RECORD_KEY)
        model_type, family = family_config(saved.get("model_type", ""), swapped=record is not None)
        if family is not None:
            return record, family, saved.get("architectures")
        if record is not None:
            raise ValueError(f"{_name(where)}: config.json's model_type {model_type!r} is not a transformers family")
        config = transformers.AutoConfig.from_pretrained(where, **hub)  # a model of remote code, not swapped
        return None, type(config), getattr(config, "architectures", None)
    except OSError as err:
        if isinstance(where, (str, os.PathLike)) and not os.path.isdir(where):
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            raise _no_such_directory(os.fspath(where), f", and not a model on the hub ({first})") from err
        raise


def _name(source: Any) -> str:
    """What the messages call the weights: the directory or hub name, or the ``state_dict`` given."""
    return repr(os.fspath(source)) if source is not None else "the state_dict given"


def _recorded(key: str, names: tuple[str, ...]) -> bool:
    return any(key == n or key.startswith(f"{n}.") for n in names)


def _check_loaded(source: Any, model: nn.Module, info: dict[str, Any], names: tuple[str, ...],
                  ignore_mismatched_sizes: bool) -> None:
    """Refuse any key of a recorded layer that did not load, and any norm weight of another size; the
    rest as transformers does."""
    modules = dict(model.named_modules())

    def of_a_norm(key: str) -> bool:
        owner = modules.get(key.rpartition(".")[0])
        return _recorded(key, names) or (owner is not None and norm_spec(owner) is not None)

    problems = [f"{what} {sorted(keys)[:5]}" for what, keys in (
        ("missing", [k for k in info["missing_keys"] if _recorded(k, names)]),
        ("unexpected", [k for k in info["unexpected_keys"] if _recorded(k, names)]),
        ("mismatched", [k for k, *_ in info["mismatched_keys"] if of_a_norm(k)])) if keys]
    problems += list(info["error_msgs"][:3])
    if problems:
        raise ValueError(f"{_name(source)}: the saved weights do not fit the norm layers rebuilt from its {RECORD_KEY} record "
                         f"({'; '.join(problems)}); was config.json edited, or saved by another lightning-mrs? "
                         "(ignore_mismatched_sizes never re-initialises a swapped norm)")
    if not ignore_mismatched_sizes and info["mismatched_keys"]:  # transformers' own error, which we asked it not to raise
        sizes = "; ".join(f"size mismatch for {k}: the checkpoint has {tuple(a)}, the model {tuple(b)}"
                          for k, a, b in sorted(info["mismatched_keys"])[:5])
        raise RuntimeError(f"Error(s) in loading state_dict from {_name(source)}: {sizes}. Pass ignore_mismatched_sizes=True "
                           "to re-initialise these weights (never a swapped norm's).")


def _stray_norm_weights(source: Any, model: nn.Module, info: dict[str, Any]) -> None:
    """Refuse checkpoint weights of norms the built model lacks (an added QK-norm, a bias its norm has
    not): transformers drops them as "unexpected", and the model would silently be another one."""
    modules = dict(model.named_modules())

    def of_a_norm(key: str) -> bool:
        owner = key.rpartition(".")[0]
        return norm_spec(modules[owner]) is not None if owner in modules else is_qk_name(owner)

    stray = sorted(key for key in info["unexpected_keys"] if of_a_norm(key))
    if stray:
        raise ValueError(f"{_name(source)}: the weights hold norm parameters that {type(model).__name__} built from this config "
                         f"lacks ({stray[:4]}{' ...' if len(stray) > 4 else ''}): they come from a model swapped by "
                         f"lightning-mrs, and the config given has no (or another) {RECORD_KEY} record. Load the "
                         "directory the swapped model's save_pretrained wrote, or pass its config "
                         "(config=AutoConfig.from_pretrained(directory, trust_remote_code=True)).")


def from_pretrained(pretrained_model_name_or_path: Union[str, os.PathLike, None], *model_args: Any,
                    auto_class: Optional[type] = None, **kwargs: Any) -> Any:
    """Load a (swapped or plain) transformers model from a directory or hub name.

    Everything transformers' ``from_pretrained`` takes is taken, with its meaning there: the loader
    calls it (on a subclass whose ``__init__`` re-applies the recorded swap) with the same keywords.

    Args:
        pretrained_model_name_or_path: a directory ``save_pretrained`` wrote, a hub name, or
            ``None`` with ``config=`` and ``state_dict=``.
        *model_args: passed to the model's ``__init__``, as by transformers.
        auto_class: the class to build (``AutoModelForSequenceClassification``, a model class of
            transformers or your own); default: the class that was saved (``config.architectures``;
            a name transformers lacks asks for ``auto_class=``), else a causal LM.
        **kwargs: transformers' ``from_pretrained`` keywords: ``dtype``, ``device_map``,
            ``offload_folder``, ``attn_implementation``, ``revision``, ``state_dict``,
            ``config`` (a config or a path; for a swapped model's weights, one that holds the record:
            ``AutoConfig.from_pretrained(directory, trust_remote_code=True)``), ``output_loading_info`` (then ``(model, info)`` is
            returned, transformers' info of the load), ``ignore_mismatched_sizes`` (re-initialises
            mismatched weights, never a swapped norm's), and config overrides such as
            ``num_labels=5`` or ``use_cache=False`` (read into the config as transformers does when
            no ``config=`` object is given).

    Returns:
        The model, its recorded norm swap re-applied and its weights loaded; ``(model, info)``
        with ``output_loading_info=True``.

    Raises:
        FileNotFoundError: no such directory (a path that can only be local, or a name that is
            neither a directory nor a model on the hub).
        ValueError: the saved weights do not fit the rebuilt norm layers (missing, unexpected or
            mismatched keys, listed; ``ignore_mismatched_sizes`` does not change this), the record
            does not fit the architecture or has another format (naming the release it needs), or
            ``architectures`` names a class transformers lacks and no ``auto_class=`` is given.
        RuntimeError: other weights have other shapes and ``ignore_mismatched_sizes`` is not set
            (as transformers raises).
        ImportError: transformers is not installed.

    Example:
        >>> import tempfile
        >>> from transformers import LlamaConfig, LlamaForSequenceClassification
        >>> from lightning_mrs import swap_norms
        >>> model = LlamaForSequenceClassification(LlamaConfig(
        ...     vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        ...     num_attention_heads=4, num_labels=3, pad_token_id=0))
        >>> _ = swap_norms(model, "mrs")
        >>> path = tempfile.mkdtemp()
        >>> model.save_pretrained(path)
        >>> again, info = from_pretrained(path, num_labels=5, ignore_mismatched_sizes=True,
        ...                               output_loading_info=True)
        >>> [(key, tuple(saved), tuple(now)) for key, saved, now in info["mismatched_keys"]]
        [('score.weight', (3, 32), (5, 32))]
    """
    transformers = _transformers()
    _check_source(pretrained_model_name_or_path)
    source = pretrained_model_name_or_path
    record, config_type, architectures = _read_config(transformers, source, kwargs.get("config"), kwargs)
    base = _model_class(transformers, source, config_type, architectures, auto_class)
    wants_info = kwargs.pop("output_loading_info", False)
    if record is None:
        model, info = base.from_pretrained(source, *model_args, output_loading_info=True, **kwargs)
        _stray_norm_weights(source, model, info)
        return (model, info) if wants_info else model
    layers = recorded_layers(record, f"{_name(source)}: ")

    # LightningMRS<Base> re-applies the record to the freshly built model before the weights load
    building = swapped_class(base)
    ignore = bool(kwargs.pop("ignore_mismatched_sizes", False))
    # transformers reports mismatches to us instead of raising; _check_loaded raises what it would have
    model, info = building.from_pretrained(source, *model_args, ignore_mismatched_sizes=True,
                                           output_loading_info=True, **kwargs)
    _check_loaded(source, model, info, tuple(rooted(layers, model)), ignore)
    _stray_norm_weights(source, model, info)
    return (model, info) if wants_info else model
