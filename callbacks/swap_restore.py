"""A NormSwap checkpoint back on a fresh model: :func:`restore` (``NormSwap.restore``) and
:func:`rebuild_recorded` (``NormSwapMixin``, for ``LightningModule.load_from_checkpoint``).

A fresh model has the norms it was built with; the checkpoint's weights are those of the
swapped layers. Both rebuild the recorded swap (:func:`lightning_mrs.swap.spec.rebuild`)
before the weights load. The record is found in the callback's state or in the weights'
metadata (:mod:`lightning_mrs.callbacks.swap_record`), so weights-only checkpoints restore too.
Files are read with ``torch.load(weights_only=True)`` unless the caller passes ``weights_only=False``.
"""

from __future__ import annotations

import os
from typing import Any, Union

from torch import nn

from lightning_mrs.callbacks.checkpoint_file import is_sharded, load_weights, read_metadata
from lightning_mrs.callbacks.swap_record import align_compiled_keys, canonical, find_record, model_names, records
from lightning_mrs.swap.options import check_bool, check_model
from lightning_mrs.swap.hf_format import adopt
from lightning_mrs.swap.spec import describe_layers, rebuild, rebuild_v1

__all__ = ["rebuild_recorded", "restore"]

_OWNER = "NormSwap.restore"


def restore(
    model: nn.Module, checkpoint_path: Union[str, os.PathLike], map_location: Any = "cpu", strict: bool = True,
    weights_only: bool = True,
) -> nn.Module:
    """What :meth:`lightning_mrs.callbacks.NormSwap.restore` does (documented there)."""
    check_model(_OWNER, model)
    check_bool(_OWNER, "strict", strict)
    check_bool(_OWNER, "weights_only", weights_only)
    checkpoint = read_metadata(checkpoint_path, map_location, owner=_OWNER, weights_only=weights_only,
                               opt_in=f"{_OWNER}(model, path, weights_only=False)", mmap=True)  # no optimizer state
    spec = find_record(checkpoint)
    if spec is None:
        raise ValueError(
            f"{_OWNER}: {checkpoint_path} holds no NormSwap record: it was trained without the NormSwap callback, "
            "or saved with weights_only=True by lightning-mrs 0.2 or older (which kept the record in full "
            "checkpoints only). Call lightning_mrs.swap_norms(model, ...) with the training options yourself, then "
            "model.load_state_dict(checkpoint['state_dict'])."
        )
    configure_model = getattr(model, "configure_model", None)
    if callable(configure_model) and not spec.get("before_configure_model"):
        configure_model()  # models built there (Lightning asks for it to be idempotent)
    try:
        rebuild_recorded(model, spec)
    except ValueError as err:
        raise ValueError(f"{_OWNER}({checkpoint_path}): {err}") from None
    if not is_sharded(checkpoint_path):
        align_compiled_keys(checkpoint.get("state_dict", checkpoint), model.state_dict().keys())
    load_weights(model, checkpoint_path, checkpoint, strict)
    return model


def rebuild_recorded(model: nn.Module, spec: dict[str, Any]) -> None:
    """Swap ``model`` as the NormSwap record ``spec`` says, the record's names mapped onto the
    model's (with or without ``torch.compile``'s ``_orig_mod`` step); nothing changes when the
    model is swapped so already.

    Raises:
        ValueError: the model cannot be made to match (another architecture), listing the layers.
    """
    if "layers" not in spec:
        rebuild_v1(model, spec)
    else:
        here = {canonical(name): record for name, record in describe_layers(model, spec["target"]).items()}
        if here == records(spec):
            return  # swapped already (in __init__, or a model built with these layers)
        names = model_names(model)
        rebuild(model, spec["target"], {names.get(name, name): record for name, record in records(spec).items()})
    adopt(model)  # a transformers model inside becomes LightningMRS<Base>, as after swap_norms: save_pretrained keeps the format
