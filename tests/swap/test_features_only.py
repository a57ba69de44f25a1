"""timm ``features_only=True`` models swapped after creation (issue 45 §5).

``timm.create_model(name, features_only=True)`` wraps the classifier in a ``FeatureListNet``
(ResNet, ConvNeXt: the stages flattened, ``stages.3`` -> ``stages_3``) or a ``FeatureGetterNet``
(ViT: the model under ``model.``, its final norm and head pruned). Swapping that wrapper must
give what swapping the classifier does: its features equal the swapped classifier's
``forward_intermediates`` at the same indices (with the same weights), forward and backward. The
unswapped pair is compared the same way first, as the control of the comparison itself.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

timm = pytest.importorskip("timm", reason="features_only models are timm's")

import lightning_mrs as lm

MODELS: dict[str, dict[str, Any]] = {
    "resnet18": {},
    "convnext_atto": {},
    "vit_tiny_patch16_224": dict(img_size=32, patch_size=8, depth=3, qk_norm=True),
}


def _full_name(key: str) -> str:
    """A features model's state-dict key as the classifier's (``model.`` and ``stages_3.`` undone)."""
    key = key.removeprefix("model.")
    return re.sub(r"^([A-Za-z]+)_(\d+)\.", r"\1.\2.", key)


def _norm_count(model: nn.Module) -> int:
    return sum(1 for _ in lm.iter_norm_layers(model))


def _load_from(features: nn.Module, full: nn.Module) -> None:
    """Give ``features`` the classifier's weights; every key of ``features`` must have its twin."""
    source = full.state_dict()
    mapped = {}
    for key, value in features.state_dict().items():
        twin = _full_name(key)
        assert twin in source and source[twin].shape == value.shape, f"{key} has no twin {twin} in the classifier"
        mapped[key] = source[twin]
    features.load_state_dict(mapped)


def _forward_backward(model: nn.Module, x: torch.Tensor, features: bool, indices: Any) -> tuple[list, dict, torch.Tensor]:
    """The features, the gradients of every parameter (by classifier name) and the input's gradient
    for a fixed random cotangent."""
    x = x.clone().requires_grad_(True)
    outs = model(x) if features else model.forward_intermediates(x, indices=indices, intermediates_only=True)
    gen = torch.Generator().manual_seed(1)
    sum((o * torch.randn(o.shape, generator=gen)).sum() for o in outs).backward()
    grads = {(_full_name(n) if features else n): p.grad for n, p in model.named_parameters() if p.grad is not None}
    return [o.detach() for o in outs], grads, x.grad


def _check_pair(features: nn.Module, full: nn.Module, swapped: bool) -> None:
    indices = list(features.feature_info.out_indices)
    x = torch.randn(2, 3, 32, 32)
    got, got_grads, got_dx = _forward_backward(features, x, True, indices)
    want, want_grads, want_dx = _forward_backward(full, x, False, indices)
    assert len(got) == len(want) == len(indices)
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"feature {i} (swapped={swapped}): {m}")
    torch.testing.assert_close(got_dx, want_dx, atol=1e-5, rtol=1e-4)
    assert got_grads.keys() <= want_grads.keys()
    norm_grads = 0
    for name, grad in got_grads.items():
        torch.testing.assert_close(grad, want_grads[name], atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}: {m}")
        norm_grads += swapped and isinstance(features.get_submodule(_module_of(features, name)), (lm.MRSNorm, lm.MRSNorm2d))
    if swapped:
        assert norm_grads > 0, "no gradient reached a swapped norm"


def _module_of(features: nn.Module, full_param_name: str) -> str:
    """The features model's module that holds the classifier parameter ``full_param_name``."""
    for name, _ in features.named_parameters():
        if _full_name(name) == full_param_name:
            return name.rpartition(".")[0]
    raise KeyError(full_param_name)


@pytest.mark.parametrize("name", list(MODELS))
def test_features_only_swapped_after_creation(name: str) -> None:
    kwargs = MODELS[name]
    full = timm.create_model(name, pretrained=False, **kwargs).eval()
    features = timm.create_model(name, pretrained=False, features_only=True, **kwargs).eval()
    _load_from(features, full)
    _check_pair(features, full, swapped=False)  # the control: the comparison holds unswapped

    n_norms = _norm_count(features)
    report = lm.swap_norms(features, "mrs")
    assert len(report.converted) == n_norms > 0 and not report.skipped, str(report)
    assert _norm_count(features) == n_norms and all(
        isinstance(m, (lm.MRSNorm, lm.MRSNorm2d)) for _, m, _ in lm.iter_norm_layers(features))
    lm.swap_norms(full, "mrs")
    with torch.no_grad():  # weights off their init (one draw, copied below): a misplaced weight shows
        for module in full.modules():
            if isinstance(module, (lm.MRSNorm, lm.MRSNorm2d)):
                module.weight.add_(0.3 * torch.randn_like(module.weight))
    for module in (full, features):
        module.zero_grad(set_to_none=True)
    _load_from(features, full)
    _check_pair(features, full, swapped=True)
