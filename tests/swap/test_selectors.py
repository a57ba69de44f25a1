"""include/exclude: patterns match whole dotted names (or an ancestor's); one that picks nothing raises."""

from __future__ import annotations

import re

import pytest
from torch import nn

from lightning_mrs import MRSNorm, swap_norms
from lightning_mrs.callbacks import NormSwap

transformers = pytest.importorskip("transformers")
from helpers.hf import tiny_causal_lm  # noqa: E402


def _norm_types(model: nn.Module) -> dict[str, str]:
    return {n: type(m).__name__ for n, m in model.named_modules() if "norm" in n.rsplit(".", 1)[-1]}


@pytest.mark.parametrize("pattern,hint", [
    ("q_norm", "write '*.q_norm' (2 modules: model.layers.0.self_attn.q_norm, model.layers.1.self_attn.q_norm)"),
    ("self_attn", "write '*.self_attn' (2 modules"),
    ("nonexistent_layer", "(patterns match a whole dotted name or an ancestor's, e.g. 'model.layers.0.input_layernorm')"),
    ("model.layer.0", "close names: 'model.layers.0'"),
])
@pytest.mark.parametrize("option", ["exclude", "include"])
def test_a_pattern_that_picks_nothing_raises_and_leaves_the_model(option, pattern, hint):
    model = tiny_causal_lm("qwen3", num_hidden_layers=2)
    before = _norm_types(model)
    assert sum(t == "Qwen3RMSNorm" for t in before.values()) == 9
    with pytest.raises(ValueError, match=f"swap_norms: {option}={pattern!r} matches no module.*" + re.escape(hint)):
        swap_norms(model, "mrs", **{option: pattern})
    assert _norm_types(model) == before  # nothing converted


def test_whole_names_ancestors_and_globs_select_what_they_name():
    model = tiny_causal_lm("qwen3", num_hidden_layers=2)
    report = swap_norms(model, "mrs", exclude="*.q_norm")  # a glob over the whole name
    assert sorted(report.skipped) == ["model.layers.0.self_attn.q_norm", "model.layers.1.self_attn.q_norm"]
    assert len(report.converted) == 7
    model = tiny_causal_lm("qwen3", num_hidden_layers=2)
    report = swap_norms(model, "mrs", include="model.layers.1")  # an ancestor's whole name: its subtree
    assert sorted(report.converted) == sorted(f"model.layers.1.{n}" for n in (
        "input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"))
    assert isinstance(model.model.layers[1].self_attn.k_norm, MRSNorm)
    assert type(model.model.norm).__name__ == "Qwen3RMSNorm"


def test_a_type_that_picks_nothing_raises():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    with pytest.raises(ValueError, match=r"exclude=BatchNorm2d matches no module of Sequential \(its norm types: "
                                         r"LayerNorm\)"):
        swap_norms(model, "mrs", exclude=nn.BatchNorm2d)
    assert isinstance(model[1], nn.LayerNorm)


def test_an_added_qk_norm_is_selected_by_its_future_name():
    torchvision = pytest.importorskip("torchvision", reason="the QK-norm host here is torchvision's ViT")
    vit = torchvision.models.VisionTransformer(32, 8, 2, 2, 16, 32)
    report = swap_norms(vit, None, qk_norm="mrs", exclude="*encoder_layer_1.self_attention.q_norm")
    assert "encoder.layers.encoder_layer_0.self_attention.q_norm" in report.qk_added
    assert "encoder.layers.encoder_layer_1.self_attention" in report.attention_skipped


def test_normswap_names_are_the_lightning_modules_and_are_checked():
    from helpers.lightning import TinyModule, fit

    model = TinyModule()
    with pytest.raises(ValueError, match=r"exclude='5' matches no module of TinyModule .*write '\*\.5' \(1 modules: net\.5\)"):
        fit(model, callbacks=[NormSwap("mrs", exclude="5")], steps=1)
    assert type(model.net[5]) is nn.LayerNorm
