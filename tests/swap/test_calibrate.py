"""``init="calibrate"``: the new weights fitted by least squares keep what a trained model computes.

References: the closed form of each weight from float64 sums taken independently of the module
(``g = sum(u t) / sum(u u)`` over the layer's own input), the unswapped model's logits, and the
old layer itself (a same-kind swap is already exact: calibration changes nothing).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from helpers.hf import tiny_causal_lm, token_batch
from lightning_mrs import MRSNorm, MRSNorm2d, swap_norms


def _uneven(family: str = "llama") -> nn.Module:
    """A tiny LM whose norm gains are spread (0.2..3): where a swap's inherited weights are far off."""
    model = tiny_causal_lm(family)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                p.copy_(torch.empty_like(p).uniform_(0.2, 3.0, generator=g))
    return model


def _moved(model: nn.Module, reference: torch.Tensor, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(ids).logits - reference).norm() / reference.norm())


@pytest.mark.parametrize("family", ["llama", "gemma"])
@pytest.mark.parametrize("qk_norm", [None, "mrs"])
def test_calibrated_swap_is_closer_to_the_trained_model_than_inherit(family, qk_norm):
    base = _uneven(family)
    calib, test = token_batch(8, 32, seed=1), token_batch(8, 32, seed=2)  # fitted on one batch, judged on another
    with torch.no_grad():
        reference = base(test).logits
    moved = {}
    for init in ("inherit", "calibrate"):
        model = copy.deepcopy(base)
        extra = {"calibration": calib} if init == "calibrate" else {}
        report = swap_norms(model, "mrs", qk_norm=qk_norm, init=init, **extra)
        moved[init] = _moved(model, reference, test)
    assert moved["calibrate"] < 0.95 * moved["inherit"], moved
    assert set(report.calibration) == set(report.converted) | set(report.qk_added)
    assert all(after <= before for before, after in report.calibration.values())
    assert "calibrated 5 norms" in str(report)
    assert ("calibrated 4 added QK-norms" in str(report)) == (qk_norm is not None)


def test_the_fit_is_the_closed_form_least_squares():
    """Final norm of a Llama: the fitted phasor weights equal sum(u t) / sum(u u) over its input."""
    base = _uneven()
    calib = token_batch(4, 16, seed=3)
    inputs = {}
    handle = base.model.norm.register_forward_hook(lambda m, a, o: inputs.update(x=a[0].detach(), t=o.detach()))
    with torch.no_grad():
        base(calib)
    handle.remove()
    model = copy.deepcopy(base)
    swap_norms(model, "mrs", init="calibrate", calibration=calib, include="model.norm")
    x, t = inputs["x"].double(), inputs["t"].double()  # the final norm's input is the same: nothing before it changed
    z = x.reshape(-1, 16, 2)  # (tokens, P, 2)
    u = z / torch.sqrt(z.pow(2).sum(-1, keepdim=True) + 1e-6).mean(1, keepdim=True)  # MRSNorm at unit weight
    t = t.reshape(-1, 16, 2)
    expected = (u * t).sum((0, 2)) / (u * u).sum((0, 2))  # (P,)
    torch.testing.assert_close(model.model.norm.weight.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_a_same_kind_swap_changes_nothing(family):
    model = _uneven(family)
    reference = copy.deepcopy(model)
    swap_norms(reference, "rms")
    report = swap_norms(model, "rms", init="calibrate", calibration=token_batch(4, 16))
    for name in report.converted:
        torch.testing.assert_close(model.get_submodule(name).weight, reference.get_submodule(name).weight,
                                   atol=1e-5, rtol=1e-5)
        assert report.calibration[name][0] < 1e-6
    assert _moved(model, reference(token_batch()).logits.detach(), token_batch()) < 1e-6


def test_layernorm_sources_fit_scale_and_say_the_bias_cannot_be_matched():
    model = tiny_causal_lm("gpt2")
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.bias.normal_(0, 0.3)
    report = swap_norms(model, "mrs", init="calibrate", calibration=token_batch(4, 16))
    assert all(after < before for before, after in report.calibration.values())
    assert any("bias that MRSNorm cannot hold" in note for note in report.notes)
    layer = tiny_causal_lm("gpt2")
    report = swap_norms(layer, "layer", init="calibrate", calibration=token_batch(4, 16))  # its own kind: exact
    assert all(before < 1e-6 for before, _ in report.calibration.values())


def test_vision_batchnorm_in_eval_mode():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3),
                        nn.BatchNorm2d(8), nn.Flatten(), nn.LazyLinear(5))
    images = torch.randn(32, 3, 8, 8)
    net.train()
    with torch.no_grad():
        for _ in range(5):
            net(images * 2 + 1)  # running statistics away from (0, 1)
    net.eval()
    with torch.no_grad():
        reference = net(images)
    moved = {}
    for init in ("inherit", "calibrate"):
        model = copy.deepcopy(net).train()  # calibration runs in eval mode and gives the flags back
        extra = {"calibration": images[:16]} if init == "calibrate" else {}
        report = swap_norms(model, "mrs", init=init, **extra)
        assert model.training and all(m.training for m in model.modules())
        assert isinstance(model[1], MRSNorm2d)
        with torch.no_grad():
            moved[init] = float((model.eval()(images) - reference).norm() / reference.norm())
    assert moved["calibrate"] < moved["inherit"] and len(report.calibration) == 2


def test_a_callable_runs_the_model_on_several_batches():
    base = _uneven()
    batches = [token_batch(2, 16, seed=s) for s in range(3)]
    calls = []

    def run(model: nn.Module) -> None:
        for ids in batches:
            calls.append(1)
            model(ids)

    report = swap_norms(copy.deepcopy(base), "mrs", init="calibrate", calibration=run)
    assert len(report.calibration) == 5 and len(calls) == 3 * (2 + 5)  # a check, the order, one pass per layer


@pytest.mark.parametrize("options, error, match", [
    (dict(init="calibrate"), ValueError, "init='calibrate' needs calibration="),
    (dict(calibration=torch.zeros(1, 4, dtype=torch.long)), ValueError, "only used with init='calibrate'"),
    (dict(init="calibrate", calibration=[1, 2]), TypeError, "must be a tensor"),
    (dict(init="calibrate", calibration=torch.randn(2, 3)), ValueError, "cannot run the calibration data"),
    (dict(init="calibrate", calibration={"input_idz": torch.zeros(1, 4, dtype=torch.long)}), ValueError,
     "cannot run the calibration data"),
])
def test_bad_calibration_is_one_clear_error_and_the_model_is_kept(options, error, match):
    model = tiny_causal_lm("llama")
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(error, match=match) as caught:
        swap_norms(model, "mrs", **options)
    assert "\n" not in str(caught.value)
    # refused before any change
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert not any(isinstance(m, MRSNorm) for m in model.modules())
