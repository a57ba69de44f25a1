"""A pytest plugin that runs timm's own ``tests/test_models.py`` on swapped models.

Loaded with ``-p helpers.timm_suite_plugin`` into a pytest run of the suite fetched from the
timm source distribution (``tests/peers/test_timm_suite.py`` starts that run). It changes the
suite in two ways only, both from outside:

* every model the suite builds goes through ``lightning_mrs.swap_norms(model, TARGET)`` right
  after ``timm.create_model`` returns (``TARGET`` from ``LMRS_TIMM_TARGET``; ``none`` leaves the
  models alone: the baseline run);
* only the tests whose ``model_name`` is one of ``LMRS_TIMM_MODELS`` (comma-separated) run,
  one pretrained tag per architecture, less the three that download weights.

Each build is written, one JSON line, to ``LMRS_TIMM_RECORD``: the test, the model, how many
norm layers the swap converted, and the torch/timm norm layers it left untouched without
naming them in ``report.skipped`` or ``report.unchanged`` (a silent skip). The norm layers are
found here by class, independently of the swap's registry, so the record can catch a family
the swap does not know.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import pytest
from torch import nn

_TIMM_NORM_MODULES = {
    "timm.layers.norm", "timm.layers.norm_act", "timm.layers.evo_norm",
    "timm.layers.filter_response_norm", "timm.layers.grn", "timm.layers.split_batchnorm",
    "timm.layers.inplace_abn", "timm.layers.fast_norm",
}
_TORCH_NORMS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.RMSNorm)


# These download pretrained weights from the Hugging Face hub: not run here (no network for
# weights in the tests); every other test of the suite that takes one of the models runs.
_NEEDS_WEIGHTS = {"test_model_inference", "test_model_load_pretrained", "test_model_features_pretrained"}


def _norm_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Every torch/timm norm layer of ``model`` by name (found by class, not by the registry)."""
    found = {}
    for name, module in model.named_modules(remove_duplicate=False):
        timm_norm = any(k.__module__ in _TIMM_NORM_MODULES for k in type(module).__mro__)
        if name and (isinstance(module, _TORCH_NORMS) or timm_norm):
            found[name] = module
    return found


def _current_test() -> str:
    # "tests/test_models.py::test_model_forward[resnet18-1] (call)" -> the node id
    return os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]


def _record(entry: dict[str, Any]) -> None:
    path = os.environ.get("LMRS_TIMM_RECORD")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


def _swapping(create_model, target: str):
    """``create_model`` whose models come back swapped to ``target`` (and are recorded)."""
    from lightning_mrs import swap_norms

    @functools.wraps(create_model)
    def create_swapped(model_name, *args, **kwargs):
        model = create_model(model_name, *args, **kwargs)
        before = _norm_layers(model)
        entry: dict[str, Any] = {"test": _current_test(), "model": model_name, "norms": len(before)}
        if target == "none":
            _record(entry)
            return model
        report = swap_norms(model, target)
        after = dict(model.named_modules(remove_duplicate=False))
        accounted = set(report.skipped) | set(report.unchanged)
        entry.update(
            converted=len(report.converted),
            unchanged=len(report.unchanged),  # already the target: a LayerNorm under "layer"
            skipped=dict(report.skipped),
            silent=sorted(n for n, m in before.items() if after.get(n) is m and n not in accounted),
        )
        _record(entry)
        return model

    return create_swapped


def pytest_configure(config: pytest.Config) -> None:
    target = os.environ.get("LMRS_TIMM_TARGET", "none")
    if target not in ("none", "mrs", "rms", "layer"):
        raise pytest.UsageError(f"LMRS_TIMM_TARGET={target!r}: use none, mrs, rms or layer.")
    import lightning_mrs
    import timm
    import timm.models

    _record({"lightning_mrs": lightning_mrs.__file__, "timm": timm.__file__, "target": target})
    # Before collection imports test_models.py, so its ``from timm import create_model`` takes this one.
    wrapped = _swapping(timm.create_model, target)
    timm.create_model = wrapped
    timm.models.create_model = wrapped


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    models = {m for m in os.environ.get("LMRS_TIMM_MODELS", "").split(",") if m}
    if not models:
        raise pytest.UsageError("LMRS_TIMM_MODELS is empty: name the models to run.")
    keep, drop, seen = [], [], set()
    for item in items:
        if item.originalname in _NEEDS_WEIGHTS:
            drop.append(item)
            continue
        params = dict(getattr(getattr(item, "callspec", None), "params", {}))
        name = str(params.pop("model_name", ""))
        # The cfg tests take every pretrained tag ("resnet18.a1_in1k", ...): one tag per
        # architecture is enough, the tags share the model.
        key = (item.originalname, name.split(".")[0], repr(sorted(params.items(), key=str)))
        if name.split(".")[0] in models and key not in seen:
            seen.add(key)
            keep.append(item)
        else:
            drop.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep
