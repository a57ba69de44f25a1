"""Hugging Face causal LMs (tiny, from configs): every family's norms are recognised, reported
and swapped; the swap to the family's own kind reproduces the original logits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers.hf import FAMILIES, LAYERNORM_FAMILIES, NORMS, tiny_causal_lm, token_batch
from lightning_mrs import Derf, DyT, MRSNorm, OffsetRMSNorm, iter_norm_layers, norm_spec, swap_norms

ALL = {**NORMS, **LAYERNORM_FAMILIES}


def _norm_like(model: nn.Module) -> set[str]:
    """Every module a user would call a norm: a spec, or a leaf class named *Norm*."""
    return {name for name, m in model.named_modules()
            if norm_spec(m) is not None or (not m._modules and "Norm" in type(m).__name__)}


def _own_target(family: str) -> str:
    return "rms" if ALL[family].startswith("rms") else "layer"


@pytest.mark.parametrize("family", list(ALL))
def test_the_probe_finds_what_the_source_says(family):
    model = tiny_causal_lm(family)
    layers = list(iter_norm_layers(model))
    assert layers
    for name, module, spec in layers:
        assert spec.unsupported is None, (name, spec.unsupported)
        if ALL[family] == "torch":
            assert type(module) is nn.LayerNorm and spec.kind == "layer"
        else:
            assert spec.kind == "probed" and str(spec.formula).split(", eps=")[0] == ALL[family], name
            eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-5))  # OLMo: 1e-5 in its forward
            assert spec.formula.eps == pytest.approx(eps)


@pytest.mark.parametrize("family", list(ALL))
def test_the_own_kind_reproduces_the_logits(family):
    model, tokens = tiny_causal_lm(family), token_batch()
    with torch.no_grad():
        expected = model(tokens).logits
    report = swap_norms(model, _own_target(family))
    layers = [n for n, _, _ in iter_norm_layers(model)]
    assert set(report.converted) | set(report.unchanged) == set(layers) and not report.skipped
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("target", ["mrs", "rms", "layer", "dyt", "derf"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_target_trains_and_the_report_lists_every_layer(family, target):
    model, tokens = tiny_causal_lm(family), token_batch()
    norms = _norm_like(model)
    report = swap_norms(model, target)
    listed = set(report.converted) | set(report.unchanged) | set(report.skipped) | set(report.aliases)
    assert listed == norms and not report.skipped
    assert set(report.probed) == ({n for n in report.converted} if NORMS[family] != "torch" else set())
    offset = NORMS[family].endswith("(1 + w)")  # Gemma: an rms swap keeps its checkpoint convention
    kind = {"mrs": MRSNorm, "rms": OffsetRMSNorm if offset else nn.RMSNorm, "layer": nn.LayerNorm, "dyt": DyT,
            "derf": Derf}[target]
    modules = dict(model.named_modules())
    assert all(type(modules[n]) is kind for n in norms)
    model.train()
    out = model(tokens, labels=tokens)
    out.loss.backward()
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.loss)
    for name in norms:
        grad = modules[name].weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name


@pytest.mark.parametrize("family", ["gemma", "llama"])
def test_mrs_weights_are_the_pair_means_of_the_effective_scale(family):
    model = tiny_causal_lm(family)
    old = {n: m.weight.detach().clone() for n, m, _ in iter_norm_layers(model)}
    swap_norms(model, "mrs")
    modules = dict(model.named_modules())
    for name, w in old.items():
        scale = 1 + w if NORMS[family].endswith("(1 + w)") else w  # (C,)
        torch.testing.assert_close(modules[name].weight.detach(), scale.reshape(-1, 2).mean(1))


@pytest.mark.parametrize("target,squash", [("dyt", torch.tanh), ("derf", torch.erf)])
@pytest.mark.parametrize("family", list(ALL))
def test_dyt_carries_the_effective_scale_and_bias(family, target, squash):
    """Every family swapped to DyT (Derf): each layer computes ``scale * tanh(0.5 x) + bias`` (``erf(0.5 x + 0)``)
    in float64 with the old layer's effective scale (Gemma's and Nemotron's ``1 + w``, none for OLMo's weightless
    LayerNorm) and bias."""
    model = tiny_causal_lm(family).double()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # the norms' weights and biases away from their init
                p.uniform_(-2, 2)
    old = {}
    for name, module, spec in iter_norm_layers(model):
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        scale = spec.formula.scale(weight) if spec.formula is not None else weight  # nn.LayerNorm: weight
        old[name] = (None if scale is None else scale.detach().clone(), None if bias is None else bias.detach().clone())
    swap_norms(model, target)
    modules = dict(model.named_modules())
    for name, (scale, bias) in old.items():
        x = 3 * torch.randn(2, 5, modules[name].num_channels, dtype=torch.float64)  # QK-norms: a head's width
        expected = squash(0.5 * x)
        expected = expected if scale is None else expected * scale
        expected = expected if bias is None else expected + bias
        torch.testing.assert_close(modules[name](x), expected, atol=1e-12, rtol=1e-12, msg=name)


def test_the_report_says_what_the_probe_found():
    report = swap_norms(tiny_causal_lm("gemma"), "mrs")
    text = str(report)
    assert "GemmaRMSNorm -> MRSNorm  x5" in text
    assert "(probed: GemmaRMSNorm computes rms(x) * (1 + w), eps=1e-06)  x5" in text


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_an_odd_hidden_size_is_skipped_for_mrs(family):
    model = tiny_causal_lm(family, hidden_size=33, num_attention_heads=3, num_key_value_heads=1)
    norms = [n for n, _, _ in iter_norm_layers(model)]
    with pytest.warns(UserWarning, match=f"converted none of the {len(norms)} norm layers"):
        report = swap_norms(model, "mrs")
    assert sorted(report.skipped) == sorted(norms)
    assert all(reason.startswith("odd channel count 33") for reason in report.skipped.values())
    assert sorted(swap_norms(model, "rms").converted) == sorted(norms)  # RMSNorm needs no pairs
