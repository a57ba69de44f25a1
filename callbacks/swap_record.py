"""NormSwap's record in a checkpoint: where it is kept, how it is found, and layer names across ``torch.compile``.

The record (what the swap built, :func:`lightning_mrs.swap.spec.describe_layers`, with the target and
the options) is plain data (dicts, lists, str, int, float, bool, None), so a checkpoint holding it
loads with ``torch.load(weights_only=True)``. It is kept in two places:

* the callback's state, ``checkpoint["callbacks"]["NormSwap..."]``, in full checkpoints;
* the LightningModule's ``state_dict`` metadata, ``state_dict._metadata[""]["lightning_mrs.NormSwap"]``:
  torch's per-module metadata (where a module's ``_version`` is kept), written by a state-dict
  post-hook (:class:`RecordHook`) that NormSwap registers on the module. Lightning's weights-only
  checkpoints (``ModelCheckpoint(save_weights_only=True)``, ``save_checkpoint(..., weights_only=True)``)
  keep no callback state, but they keep the ``state_dict``; torch saves and loads its metadata with it,
  and ``load_state_dict`` passes it to the module's load-state-dict pre-hooks, where NormSwap checks it.

A checkpoint of a model with a compiled submodule (``self.net = torch.compile(net)``) names its
layers ``net._orig_mod.1``; the same layer of an uncompiled model is ``net.1``. :func:`canonical`
drops that step, so records and weights compare and load across compilation.

Example:
    >>> canonical("net._orig_mod.1.weight")
    'net.1.weight'
"""

from __future__ import annotations

import copy
from typing import Any, Optional

from torch import nn

from lightning_mrs.swap.spec import LayerRecord

__all__ = ["RECORD_KEY", "RecordHook", "align_compiled_keys", "canonical", "find_record", "install_record",
           "local_record", "metadata_record", "model_names", "options_of", "records"]

#: the key of the record in the module's ``state_dict`` metadata
RECORD_KEY = "lightning_mrs.NormSwap"
_COMPILED = "_orig_mod"  # the submodule torch.compile's OptimizedModule wraps


class RecordHook:
    """A ``state_dict`` post-hook that writes ``record`` into the module's metadata (a copy each time).

    Holds plain data only, so a module that carries it still pickles and deep-copies.
    """

    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any]) -> None:
        if self.record:
            local_metadata[RECORD_KEY] = copy.deepcopy(self.record)


def install_record(module: nn.Module, record: dict[str, Any]) -> None:
    """Make every later ``module.state_dict()`` carry ``record``: one hook per module, updated by a later swap."""
    for hook in module._state_dict_hooks.values():  # noqa: SLF001 - torch's registry of these hooks
        if isinstance(hook, RecordHook):
            hook.record = record
            return
    module.register_state_dict_post_hook(RecordHook(record))


def is_record(state: Any) -> bool:
    return isinstance(state, dict) and ("layers" in state or "converted" in state)


def local_record(local_metadata: Any) -> Optional[dict[str, Any]]:
    """The record in one module's metadata (what a load-state-dict pre-hook gets), or ``None``."""
    found = local_metadata.get(RECORD_KEY) if isinstance(local_metadata, dict) else None
    return found if is_record(found) else None


def metadata_record(state_dict: Any) -> Optional[dict[str, Any]]:
    """The record in a ``state_dict``'s root metadata, or ``None``."""
    metadata = getattr(state_dict, "_metadata", None)
    return local_record(metadata.get("") if isinstance(metadata, dict) else None)


def find_record(checkpoint: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The NormSwap record of a checkpoint: the callback's state, else the weights' metadata (a
    weights-only checkpoint, or a bare ``state_dict``); ``None`` when it has neither."""
    for key, state in (checkpoint.get("callbacks") or {}).items():
        if str(key).startswith("NormSwap") and is_record(state):
            return state
    return metadata_record(checkpoint.get("state_dict", checkpoint))


def records(spec: dict[str, Any]) -> dict[str, LayerRecord]:
    """The layer records of a version-2 record, by :func:`canonical` name."""
    return {canonical(name): dict(record) for name, record in (spec.get("layers") or {}).items()}


def options_of(spec: dict[str, Any]) -> str:
    """The NormSwap options a record was written with, as the callback's ``repr`` shows them."""
    if "options" in spec:
        return str(spec["options"])
    if "layers" in spec:
        return f"target={spec.get('target')!r}, ..."
    return f"target={spec.get('target')!r}, spatial={spec.get('spatial', 'auto')!r}, eps={spec.get('eps')!r}"


def canonical(name: str) -> str:
    """``name`` without ``torch.compile``'s ``_orig_mod`` steps."""
    return ".".join(part for part in name.split(".") if part != _COMPILED)


def model_names(model: nn.Module) -> dict[str, str]:
    """The model's module names by :func:`canonical` name."""
    return {canonical(name): name for name, _ in model.named_modules()}


def align_compiled_keys(state_dict: dict[str, Any], model_keys: Any, prefix: str = "") -> int:
    """Rename, in place, the keys of ``state_dict`` (under ``prefix``) that name a weight of the model
    (``model_keys``, without ``prefix``) through another ``_orig_mod`` path: a checkpoint of a compiled
    submodule loaded into the uncompiled model, or the other way round. Returns how many were renamed."""
    wanted = {canonical(key): key for key in model_keys}
    renames = {}
    for key in state_dict:
        if not key.startswith(prefix):
            continue
        own = key[len(prefix):]
        target = wanted.get(canonical(own))
        if target is not None and target != own and f"{prefix}{target}" not in state_dict:
            renames[key] = f"{prefix}{target}"
    if renames:
        items = [(renames.get(key, key), value) for key, value in state_dict.items()]
        state_dict.clear()
        state_dict.update(items)  # same order, so the module loads its weights as it lists them
    return len(renames)
