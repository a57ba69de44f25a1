"""The probe (lightning_mrs.swap.probe): a norm the registry does not know is recognised by what
it computes, checked against float64 formulas written here, or skipped with the reason."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_mrs import MRSNorm, norm_spec, swap_norms
from lightning_mrs.swap.layers import OffsetRMSNorm
from lightning_mrs.swap.probe import TOLERANCE, probe_norm

C = 8


class _Norm(nn.Module):
    """A hand-written last-dim norm: RMS or LayerNorm, weight ``w``/``1 + w``/none, optional bias."""

    def __init__(self, c: int = C, kind: str = "rms", weight: str = "w", bias: bool = False, eps: float = 1e-6,
                 eps_attr: str = "eps", fp32: bool = False) -> None:
        super().__init__()
        self.kind, self.mode, self.fp32, self._eps = kind, weight, fp32, eps
        self.normalized_shape = (c,)  # how OlmoLayerNorm, which has no weight, tells its width
        if eps_attr:
            setattr(self, eps_attr, eps)
        if weight != "none":
            self.weight = nn.Parameter(torch.zeros(c) if weight == "1+w" else torch.ones(c))
        self.bias = nn.Parameter(torch.zeros(c)) if bias else None

    def forward(self, x):
        dtype = x.dtype
        h = x.float() if self.fp32 else x
        if self.kind == "layer":
            h = h - h.mean(-1, keepdim=True)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self._eps)
        if self.mode != "none":
            h = h * (self.weight + 1 if self.mode == "1+w" else self.weight)
        if self.bias is not None:
            h = h + self.bias
        return h.to(dtype)


def _reference(x: torch.Tensor, kind: str, scale, bias, eps: float) -> torch.Tensor:
    """The float64 formula, independently of the probe's own."""
    x = x.double()
    if kind == "layer":
        x = x - x.mean(-1, keepdim=True)
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    y = y if scale is None else y * scale.double()
    return y if bias is None else y + bias.double()


LAYOUTS = [(k, w, b) for k in ("rms", "layer") for w in ("w", "1+w", "none") for b in (False, True)
           if not (b and w == "none")]  # a bias without a weight is no layout the probe considers


@pytest.mark.parametrize(("kind", "weight", "bias"), LAYOUTS)
@pytest.mark.parametrize("fp32", [False, True])
def test_the_probe_finds_the_formula(kind, weight, bias, fp32):
    module = _Norm(kind=kind, weight=weight, bias=bias, eps=1e-5, fp32=fp32)
    probe = probe_norm(module, C)
    assert probe.formula is not None, probe.reason
    assert (probe.formula.kind, probe.formula.weight, probe.formula.bias, probe.formula.eps) == (kind, weight, bias, 1e-5)
    assert probe.error <= (1e-6 if fp32 else 1e-12)
    spec = norm_spec(module)
    assert spec.kind == "probed" and spec.channel_dim == -1 and spec.num_channels == C and spec.unsupported is None


@pytest.mark.parametrize("eps", [1e-5, 1e-6, 3e-7, 1e-8])
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_eps_is_read_off_the_probe_when_the_module_has_no_attribute(kind, eps):
    module = _Norm(kind=kind, eps=eps, eps_attr="")  # like OlmoLayerNorm: eps hard-coded in forward
    formula = probe_norm(module, C).formula
    assert formula is not None and formula.eps == pytest.approx(eps, rel=1e-2)


def test_a_wrong_eps_attribute_is_not_believed():
    module = _Norm(eps=1e-5)
    module.eps = 1e-2  # the attribute lies; the forward uses 1e-5
    assert probe_norm(module, C).formula.eps == pytest.approx(1e-5, rel=1e-2)


@pytest.mark.parametrize("c", [8, 9, 64])
def test_swapped_layers_compute_what_the_old_one_did(c):
    """rms/layer replacements of a probed layer equal the old layer (offset and bias folded in)."""
    torch.manual_seed(0)
    for kind, target in [("rms", "rms"), ("layer", "layer")]:
        for weight in ("w", "1+w", "none"):
            old = _Norm(c, kind=kind, weight=weight, bias=kind == "layer" and weight != "none", eps=1e-5)
            with torch.no_grad():
                for p in old.parameters():
                    p.normal_()
            model = nn.Sequential(nn.Linear(c, c), old)
            x = torch.randn(3, 5, c) * 4 + 1
            expected = model(x)
            report = swap_norms(model, target)
            assert report.converted == ["1"] and report.probed["1"].startswith(f"{kind}(x)")
            # an offset RMS layer (Gemma's) becomes an OffsetRMSNorm: the same weights, the family's convention
            rms = OffsetRMSNorm if weight == "1+w" else nn.RMSNorm
            assert type(model[1]) is (rms if target == "rms" else nn.LayerNorm)
            if type(model[1]) is OffsetRMSNorm:
                torch.testing.assert_close(model[1].weight, old.weight, atol=0, rtol=0)
            torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=1e-5)
            h = model[0](x)
            scale = None if weight == "none" else (old.weight + 1 if weight == "1+w" else old.weight)
            bias = old.bias
            torch.testing.assert_close(model(x).double(), _reference(h, kind, scale, bias, 1e-5), atol=1e-5, rtol=1e-5)


def test_mrs_inherits_the_effective_scale():
    old = _Norm(weight="1+w")
    with torch.no_grad():
        old.weight.copy_(torch.arange(C, dtype=torch.float32) / 10)
    model = nn.Sequential(old)
    swap_norms(model, "mrs")
    assert isinstance(model[0], MRSNorm)
    expected = (1 + torch.arange(C, dtype=torch.float32) / 10).reshape(-1, 2).mean(1)  # (C/2,): pair means of 1 + w
    torch.testing.assert_close(model[0].weight.detach(), expected)


class _MaxNorm(nn.Module):
    """Named like a norm, but divides by the max: neither RMS nor LayerNorm."""

    def __init__(self, c: int = C) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(c)), 1e-6

    def forward(self, x):
        return x / x.abs().amax(-1, keepdim=True) * self.weight


class _GatedRMSNorm(_Norm):
    def forward(self, x, gate=None):  # two inputs: a replacement taking only x would drop the gate
        return super().forward(x) * (1 if gate is None else gate)


class _FailingNorm(_Norm):
    def forward(self, x):
        raise RuntimeError("no")


def test_a_norm_that_matches_no_formula_is_skipped_with_the_error():
    model = nn.Sequential(nn.Linear(C, C), _MaxNorm(), _GatedRMSNorm(), _FailingNorm())
    with pytest.warns(UserWarning, match="converted none of the 3 norm layers"):
        report = swap_norms(model, "mrs")
    assert report.converted == []
    assert report.skipped["1"].startswith("computes neither RMS nor LayerNorm over the last dim (max error ")
    assert report.skipped["2"].startswith("its forward takes more than the input (gate): a gated norm")
    assert "forward fails" in report.skipped["3"]
    assert isinstance(model[1], _MaxNorm) and isinstance(model[2], _GatedRMSNorm)
    with pytest.raises(ValueError, match="a gated norm"):
        swap_norms(nn.Sequential(_GatedRMSNorm()), "mrs", strict=True)
    with pytest.raises(ValueError, match="computes neither RMS nor LayerNorm"):
        swap_norms(nn.Sequential(_MaxNorm()), "mrs", strict=True)


def test_the_nearest_error_is_above_the_tolerance():
    probe = probe_norm(_MaxNorm(), C)
    assert probe.formula is None and probe.error > 100 * TOLERANCE


def test_every_leaf_named_norm_is_reported():
    class WeirdNorm(nn.Module):  # 2-d weight: not a last-dim norm with a 1-d weight
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(C, C))

        def forward(self, x):
            return x @ self.weight

    model = nn.Sequential(nn.Linear(C, C), WeirdNorm(), _Norm(eps_attr="variance_epsilon"))
    report = swap_norms(model, "rms")
    assert report.converted == ["2"]
    assert "not a norm over the last dim with a 1-d weight" in report.skipped["1"]


def test_odd_width_is_skipped_for_mrs_with_the_reason():
    model = nn.Sequential(_Norm(7))
    with pytest.warns(UserWarning):
        report = swap_norms(model, "mrs")
    assert "odd channel count 7" in report.skipped["0"]
    assert swap_norms(nn.Sequential(_Norm(7)), "rms").converted == ["0"]


def test_a_model_without_norms_says_so_in_one_line():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = swap_norms(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), "mrs")
    notes = [line for line in str(report).splitlines() if "no norm layer" in line]
    assert len(notes) == 1 and "Sequential has no norm layer" in notes[0]


def test_only_an_eps_attribute_makes_an_unnamed_module_a_candidate():
    class Scale(nn.Module):  # 1-d weight and eps, not named *Norm*, not a norm
        def __init__(self):
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.ones(C)), 1e-6

        def forward(self, x):
            return x * self.weight

    class Unnamed(_Norm):  # a real RMS norm without "Norm" in its name
        pass

    Unnamed.__name__ = Unnamed.__qualname__ = "Rescaler"
    assert norm_spec(Scale()) is None
    assert norm_spec(Unnamed()).formula is not None
    assert norm_spec(nn.Linear(C, C)) is None and norm_spec(nn.ReLU()) is None


def test_the_probe_runs_no_hook_and_changes_nothing():
    module = _Norm(weight="1+w")
    calls = []
    module.register_forward_hook(lambda *args: calls.append(args))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    assert probe_norm(module, C).formula is not None
    assert calls == [] and all(torch.equal(before[k], v) for k, v in module.state_dict().items())


def test_a_meta_module_is_probed():
    with torch.device("meta"):
        module = _Norm(weight="1+w", bias=True, kind="layer")
    formula = probe_norm(module, C).formula
    assert formula is not None and (formula.kind, formula.weight, formula.bias) == ("layer", "1+w", True)


def test_a_known_transformers_class_must_agree_with_the_probe():
    class LlamaRMSNorm(_Norm):  # named and placed like transformers' class, but computes a LayerNorm
        pass

    LlamaRMSNorm.__module__ = "transformers.models.llama.modeling_llama"
    spec = norm_spec(LlamaRMSNorm(kind="layer"))
    assert spec.formula is None and "known to compute rms(x) * w" in spec.unsupported
    assert norm_spec(LlamaRMSNorm(kind="rms")).formula is not None


def test_a_layernorm_subclass_with_its_own_forward_is_probed():
    class LayerNorm1P(nn.LayerNorm):  # like transformers' NemotronLayerNorm1P
        def forward(self, x):
            return nn.functional.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)

    spec = norm_spec(LayerNorm1P(C))
    assert spec.kind == "probed" and str(spec.formula) == "layer(x) * (1 + w) + b, eps=1e-05"
