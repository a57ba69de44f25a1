"""A ``torch.fx`` graph whose norms are function calls is refused, not swapped to nothing (issue 54 §4, case 6).

``timm.create_model(..., features_only=True, feature_cls="fx")`` inlines timm's LayerNorm/LayerNorm2d
as ``layer_norm`` calls: before, ``swap_norms`` converted 0 layers, noted "no norm layer" and the model
kept its LayerNorms. Now it raises one line, the model untouched; swapping the eager model first,
then wrapping it, gives exactly the swapped eager model's features.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_mrs import swap_norms
from lightning_mrs.swap.fx_calls import norm_calls

timm = pytest.importorskip("timm")

TARGETS = ("mrs", "rms", "layer")
FX_MODELS = {  # timm fx feature models whose norms timm's tracer inlines (name -> create_model kwargs)
    "convnext_atto": {},  # LayerNorm2d in the stages, LayerNorm nowhere else: all inlined
    "vit_tiny_patch16_224": {"img_size": 32, "patch_size": 8, "depth": 2, "out_indices": (0, 1)},
}


def _randomise(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


@pytest.mark.parametrize("name", list(FX_MODELS))
def test_a_timm_fx_feature_model_is_refused_and_left_untouched(name: str) -> None:
    torch.manual_seed(0)
    fx = _randomise(timm.create_model(name, features_only=True, feature_cls="fx", **FX_MODELS[name]))
    assert norm_calls(fx.graph_module)  # the norms are call nodes, no layer holds them
    x = torch.randn(2, 3, 32, 32)
    before, code, state = fx(x), fx.graph_module.code, copy.deepcopy(fx.state_dict())
    for target in TARGETS:
        with pytest.raises(ValueError) as err:
            swap_norms(fx, target, strict=False)  # refused even where a swap may skip layers
        message = str(err.value)
        assert "\n" not in message and message.startswith("swap_norms: graph_module is a torch.fx GraphModule that "
                                                           "computes")
        assert "layer_norm" in message and "swap the eager model first, then trace it" in message
    assert fx.graph_module.code == code and fx.state_dict().keys() == state.keys()
    assert all(torch.equal(fx.state_dict()[k], v) for k, v in state.items())
    for a, b in zip(fx(x), before):
        assert torch.equal(a, b)


class Functional(nn.Module):
    """A norm written as a function call in ``forward``, on activations: what a tracer inlines."""

    def __init__(self, call: str) -> None:
        super().__init__()
        self.call = call
        self.weight = nn.Parameter(torch.rand(8) + 0.5)
        self.bias = nn.Parameter(torch.randn(8) * 0.1)
        self.register_buffer("mean", torch.zeros(8))
        self.register_buffer("var", torch.ones(8))

    def forward(self, x: Tensor) -> Tensor:  # x: (N, 8, H, W)
        if self.call == "layer_norm":
            return F.layer_norm(x.permute(0, 2, 3, 1), [8], self.weight, self.bias).permute(0, 3, 1, 2)
        if self.call == "torch.layer_norm":
            return torch.layer_norm(x.transpose(1, -1), [8], self.weight, self.bias, 1e-5)
        if self.call == "group_norm":
            return F.group_norm(x, 2, self.weight, self.bias)
        if self.call == "batch_norm":
            return F.batch_norm(x, self.mean, self.var, self.weight, self.bias)
        if self.call == "instance_norm":
            return F.instance_norm(x, weight=self.weight, bias=self.bias)
        return F.rms_norm(x.transpose(1, -1), [8], self.weight)  # rms_norm


@pytest.mark.parametrize("call", ["layer_norm", "torch.layer_norm", "group_norm", "batch_norm", "instance_norm",
                                  "rms_norm"])
def test_every_functional_norm_in_a_traced_graph_is_refused(call: str) -> None:
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Conv2d(3, 8, 1), Functional(call)))
    assert len(norm_calls(gm)) == 1
    with pytest.raises(ValueError, match=r"^swap_norms: the model is a torch.fx GraphModule that computes 1 norms as "
                                         r"function calls, not layers \(1 \w+\)"):
        swap_norms(gm, "mrs")
    swap_norms(gm, None)  # no target: the body's norms are kept, nothing to refuse


def test_an_exported_programs_module_is_refused() -> None:
    # torch.export's graph holds aten ops (aten.batch_norm.default, ...), the same norms as call nodes
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.GroupNorm(2, 8), nn.Flatten(),
                          nn.LayerNorm(8 * 6 * 6), nn.RMSNorm(8 * 6 * 6)).eval()
    exported = torch.export.export(model, (torch.randn(2, 3, 8, 8),)).module()
    assert sorted(n.target.__name__.split(".")[0] for n in norm_calls(exported)) == [
        "batch_norm", "group_norm", "layer_norm", "rms_norm"]
    # refused as an exported module, whatever its graph holds (tests/swap/test_graph_exits.py)
    with pytest.raises(ValueError, match=r"^swap_norms: the model is a torch.export module \(\w+\), whose layers"):
        swap_norms(exported, "rms")


def test_a_weight_standardisation_is_not_a_norm_layer() -> None:
    # timm's ScaledStdConv2d standardises its weight with F.batch_norm: not an activation's norm,
    # so the traced graph is swapped as the eager model is (no norm layer, a note, no error)
    torch.manual_seed(0)
    eager = nn.Sequential(timm.layers.ScaledStdConv2d(3, 8, 3), nn.ReLU())
    gm = torch.fx.symbolic_trace(eager)
    assert any("batch_norm" in str(n.target) for n in gm.graph.nodes) and not norm_calls(gm)
    x = torch.randn(2, 3, 8, 8)
    expected = eager(x)
    reports = swap_norms(eager, "mrs"), swap_norms(gm, "mrs")
    assert [(r.converted, len(r.notes)) for r in reports] == [([], 1), ([], 1)]
    assert all("has no norm layer" in r.notes[0] for r in reports)
    assert torch.equal(gm(x), expected)


@pytest.mark.parametrize("target", ["mrs", pytest.param("rms", marks=pytest.mark.slow),
                                    pytest.param("layer", marks=pytest.mark.slow)])
def test_swap_first_then_wrap_equals_the_swapped_eager_model(target: str) -> None:
    torch.manual_seed(0)
    model = timm.create_model("convnext_atto")
    swap_norms(model, target)
    _randomise(model)
    x = torch.randn(2, 3, 32, 32)
    eager = model.forward_intermediates(x, indices=[0, 3], intermediates_only=True)
    # what features_only=True, feature_cls="fx" builds, from the swapped model
    wrapped = timm.models.FeatureGraphNet(model, out_indices=(0, 3))
    # each swapped norm is one node of its fx-wrapped forward (target layer: timm's LayerNorm2d, already the target)
    calls = {n.target.__name__ for n in norm_calls(wrapped.graph_module)}
    assert calls == {{"mrs": "_mrs_norm_layer", "rms": "_rms_norm_2d", "layer": "layer_norm"}[target]}
    feats = wrapped(x)
    assert len(feats) == 2
    for a, b in zip(feats, eager):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="no swap can replace"):  # swapped nodes in a graph cannot be swapped again
        swap_norms(wrapped, "rms")
