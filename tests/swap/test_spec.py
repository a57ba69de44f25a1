"""spec: a swapped model's norms as records, rebuilt on a fresh model (no Lightning involved)."""

from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
from torch import nn

from lightning_mrs import MRSNorm, MRSNorm2d, NormAct, swap_norms
from lightning_mrs.swap.spec import describe_layers, differences, format_record, rebuild, rebuild_v1


def _net() -> nn.Sequential:
    """Every source kind of a small conv net: BatchNorm, GroupNorm, channels-last LayerNorm."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 6, 1), nn.GroupNorm(3, 6, eps=1e-3), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 4), nn.LayerNorm(4), nn.Linear(4, 3),
    )


def _trained(swap: Callable[[nn.Module], None], factory: Callable[[], nn.Module] = _net) -> nn.Module:
    """``factory()`` swapped by ``swap``, with random weights (so a load that misses one is seen)."""
    torch.manual_seed(0)
    model = factory()
    swap(model)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(0.5, 1.5)
    return model.eval()


def rec(kind: str, channel_dim: int, spatial, eps: float) -> dict:
    return {"kind": kind, "channel_dim": channel_dim, "spatial": spatial, "eps": eps}


def test_describe_layers_lists_what_the_swap_built():
    model = _net()
    swap_norms(model, "mrs")
    assert describe_layers(model, "mrs") == {
        "1": rec("mrs", 1, True, 1e-5),  # BatchNorm -> per sample under "auto"
        "4": rec("mrs", 1, True, 1e-3),  # GroupNorm keeps its eps
        "9": rec("mrs", -1, None, 1e-5),
    }
    model = _net()
    swap_norms(model, "mrs", spatial=False, eps=1e-4, exclude="9")
    assert describe_layers(model, "mrs") == {"1": rec("mrs", 1, False, 1e-4), "4": rec("mrs", 1, False, 1e-4)}
    assert describe_layers(model, "rms") == {}
    assert describe_layers(model, "layer") == {"9": rec("layer", -1, None, 1e-5)}


def test_describe_layers_lists_layers_that_already_were_of_the_target_kind():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), MRSNorm2d(4, spatial=False), nn.BatchNorm2d(4), nn.LayerNorm([2, 4]))
    assert describe_layers(model, "mrs") == {"1": rec("mrs", 1, False, 1e-6)}
    swap_norms(model, "mrs")
    assert list(describe_layers(model, "mrs")) == ["1", "2"]
    # the baselines: GroupNorm(1, C) is the per-sample LayerNorm, GroupNorm(2, C) is not; a multi-dim
    # LayerNorm is no swap target (unsupported)
    model = nn.Sequential(nn.GroupNorm(1, 4), nn.GroupNorm(2, 4), nn.LayerNorm([2, 4]), nn.LayerNorm(4))
    assert describe_layers(model, "layer") == {"0": rec("group", 1, True, 1e-5), "3": rec("layer", -1, None, 1e-5)}
    valid = r"\['mrs', 'rms', 'layer', 'rms-half', 'mrs-half', 'rms-half-safe', 'mrs-half-safe', 'dyt', 'derf'\]"
    with pytest.raises(ValueError, match=rf"target='batch' is not valid; choose one of {valid}"):
        describe_layers(model, "batch")


SWAPS = {
    "mrs-auto": ("mrs", lambda m: swap_norms(m, "mrs")),
    "mrs-position-eps": ("mrs", lambda m: swap_norms(m, "mrs", spatial=False, eps=1e-4)),
    "mrs-mixed": ("mrs", lambda m: (swap_norms(m, "mrs", include="1"), swap_norms(m, "mrs", spatial=False, eps=2e-5))),
    "rms": ("rms", lambda m: swap_norms(m, "rms")),
    "layer-position": ("layer", lambda m: swap_norms(m, "layer", spatial=False, exclude="4")),
}


@pytest.mark.parametrize("target,swap", SWAPS.values(), ids=list(SWAPS))
def test_rebuild_gives_the_trained_model_back(target, swap):
    trained = _trained(swap)
    records = describe_layers(trained, target)
    fresh = _net()
    rebuild(fresh, target, records)
    assert describe_layers(fresh, target) == records
    assert [type(m) for m in fresh.modules()] == [type(m) for m in trained.modules()]
    fresh.load_state_dict(trained.state_dict())
    x = torch.randn(2, 3, 6, 5)
    torch.testing.assert_close(fresh.eval()(x), trained(x), atol=0, rtol=0)


def test_rebuild_of_a_fused_norm_act_layer():
    ta = pytest.importorskip("timm.layers")

    def factory() -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, 8, 1), ta.BatchNormAct2d(8, act_layer=nn.ReLU))

    trained = _trained(lambda m: swap_norms(m, "mrs"), factory)
    records = describe_layers(trained, "mrs")
    assert list(records) == ["1.norm"]  # while the fresh model has the fused layer at 1
    fresh = factory()
    rebuild(fresh, "mrs", records)
    assert isinstance(fresh[1], NormAct) and isinstance(fresh[1].norm, MRSNorm2d) and isinstance(fresh[1].act, nn.ReLU)
    fresh.load_state_dict(trained.state_dict())
    x = torch.randn(2, 3, 4, 4)
    torch.testing.assert_close(fresh.eval()(x), trained(x), atol=0, rtol=0)


def test_rebuild_takes_names_literally():
    # ModuleDict keys may hold fnmatch's special characters: "a*" must not also pick "ab"
    def factory() -> nn.Module:
        bn, ln = nn.BatchNorm2d, nn.LayerNorm
        return nn.ModuleDict({"a*": bn(4), "ab": bn(4), "c[1]": ln(4), "c1": ln(4)})

    trained = _trained(lambda m: swap_norms(m, "mrs", exclude=["ab", "c1"]), factory)
    records = describe_layers(trained, "mrs")
    assert list(records) == ["a*", "c[1]"]
    fresh = factory()
    rebuild(fresh, "mrs", records)
    assert [type(m).__name__ for m in fresh.values()] == ["MRSNorm2d", "BatchNorm2d", "MRSNorm", "LayerNorm"]


def test_rebuild_on_another_model_lists_the_layers():
    records = describe_layers(_trained(lambda m: swap_norms(m, "mrs")), "mrs")
    other = nn.Sequential(nn.Conv2d(3, 8, 1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 6, 1), nn.LayerNorm(6))
    with pytest.raises(ValueError) as info:
        rebuild(other, "mrs", records)
    assert str(info.value).splitlines() == [
        "the model does not match the recorded swap:",
        "  4: recorded mrs(channels-first, per sample, eps=0.001), this model mrs(channels-last, eps=0.001)",
        "  9: recorded mrs(channels-last, eps=1e-05), this model not swapped",
        "Pass a freshly built model of the class that was trained.",
    ]


def test_format_record_and_differences():
    a = rec("mrs", 1, True, 1e-5)
    assert format_record(a) == "mrs(channels-first, per sample, eps=1e-05)"
    assert format_record(rec("rms2d", 1, False, 1e-6)) == "rms2d(channels-first, per position, eps=1e-06)"
    assert format_record(rec("layer", -1, None, None)) == "layer(channels-last, eps=default)"
    assert format_record(None) == "not swapped"
    assert differences({"x": a}, {"x": a}) == []
    many = {str(i): a for i in range(7)}
    lines = differences(many, {}, labels=("old", "new"), limit=3)
    assert lines == [f"{i}: old {format_record(a)}, new not swapped" for i in "012"] + ["... and 4 more"]


def _v1(converted: list[str], spatial="auto") -> dict:
    return {"version": 1, "lightning_mrs": "0.1.0", "target": "mrs", "spatial": spatial, "eps": None,
            "converted": converted}


def test_rebuild_v1_applies_the_recorded_options_to_the_recorded_names():
    trained = _trained(lambda m: swap_norms(m, "mrs", spatial=False, include=["1", "9"]))
    fresh = _net()
    rebuild_v1(fresh, _v1(["1", "9"], spatial=False))
    assert describe_layers(fresh, "mrs") == describe_layers(trained, "mrs")
    assert isinstance(fresh[4], nn.GroupNorm) and isinstance(fresh[9], MRSNorm)
    fresh.load_state_dict(trained.state_dict())
    with pytest.raises(ValueError, match=r"converted \['12'\], which this model does not have"):
        rebuild_v1(_net(), _v1(["1", "12"]))
    with pytest.raises(ValueError, match=r"no converted layers.*swap_norms\(model, 'mrs', spatial='auto', eps=None\)"):
        rebuild_v1(copy.deepcopy(fresh), _v1([]))
