"""Dynamic Tanh (``lightning_mrs.swap.dyt``) and the swap target ``"dyt"``.

``DyT``/``DyT2d`` against ``w * tanh(alpha * x) + b`` computed here in float64, in every dtype (half
inputs computed in float32, returned in their dtype) and by gradcheck; the swap of every norm family
to DyT carries the old per-channel scale and bias over (the swapped layer equals the float64 formula
with the *old* weights: Gemma's ``1 + w``, an MRS phasor weight on both its channels); ``alpha0`` (the
paper's 0.5, a value, or patterns); a transformers Llama swapped to DyT trains a step.
"""

from __future__ import annotations

import math
from typing import Callable

import pytest
import torch
from torch import Tensor, nn

from lightning_mrs import DyT, DyT2d, MRSNorm, MRSNorm2d, OffsetRMSNorm, SwapOptions, swap_norms
from lightning_mrs.swap.dyt import DEFAULT_ALPHA0, LLAMA_ALPHA0, dyt
from lightning_mrs.swap.layers import NormAct
from lightning_mrs.swap.spec import describe_layers, rebuild

tn = pytest.importorskip("timm.layers.norm")
ta = pytest.importorskip("timm.layers.norm_act")

TOL = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-6, 1e-5), torch.float16: (1e-3, 1e-3),
       torch.bfloat16: (8e-3, 8e-3)}


def reference(x: Tensor, alpha: float, scale: Tensor | None, bias: Tensor | None, channel_dim: int) -> Tensor:
    """``scale * tanh(alpha * x) + bias`` in float64, ``scale``/``bias`` per channel on ``channel_dim``."""
    y = torch.tanh(float(alpha) * x.double())
    shape = [1] * x.ndim
    shape[channel_dim] = -1
    if scale is not None:
        y = y * scale.double().reshape(shape)
    if bias is not None:
        y = y + bias.double().reshape(shape)
    return y


def _randomised(norm: DyT) -> DyT:
    with torch.no_grad():
        norm.alpha.fill_(0.7)
        for p in (norm.weight, norm.bias):
            if p is not None:
                p.uniform_(-2, 2)
    return norm


CASES = [(DyT, (5, 6)), (DyT, (2, 3, 8)), (DyT, (1, 2, 3, 4)), (DyT2d, (2, 6, 5, 5)), (DyT2d, (2, 6)),
         (DyT2d, (2, 6, 7)), (DyT2d, (1, 6, 2, 3, 4))]


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("cls,shape", CASES)
def test_matches_the_float64_formula(cls: type, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    c = shape[-1] if cls is DyT else shape[1]
    norm = _randomised(cls(c))
    x = (3 * torch.randn(shape, dtype=torch.float64)).to(dtype)
    y = norm(x)
    assert y.dtype == dtype and y.shape == x.shape
    atol, rtol = TOL[dtype]
    expected = reference(x, norm.alpha.item(), norm.weight.detach(), norm.bias.detach(), norm.channel_dim)
    torch.testing.assert_close(y.double(), expected.to(dtype).double() if dtype in (torch.float16, torch.bfloat16)
                               else expected, atol=atol, rtol=rtol)


def test_half_inputs_are_computed_in_float32() -> None:
    """float16 in, float32 inside: the float16 rounding of the float32 result, not of a float16 tanh chain."""
    norm = _randomised(DyT(64))
    x = torch.randn(8, 64, dtype=torch.float16) * 60000 / 4
    expected = dyt(x.float(), norm.alpha.detach(), norm.weight.detach(), norm.bias.detach()).to(torch.float16)
    assert torch.equal(norm(x), expected)
    big = torch.full((1, 64), 65504.0, dtype=torch.float16)
    assert torch.isfinite(norm(big)).all()


def test_non_contiguous_inputs() -> None:
    norm = _randomised(DyT2d(6))
    x = torch.randn(2, 5, 5, 6, dtype=torch.float64).permute(0, 3, 1, 2)  # channels_last memory, (N, C, H, W)
    torch.testing.assert_close(norm.double()(x), reference(x, 0.7, norm.weight.detach(), norm.bias.detach(), 1))
    last = _randomised(DyT(6)).double()
    xs = torch.randn(4, 12, dtype=torch.float64)[:, ::2]  # a strided view
    torch.testing.assert_close(last(xs), reference(xs, 0.7, last.weight.detach(), last.bias.detach(), -1))


@pytest.mark.parametrize("cls,shape", [(DyT, (3, 4)), (DyT2d, (2, 4, 3))])
def test_gradcheck_float64(cls: type, shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    alpha = torch.tensor([0.6], dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    channel_dim = cls(4).channel_dim
    assert torch.autograd.gradcheck(lambda *t: dyt(*t, channel_dim), (x, alpha, w, b))


def test_module_defaults_and_errors() -> None:
    norm = DyT(4)
    assert norm.alpha.item() == DEFAULT_ALPHA0 == 0.5  # the paper's default (official dynamic_tanh.py)
    assert torch.equal(norm.weight, torch.ones(4)) and torch.equal(norm.bias, torch.zeros(4))
    with torch.no_grad():
        norm.alpha.fill_(3.0)
        norm.weight.fill_(2.0)
    norm.reset_parameters()
    assert norm.alpha.item() == 0.5 and torch.equal(norm.weight, torch.ones(4))
    bare = DyT2d(4, affine=False, alpha0=0.2)
    assert bare.weight is None and bare.bias is None and repr(bare) == "DyT2d(4, affine=False, bias=False, alpha0=0.2)"
    assert [n for n, _ in DyT(4, bias=False).named_parameters()] == ["alpha", "weight"]
    assert DyT(4, dtype=torch.float64).alpha.dtype == torch.float64
    with pytest.raises(ValueError, match=r"DyT\(4\): expected the last dim to hold 4 channels.*use DyT2d"):
        norm(torch.randn(4, 3))
    with pytest.raises(ValueError, match=r"DyT2d\(4\): expected \(N, 4, \*spatial\)"):
        DyT2d(4)(torch.randn(2, 3, 4))
    with pytest.raises(TypeError, match="floating-point"):
        norm(torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="alpha0 must be a finite float > 0"):
        DyT(4, alpha0=0.0)


def test_zero_input_gives_the_bias_and_finite_gradients() -> None:
    norm = _randomised(DyT(4))
    x = torch.zeros(3, 4, requires_grad=True)
    y = norm(x)
    torch.testing.assert_close(y, norm.bias.detach().expand(3, 4))
    y.sum().backward()
    assert all(torch.isfinite(g).all() for g in (x.grad, norm.alpha.grad, norm.weight.grad))


def test_fx_and_torchscript_give_the_eager_output() -> None:
    for norm, x in ((_randomised(DyT(6)), torch.randn(2, 3, 6)), (_randomised(DyT2d(6)), torch.randn(2, 6, 3, 3))):
        traced = torch.fx.symbolic_trace(norm)
        assert torch.equal(traced(x), norm(x))
        with pytest.warns(FutureWarning):  # torch.jit.script is deprecated, still supported
            assert torch.equal(torch.jit.script(norm)(x), norm(x))


# ------------------------------------------------------------------ the swap: every family, weights carried
def _gemma(c: int) -> nn.Module:
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    return GemmaRMSNorm(c, eps=1e-6)


def _llama(c: int) -> nn.Module:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm(c, eps=1e-6)


C = 8
#: source -> (channel_dim, effective per-channel scale from the old module (None: no weight), has a bias)
FAMILIES: dict[str, tuple[Callable[[], nn.Module], int, Callable[[nn.Module], Tensor | None], bool]] = {
    "LayerNorm": (lambda: nn.LayerNorm(C), -1, lambda m: m.weight, True),
    "LayerNorm(no affine)": (lambda: nn.LayerNorm(C, elementwise_affine=False), -1, lambda m: None, False),
    "RMSNorm": (lambda: nn.RMSNorm(C), -1, lambda m: m.weight, False),
    "timm LayerNorm": (lambda: tn.LayerNorm(C), -1, lambda m: m.weight, True),
    "timm RmsNorm": (lambda: tn.RmsNorm(C), -1, lambda m: m.weight, False),
    "timm SimpleNorm": (lambda: tn.SimpleNorm(C), -1, lambda m: m.weight, False),
    "LlamaRMSNorm": (lambda: _llama(C), -1, lambda m: m.weight, False),
    "GemmaRMSNorm (1 + w)": (lambda: _gemma(C), -1, lambda m: 1 + m.weight, False),
    "OffsetRMSNorm (1 + w)": (lambda: OffsetRMSNorm(C), -1, lambda m: 1 + m.weight, False),
    "MRSNorm (a weight per phasor)": (lambda: MRSNorm(C), -1, lambda m: m.weight.repeat_interleave(2), False),
    "timm LayerNorm2d": (lambda: tn.LayerNorm2d(C), 1, lambda m: m.weight, True),
    "timm RmsNorm2d": (lambda: tn.RmsNorm2d(C), 1, lambda m: m.weight, False),
    "BatchNorm2d": (lambda: nn.BatchNorm2d(C), 1, lambda m: m.weight, True),
    "GroupNorm": (lambda: nn.GroupNorm(2, C), 1, lambda m: m.weight, True),
    "InstanceNorm2d(affine)": (lambda: nn.InstanceNorm2d(C, affine=True), 1, lambda m: m.weight, True),
    "MRSNorm2d": (lambda: MRSNorm2d(C, spatial=True), 1, lambda m: m.weight.repeat_interleave(2), False),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_swap_carries_the_weights_of_every_family(family: str) -> None:
    make, channel_dim, scale_of, has_bias = FAMILIES[family]
    old = make().double()
    with torch.no_grad():
        for p in old.parameters():
            p.uniform_(-2, 2)
    scale = scale_of(old)
    scale = None if scale is None else scale.detach().clone()
    bias = old.bias.detach().clone() if has_bias else None
    model = nn.Sequential(old)
    report = swap_norms(model, "dyt")
    assert report.converted == ["0"], report
    new = model[0]
    assert isinstance(new, DyT2d if channel_dim == 1 else DyT) and new.channel_dim == channel_dim
    assert (new.bias is not None) == has_bias  # a bias where the source had one (the paper's LLaMA DyT: none)
    x = 3 * torch.randn((2, 5, C) if channel_dim == -1 else (2, C, 3, 4), dtype=torch.float64)
    torch.testing.assert_close(new(x), reference(x, DEFAULT_ALPHA0, scale, bias, channel_dim), atol=1e-12, rtol=1e-12)
    assert swap_norms(model, "dyt").converted == []  # already DyT


def test_fused_norm_act_keeps_its_activation() -> None:
    old = ta.BatchNormAct2d(C, act_layer=nn.ReLU).double()
    with torch.no_grad():
        old.weight.uniform_(-2, 2)
        old.bias.uniform_(-2, 2)
    weight, bias = old.weight.detach().clone(), old.bias.detach().clone()
    model = nn.Sequential(old)
    swap_norms(model, "dyt")
    assert isinstance(model[0], NormAct) and isinstance(model[0].norm, DyT2d)
    x = torch.randn(2, C, 3, 3, dtype=torch.float64)
    torch.testing.assert_close(model(x), reference(x, 0.5, weight, bias, 1).relu())


def test_frozen_source_stays_frozen_and_record_rebuilds() -> None:
    def make() -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, C, 3), nn.BatchNorm2d(C), nn.Flatten(2), nn.Unflatten(2, (1, -1)),
                             nn.Flatten(1), nn.LayerNorm(C * 36))

    model = make()
    model[1].weight.requires_grad_(False)
    swap_norms(model, "dyt")
    assert not model[1].weight.requires_grad
    records = describe_layers(model, "dyt")
    assert {name: (r["kind"], r["channel_dim"]) for name, r in records.items()} == {"1": ("dyt", 1), "5": ("dyt", -1)}
    fresh = make()
    rebuild(fresh, "dyt", records)
    assert describe_layers(fresh, "dyt") == records
    fresh.load_state_dict(model.state_dict())  # the same parameters, alpha included
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(fresh(x), model(x))
    rebuild(fresh2 := make(), None, records)  # a transformers config's record: each record's kind
    assert describe_layers(fresh2, "dyt") == records


# ------------------------------------------------------------------ alpha0
def test_alpha0_a_value_or_patterns() -> None:
    model = nn.Sequential(nn.LayerNorm(4), nn.Sequential(nn.LayerNorm(4), nn.LayerNorm(4)))
    swap_norms(model, "dyt", alpha0=0.25)
    assert [m.alpha.item() for m in model.modules() if isinstance(m, DyT)] == [0.25] * 3
    model = nn.Sequential(nn.LayerNorm(4), nn.Sequential(nn.LayerNorm(4), nn.LayerNorm(4)))
    report = swap_norms(model, "dyt", alpha0={"1.1": 0.8, "1": 0.2})  # first pattern that picks a layer wins
    assert [m.alpha.item() for m in model.modules() if isinstance(m, DyT)] == pytest.approx([0.5, 0.2, 0.8])  # "0": the default
    assert report.changes["1.1"] == ("LayerNorm", "DyT(alpha0=0.8)")


def test_alpha0_errors() -> None:
    with pytest.raises(ValueError, match=r"alpha0=0.5 is the initial alpha of DyT and Derf layers, but target='rms'; use target='dyt' or target='derf'"):
        SwapOptions("rms", alpha0=0.5)
    for bad in (0, -1.0, math.inf, True, "0.5", {"*": 0}, {}, [("*",)]):
        with pytest.raises(ValueError, match="alpha0"):
            SwapOptions("dyt", alpha0=bad)
    model = nn.Sequential(nn.LayerNorm(4))
    with pytest.raises(ValueError, match=r"alpha0='\*.input_layernorm' matches no module of Sequential"):
        swap_norms(model, "dyt", alpha0={"*.input_layernorm": 0.8})
    assert isinstance(model[0], nn.LayerNorm)  # nothing was changed
    assert SwapOptions("dyt", alpha0={"a": 1}).alpha0 == (("a", 1.0),)


# ------------------------------------------------------------------ a transformers Llama
def test_llama_swapped_to_dyt_with_the_papers_llm_init_trains_a_step() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=2, intermediate_size=64)
    model = transformers.LlamaForCausalLM(config)
    attention, other = LLAMA_ALPHA0["7b"]
    report = swap_norms(model, "dyt", alpha0={"*.input_layernorm": attention, "*": other})
    assert len(report.converted) == 5 and not report.skipped
    alphas = {name: m.alpha.item() for name, m in model.named_modules() if isinstance(m, DyT)}
    assert alphas == pytest.approx({"model.layers.0.input_layernorm": 0.8, "model.layers.0.post_attention_layernorm": 0.2,
                                    "model.layers.1.input_layernorm": 0.8, "model.layers.1.post_attention_layernorm": 0.2,
                                    "model.norm": 0.2})
    # the swapped layer computes the formula with the old (unit) weight and no bias, on the real residual stream
    seen = {}
    handle = model.model.norm.register_forward_hook(lambda m, a, out: seen.update(x=a[0], y=out))
    ids = torch.randint(0, 64, (2, 12))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = model(input_ids=ids, labels=ids).loss
    handle.remove()
    torch.testing.assert_close(seen["y"].double(), reference(seen["x"], model.model.norm.alpha.item(), torch.ones(32), None, -1))
    loss.backward()
    assert torch.isfinite(loss)
    assert all(m.alpha.grad is not None and m.alpha.grad.abs() > 0 for m in model.modules() if isinstance(m, DyT))
    opt.step()
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters() if n.endswith(".alpha"))
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


def test_a_dyt_gpt2_saves_and_loads_with_its_alphas(tmp_path) -> None:
    """save_pretrained + lightning_mrs.from_pretrained rebuild the DyT layers (the config's record) and load
    the trained alpha, weight and bias: the same logits."""
    from helpers.hf import tiny_causal_lm, token_batch
    from lightning_mrs import from_pretrained

    model = tiny_causal_lm("gpt2")  # LayerNorm with a bias: DyT keeps it
    swap_norms(model, "dyt", alpha0=0.3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".alpha"):
                p.uniform_(0.1, 1.0)
    tokens = token_batch()
    with torch.no_grad():
        expected = model(tokens).logits
    model.save_pretrained(tmp_path)
    loaded = from_pretrained(tmp_path)
    layers = {n: (type(m), m.bias is not None) for n, m in loaded.named_modules() if isinstance(m, DyT)}
    assert layers == {n: (type(m), m.bias is not None) for n, m in model.named_modules() if isinstance(m, DyT)}
    assert len(layers) == 5
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, expected)


def test_calibrate_fits_dyt_weights_to_the_old_norms() -> None:
    """init="calibrate" fits w (DyT at unit weight is tanh(alpha x)) so each layer's output comes closer to the
    old RMSNorm's on the same input than the inherited weights do (a random Llama's residual stream is small:
    tanh(0.5 x) is far from rms-normalised)."""
    from helpers.hf import tiny_causal_lm, token_batch

    model = tiny_causal_lm("llama")
    report = swap_norms(model, "dyt", init="calibrate", calibration=token_batch())
    assert len(report.calibration) == 5
    assert all(fitted < inherited for inherited, fitted in report.calibration.values()), report.calibration


@pytest.mark.parametrize("target,option,value,scalar", [("dyt", "alpha0", 0.3, "alpha"), ("derf", "shift0", 0.1, "shift")])
def test_normswap_records_resumes_and_restores(tmp_path, target: str, option: str, value: float, scalar: str) -> None:
    """The callback with target 'dyt' or 'derf': the checkpoint records the layers, a resume trains on, and
    NormSwap.restore gives the trained weights (the learnable scalars included) and outputs to the bit."""
    pytest.importorskip("lightning")
    from helpers.lightning import TinyModule, assert_same_model, fit, image_data, normswap_record
    from lightning_mrs import Derf2d
    from lightning_mrs.callbacks import NormSwap

    trainer, trained = fit(TinyModule(), callbacks=[NormSwap(target, **{option: value})])
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    state = normswap_record(path)
    assert state["target"] == target
    assert state["layers"] == {"net.1": {"kind": target, "channel_dim": 1, "spatial": None, "eps": None},
                               "net.5": {"kind": target, "channel_dim": -1, "spatial": None, "eps": None}}
    assert getattr(trained.net[1], scalar).item() != pytest.approx(value)  # the scalar trained
    resumed, model = fit(TinyModule(), steps=4, callbacks=[NormSwap(target, **{option: value})], ckpt_path=str(path))
    assert resumed.global_step == 4 and isinstance(model.net[1], {"dyt": DyT2d, "derf": Derf2d}[target])
    assert_same_model(NormSwap.restore(TinyModule(), path), path, trained, image_data(4, seed=7).tensors[0])
