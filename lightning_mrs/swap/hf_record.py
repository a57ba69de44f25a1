"""The swap of a transformers model, recorded in its config, so that ``save_pretrained`` keeps it.

transformers saves a model as ``config.json`` plus its weights, and ``from_pretrained`` rebuilds
the family's classes from the config: a swapped norm (``MRSNorm``) or an added QK-norm would come
back as the family's own layer, its weights dropped or refused. Quantizers solve the same problem
with a ``quantization_config`` in ``config.json``, read before the weights load. Every swap of a
transformers model therefore writes (:func:`record_in_configs`):

* ``config.lightning_mrs``: the swap as data, ``{"format": 1, "version", "layers": {name:
  record}}``, one :func:`~lightning_mrs.swap.layer_record.layer_record` per layer a swap built
  or added (names relative to the model that owns the config), with ``"plain": true`` where
  transformers' own class, given these weights, computes the same thing (an *own-kind* swap:
  Llama's ``LlamaRMSNorm`` -> ``nn.RMSNorm``, Gemma's -> ``OffsetRMSNorm``, which stores ``w``
  as Gemma does);
* ``config.attn_implementation = GUARD`` and ``config.experts_implementation = GUARD`` when any
  layer is not plain. transformers reads these keys of ``config.json`` as the attention and the
  experts implementation to use, and every ``PreTrainedModel.__init__`` refuses an unknown one
  (``_check_and_adjust_attn_implementation``, ``_check_and_adjust_experts_implementation``,
  transformers 5), so a plain ``AutoModelForCausalLM.from_pretrained`` of such a directory raises
  ``ValueError`` (naming lightning_mrs) instead of building another model; ``AutoConfig`` and
  tokenizers still load. The experts key keeps the guard when the call names an
  ``attn_implementation=`` (which overrides the first key): nothing but the rarely given
  ``experts_implementation=`` overrides it, and it is checked for every model, with or without
  experts. In memory both attributes are inert: the model's attention is untouched.
  The public ``swap_norms`` then makes such a model a custom architecture
  (:mod:`lightning_mrs.swap.modeling_lightning_mrs`) whose code ``save_pretrained`` writes beside
  the weights, with ``config.auto_map`` naming it, so that transformers loads the directory by
  itself with ``trust_remote_code=True``.

:func:`lightning_mrs.from_pretrained` reads the record, removes the guard, swaps the freshly built
model before its weights load, and loads them strictly. Which layers are plain is decided by
running both on the probe's float64 input (:func:`loads_as_saved`), never by class names.

Example:
    >>> from torch import nn
    >>> old, new = nn.LayerNorm(8), nn.RMSNorm(8)
    >>> loads_as_saved(old, new)  # LayerNorm's class with these weights would not compute RMSNorm
    False
"""

from __future__ import annotations

import copy
import weakref
from typing import Any, Optional

import torch
from torch import nn

from lightning_mrs.swap.attention_info import is_qk_name
from lightning_mrs.swap.hf import derives_from_transformers
from lightning_mrs.swap.layer_record import LayerRecord, layer_record
from lightning_mrs.swap.probe import TOLERANCE, _clone, _probe_input, cpu_float64
from lightning_mrs.swap.registry import norm_spec
from lightning_mrs.swap.report import SwapReport
from lightning_mrs.version import __version__

__all__ = ["GUARD", "GUARDED_KEYS", "RECORD_KEY", "guard", "hf_roots", "is_guard", "loads_as_saved", "record_in_configs",
           "recorded_layers", "swap_record", "unguard"]

RECORD_KEY = "lightning_mrs"
#: the value of ``attn_implementation`` in a swapped model's ``config.json``: an implementation
#: transformers does not know, so that a plain load (no ``trust_remote_code``) fails, naming both ways in
GUARD = ("lightning_mrs (norms swapped by lightning-mrs: load with lightning_mrs.from_pretrained, or with "
         "trust_remote_code=True to run the saved modeling_lightning_mrs.py)")
_GUARD_START = "lightning_mrs (norms swapped by lightning-mrs"  # every release's guard starts so
_FORMAT = 1
#: the config keys that hold :data:`GUARD` in ``config.json`` (each refused by transformers' model ``__init__``)
GUARDED_KEYS = ("attn_implementation", "experts_implementation")
#: transformers model -> the config :func:`record_in_configs` gave it (not kept on the config: it is saved)
_OWNED: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()


def guard(config: Any) -> None:
    """Write :data:`GUARD` into ``config``'s :data:`GUARDED_KEYS`, as plain attributes: inert in
    memory, saved into ``config.json`` by ``save_pretrained``, where a plain load refuses them."""
    for key in GUARDED_KEYS:
        setattr(config, key, GUARD)


def unguard(config: Any) -> None:
    """Undo what loading a guarded ``config.json`` did: transformers' config reads both keys into
    ``_attn_implementation`` / ``_experts_implementation``; a guard there becomes ``None`` (the
    default implementation), an implementation the caller chose stays."""
    for key in GUARDED_KEYS:
        if is_guard(getattr(config, f"_{key}", None)):
            setattr(config, f"_{key}", None)


def is_guard(value: Any) -> bool:
    """Whether ``value`` (a config's ``attn_implementation``) is the guard of any lightning-mrs release."""
    return isinstance(value, str) and value.startswith(_GUARD_START)


def recorded_layers(record: dict[str, Any], where: str = "") -> dict[str, dict[str, Any]]:
    """The layers ``record`` (a config's :data:`RECORD_KEY`) holds, as
    :func:`~lightning_mrs.swap.spec.rebuild` takes them: ``name -> layer record`` without the
    ``plain`` mark.

    Raises:
        ValueError: the record has a format this release does not read (``where`` starts the message).

    Example:
        >>> recorded_layers({"format": 1, "layers": {"norm": {"kind": "mrs", "plain": False}}})
        {'norm': {'kind': 'mrs'}}
    """
    if record.get("format") != _FORMAT:
        raise ValueError(f"{where}config.json's {RECORD_KEY} record has format {record.get('format')!r}; this "
                         f"lightning-mrs reads format {_FORMAT} (upgrade lightning-mrs)")
    return {name: {k: v for k, v in entry.items() if k != "plain"} for name, entry in (record.get("layers") or {}).items()}


def hf_roots(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost transformers models (a ``config`` and ``save_pretrained``) in ``model``:
    ``(dotted name, module)``; ``model`` itself when it is one."""
    roots: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(name.startswith(f"{r}.") or not r for r, _ in roots):
            continue
        config = getattr(module, "config", None)
        # a subclass counts (a user's model class, a test's stand-in): its save_pretrained writes the config all the same
        if (derives_from_transformers(module) and callable(getattr(module, "save_pretrained", None))
                and derives_from_transformers(config)):
            roots.append((name, module))
    return roots


def swap_record(root: nn.Module) -> Optional[dict[str, Any]]:
    """The record in a transformers model's config (``None``: not swapped)."""
    record = getattr(getattr(root, "config", None), RECORD_KEY, None)
    return record if isinstance(record, dict) else None


def _float64_cpu(module: nn.Module) -> nn.Module:
    """A CPU float64 copy of ``module`` with fresh storage (meta and offloaded weights included)."""
    return copy.deepcopy(module).to_empty(device="cpu").double()


@torch.no_grad()
def loads_as_saved(old: nn.Module, new: nn.Module) -> bool:
    """Whether ``old``'s class, given ``new``'s state dict (strictly), computes what ``new`` does:
    then a plain ``from_pretrained`` of the saved model rebuilds this layer faithfully.

    Both run on the probe's float64 ``(2, 3, C)`` input with random weights; layers of other
    layouts (channels-first) are not plain.
    """
    spec = norm_spec(new)
    if spec is None or spec.channel_dim != -1 or not spec.num_channels:
        return False
    gen = torch.Generator(device="cpu").manual_seed(1)
    with cpu_float64():
        reference = _clone(old, gen)
        trial = _float64_cpu(new)
        for t in trial.state_dict().values():
            if t.is_floating_point():
                t.uniform_(0.5, 1.5, generator=gen)
        try:
            reference.load_state_dict(trial.state_dict(), strict=True)
        except (RuntimeError, KeyError):  # other keys or shapes: the family's class cannot take them
            return False
        x = _probe_input(spec.num_channels, gen)
        try:
            y_old = type(old).forward(reference, x)
        except Exception:  # noqa: BLE001 - not runnable like this: not plain
            return False
        y_new = type(new).forward(trial, x)
    # the probe's tolerance: transformers' norms compute in float32 inside (~1e-7), another formula is off by > 1e-2
    if float((y_old.double() - y_new).abs().max() / y_new.abs().max().clamp_min(1e-30)) > TOLERANCE:
        return False
    return _same_in_float16(old, reference, trial, x)


def _same_in_float16(old: nn.Module, reference: nn.Module, trial: nn.Module, x: torch.Tensor) -> bool:
    """The two layers agree in float16 too, on a row with one channel at 300 (whose square overflows
    float16): a norm that squares in half precision (``rms-half``) is not the family's upcasting one."""
    x16 = x.clone()
    x16[..., 0] = 300.0
    x16 = x16.half()
    y_old = type(old).forward(reference.half(), x16).float()
    y_new = type(trial).forward(trial.half(), x16).float()
    if not (torch.isfinite(y_old).all() and torch.isfinite(y_new).all()):
        return bool(torch.equal(torch.isfinite(y_old), torch.isfinite(y_new)))
    return float((y_old - y_new).abs().max() / y_old.abs().max().clamp_min(1e-6)) <= 1e-2


def _relative(name: str, prefix: str) -> Optional[str]:
    if not prefix:
        return name
    return name[len(prefix) + 1:] if name.startswith(f"{prefix}.") else None


def _own_config(model: nn.Module, root: nn.Module) -> None:
    """Give ``root`` a config of its own before the record goes in: transformers keeps the config
    object a model is built from, so two models built from one config share it, and the record (and
    the guard) would otherwise make the other model save as swapped. A shallow copy: the sub-configs
    (``text_config``...) stay the objects the submodules hold; only top-level keys are written.
    Every module of ``model`` that held the old object (the base model, the attention layers, a
    wrapper's ``config``) is given the copy, so the model keeps reading one config."""
    old = root.config
    if _OWNED.get(root) is old:  # already its own (a second swap)
        return
    new = copy.copy(old)
    new.__dict__ = dict(old.__dict__)  # top-level keys of its own; the values (sub-configs) shared
    _OWNED[root] = new
    for module in model.modules():
        if module.__dict__.get("config") is old:
            module.__dict__["config"] = new


def record_in_configs(model: nn.Module, report: SwapReport, built: dict[str, tuple[nn.Module, nn.Module]]) -> None:
    """Write the layers this swap changed into the config of every transformers model in ``model``.

    Args:
        model: the swapped model (a transformers model, or any module holding one).
        report: what the swap did (converted layers, added QK-norms).
        built: converted layer name -> ``(old module, new module)``.
    """
    names = [*report.changes, *report.qk_added]
    if not names:
        return
    modules = dict(model.named_modules())
    for prefix, root in hf_roots(model):
        _own_config(model, root)
        record = copy.deepcopy(swap_record(root)) or {"format": _FORMAT, "layers": {}}
        layers: dict[str, LayerRecord] = record.setdefault("layers", {})
        for name in names:
            rel = _relative(name, prefix)
            module = modules.get(name)
            spec = norm_spec(module) if module is not None else None
            if rel is None or spec is None:
                continue
            entry = layer_record(rel, module, spec)
            if name in built:
                old, new = built[name]
                earlier = layers.get(rel, {}).get("plain", True)  # a layer swapped twice: against the family's
                entry["plain"] = bool(earlier and loads_as_saved(old, new))
            else:  # an added QK-norm: the family has no such layer
                entry["plain"] = False
            if is_qk_name(rel):
                entry["qk"] = True
            layers[rel] = entry
        record["version"] = __version__
        setattr(root.config, RECORD_KEY, record)
        if not all(entry.get("plain") for entry in layers.values()):
            guard(root.config)
