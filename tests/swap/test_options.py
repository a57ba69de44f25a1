"""SwapOptions: validation with the valid choices in the message, and one object for both entry points."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
from torch import nn

from lightning_mrs import RMSNorm2d, SwapOptions, swap_norms

FIELDS = [f.name for f in dataclasses.fields(SwapOptions)]


def _net() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Linear(4, 6), nn.LayerNorm(6))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(target="batch"), "target='batch' is not valid; choose one of ['mrs', 'rms', 'layer', 'rms-half', "
                               "'mrs-half', 'rms-half-safe', 'mrs-half-safe', 'dyt', 'derf'], or None to keep "
                               "the body's norms."),
        (dict(target=None, qk_norm=True), "qk_norm=True asks for QK-norms of the target's kind, but target=None; name "
                                          "the kind instead, e.g. qk_norm='mrs'"),
        *[(dict(qk_norm=qk), f"qk_norm={qk!r} is not valid; choose one of [None, True, False, 'mrs', 'rms', 'layer']")
          for qk in ("batch", "MRS", 1)],
        (dict(spatial="yes"), "spatial='yes' is not valid; choose one of ['auto', True, False]"),
        (dict(spatial=1), "spatial=1 is not valid; choose one of ['auto', True, False]"),
        (dict(init="zeros"), "init='zeros' is not valid; choose one of ['inherit', 'ones', 'calibrate']"),
        *[(dict(eps=eps), f"eps={eps!r} is not valid; choose None (keep each layer's eps) or a finite float > 0")
          for eps in (0.0, -1e-5, True, "1e-5", math.nan, math.inf)],
    ],
)
def test_bad_values_raise_listing_the_valid_ones(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SwapOptions(**kwargs)
    model = _net()
    with pytest.raises(ValueError, match=re.escape(message)):
        swap_norms(model, **kwargs)
    assert isinstance(model[1], nn.BatchNorm2d)  # untouched


def test_qk_kind_is_the_kind_of_qk_norm_added():
    cases = [("rms", True), ("rms", "layer"), ("mrs", None), ("mrs", False), (None, "mrs")]
    assert [SwapOptions(t, qk_norm=q).qk_kind for t, q in cases] == ["rms", "layer", None, None, "mrs"]


def test_unknown_options_raise_listing_the_valid_ones_and_the_closest():
    valid = f"valid options: {FIELDS}."
    with pytest.raises(TypeError, match=re.escape(f"swap_norms: unknown option(s) ['spatail'] (did you mean 'spatial'?); "
                                                  f"{valid}")):
        swap_norms(_net(), spatail=True)
    with pytest.raises(TypeError, match=re.escape(f"swap_norms: unknown option(s) ['a', 'b']; {valid}")):
        swap_norms(_net(), SwapOptions(), b=1, a=2)  # also next to an options object; no close name
    with pytest.raises(TypeError, match=re.escape(f"SwapOptions: unknown option(s) ['exlude', 'inclde'] (did you mean "
                                                  f"'exclude', 'include'?); {valid}")):
        SwapOptions("mrs", exlude="fc", inclde="head")  # the class itself, not only swap_norms/NormSwap


@pytest.mark.parametrize(
    "kwargs,message",
    [
        *[(dict(strict=v), f"SwapOptions: strict={v!r} is not valid; choose True or False.") for v in ("yes", 1, None)],
        *[(dict(**{option: v}), f"SwapOptions: {option}={v!r} ({type(v).__name__}) is not valid; pass a dotted-name "
                                "pattern (e.g. 'head.*'), a module type (e.g. nn.BatchNorm2d), or a list of them.")
          for option in ("include", "exclude") for v in (3, 1.5, nn.BatchNorm2d(4))],
    ],
)
def test_wrong_types_raise_naming_the_option_and_what_is_accepted(kwargs, message):
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        SwapOptions(**kwargs)
    model = _net()
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        swap_norms(model, **kwargs)
    assert isinstance(model[1], nn.BatchNorm2d)  # untouched


@pytest.mark.parametrize("model,example", [("resnet18", "timm.create_model('resnet18')"),
                                           (None, 'timm.create_model("resnet18")')])
def test_a_model_that_is_not_a_module_is_refused(model, example):
    message = (f"swap_norms: model must be a torch.nn.Module, got {type(model).__name__} ({model!r}); build the model "
               f"first and pass it, e.g. {example}.")
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        swap_norms(model)


def test_selectors_become_tuples_and_bad_entries_are_refused():
    assert SwapOptions(include="head").include == ("head",)
    assert SwapOptions(exclude=[nn.BatchNorm2d, "a.*"]).exclude == (nn.BatchNorm2d, "a.*")
    assert SwapOptions().include == () and SwapOptions().exclude == ()
    with pytest.raises(TypeError, match=r"exclude=...\): each entry must be a module type .* or a dotted-name pattern"):
        SwapOptions(exclude=["a", 3])


def test_options_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SwapOptions().target = "rms"


def test_an_options_object_does_what_the_keywords_do():
    options = SwapOptions("rms", spatial=False, exclude="3")
    by_object, by_keywords = _net(), _net()
    report = swap_norms(by_object, options)
    swap_norms(by_keywords, "rms", spatial=False, exclude="3")
    assert report.options == options
    assert [type(m) for m in by_object] == [type(m) for m in by_keywords]
    assert [type(m) for m in by_object] == [nn.Conv2d, RMSNorm2d, nn.Linear, nn.LayerNorm]
    assert not by_object[1].spatial
    # keywords next to an object replace its fields
    model = _net()
    assert swap_norms(model, options, spatial=True, exclude=()).options == SwapOptions("rms", spatial=True)
    assert isinstance(model[1], RMSNorm2d) and model[1].spatial and isinstance(model[3], nn.RMSNorm)


def test_describe_lists_what_differs_from_the_defaults():
    assert SwapOptions().describe() == "target='mrs'"
    assert SwapOptions("rms", spatial=False, exclude="head", eps=1e-3).describe() == (
        "target='rms', spatial=False, exclude=('head',), eps=0.001"
    )
    assert SwapOptions("mrs", spatial="auto", init="inherit").describe() == "target='mrs'"
