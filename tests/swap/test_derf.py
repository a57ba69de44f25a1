"""Dynamic erf (``lightning_mrs.swap.derf``) and the swap target ``"derf"``.

``Derf``/``Derf2d`` against ``w * erf(alpha * x + s) + b`` computed here in float64 (the forward in every dtype,
half inputs computed in float32; the gradients of x, w, b, alpha and s; gradcheck); the swap of every norm
family ``dyt`` converts (test_dyt's cases) carries the old per-channel scale and bias over; ``alpha0``/``shift0``;
QK-norms follow the target; save/reload through the transformers format and ``NormSwap.restore``.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_dyt import CASES, FAMILIES, TOL, C  # the same shapes and the same families as DyT's
from torch import Tensor, nn

from lightning_mrs import Derf, Derf2d, DyT, DyT2d, SwapOptions, swap_norms
from lightning_mrs.swap.derf import DEFAULT_ALPHA0, DEFAULT_SHIFT0, derf
from lightning_mrs.swap.layers import NormAct
from lightning_mrs.swap.spec import describe_layers, rebuild

ta = pytest.importorskip("timm.layers.norm_act")

OF_DYT = {DyT: Derf, DyT2d: Derf2d}


def reference(x: Tensor, alpha: Tensor | float, shift: Tensor | float, scale: Tensor | None, bias: Tensor | None,
              channel_dim: int) -> Tensor:
    """``scale * erf(alpha * x + shift) + bias`` in float64, ``scale``/``bias`` per channel on ``channel_dim``
    (differentiable in every argument that is a float64 tensor)."""
    y = torch.erf(alpha * x.double() + shift)
    shape = [1] * x.ndim
    shape[channel_dim] = -1
    if scale is not None:
        y = y * scale.double().reshape(shape)
    if bias is not None:
        y = y + bias.double().reshape(shape)
    return y


def _randomised(norm: Derf) -> Derf:
    with torch.no_grad():
        norm.alpha.fill_(0.7)
        norm.shift.fill_(-0.3)
        for p in (norm.weight, norm.bias):
            if p is not None:
                p.uniform_(-2, 2)
    return norm


def _ref_of(norm: Derf, x: Tensor) -> Tensor:
    return reference(x, norm.alpha.item(), norm.shift.item(), norm.weight.detach(), norm.bias.detach(),
                     norm.channel_dim)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("cls,shape", CASES)
def test_matches_the_float64_formula(cls: type, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    cls = OF_DYT[cls]
    c = shape[-1] if cls is Derf else shape[1]
    norm = _randomised(cls(c))
    x = (3 * torch.randn(shape, dtype=torch.float64)).to(dtype)
    y = norm(x)
    assert y.dtype == dtype and y.shape == x.shape
    atol, rtol = TOL[dtype]
    expected = _ref_of(norm, x)
    half = dtype in (torch.float16, torch.bfloat16)  # the float32 result rounded once to the half dtype
    torch.testing.assert_close(y.double(), expected.to(dtype).double() if half else expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("cls,shape", [(Derf, (4, 3, 6)), (Derf2d, (2, 6, 3, 3))])
def test_gradients_match_the_float64_formula(cls: type, shape: tuple[int, ...]) -> None:
    """d/dx, d/dw, d/db, d/dalpha, d/ds of the float32 layer against autograd through the float64 formula."""
    norm = _randomised(cls(6))
    x = 2 * torch.randn(shape)
    gy = torch.randn(shape, dtype=torch.float64)
    xi = x.clone().requires_grad_(True)
    norm(xi).backward(gy.float())
    leaves = [t.detach().double().requires_grad_(True) for t in (x, norm.alpha, norm.shift, norm.weight, norm.bias)]
    xd, alpha, shift, w, b = leaves
    reference(xd, alpha, shift, w, b, norm.channel_dim).backward(gy)
    for got, want in zip((xi.grad, norm.alpha.grad, norm.shift.grad, norm.weight.grad, norm.bias.grad), leaves):
        torch.testing.assert_close(got.double(), want.grad, atol=1e-4, rtol=1e-4)


def test_half_inputs_are_computed_in_float32() -> None:
    """float16 in, float32 inside: the float16 rounding of the float32 result, not of a float16 erf chain."""
    norm = _randomised(Derf(64))
    for dtype in (torch.float16, torch.bfloat16):
        x = (2 * torch.randn(32, 64)).to(dtype)  # erf unsaturated: a half-precision chain rounds more than once
        expected = derf(x.float(), norm.alpha.detach(), norm.shift.detach(), norm.weight.detach(),
                        norm.bias.detach()).to(dtype)
        assert torch.equal(norm(x), expected)
    assert torch.isfinite(norm(torch.full((1, 64), 65504.0, dtype=torch.float16))).all()


@pytest.mark.parametrize("cls,shape", [(Derf, (3, 4)), (Derf2d, (2, 4, 3))])
def test_gradcheck_float64(cls: type, shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    alpha = torch.tensor([0.6], dtype=torch.float64, requires_grad=True)
    shift = torch.tensor([-0.2], dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    channel_dim = cls(4).channel_dim
    assert torch.autograd.gradcheck(lambda *t: derf(*t, channel_dim), (x, alpha, shift, w, b))


def test_module_defaults_and_errors() -> None:
    norm = Derf(4)
    assert (norm.alpha.item(), norm.shift.item()) == (DEFAULT_ALPHA0, DEFAULT_SHIFT0) == (0.5, 0.0)  # the paper's
    assert torch.equal(norm.weight, torch.ones(4)) and torch.equal(norm.bias, torch.zeros(4))
    with torch.no_grad():
        norm.alpha.fill_(3.0)
        norm.shift.fill_(1.0)
        norm.weight.fill_(2.0)
    norm.reset_parameters()
    assert (norm.alpha.item(), norm.shift.item()) == (0.5, 0.0) and torch.equal(norm.weight, torch.ones(4))
    assert Derf(4, shift0=-0.25).shift.item() == -0.25
    bare = Derf2d(4, affine=False, alpha0=0.2, shift0=0.1)
    assert bare.weight is None and bare.bias is None
    assert repr(bare) == "Derf2d(4, affine=False, bias=False, alpha0=0.2, shift0=0.1)"
    assert [n for n, _ in Derf(4, bias=False).named_parameters()] == ["alpha", "shift", "weight"]
    assert {p.dtype for p in Derf(4, dtype=torch.float64).parameters()} == {torch.float64}
    with pytest.raises(ValueError, match=r"Derf\(4\): expected the last dim to hold 4 channels.*use Derf2d"):
        norm(torch.randn(4, 3))
    with pytest.raises(ValueError, match=r"Derf2d\(4\): expected \(N, 4, \*spatial\).*use Derf for"):
        Derf2d(4)(torch.randn(2, 3, 4))
    with pytest.raises(TypeError, match="floating-point"):
        norm(torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"Derf\(4\): alpha0 must be a finite float > 0"):
        Derf(4, alpha0=0.0)
    for bad in (math.nan, math.inf, True, "0"):
        with pytest.raises(ValueError, match=r"Derf\(4\): shift0 must be a finite float"):
            Derf(4, shift0=bad)


def test_fx_and_torchscript_give_the_eager_output() -> None:
    for norm, x in ((_randomised(Derf(6)), torch.randn(2, 3, 6)), (_randomised(Derf2d(6)), torch.randn(2, 6, 3, 3))):
        traced = torch.fx.symbolic_trace(norm)
        assert torch.equal(traced(x), norm(x))
        with pytest.warns(FutureWarning):  # torch.jit.script is deprecated, still supported
            assert torch.equal(torch.jit.script(norm)(x), norm(x))


# ------------------------------------------------------------------ the swap: every family DyT converts
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
    # values exact in float32: a weightless source gives no dtype, so its Derf's scalars are float32
    report = swap_norms(model, "derf", alpha0=0.75, shift0=-0.25)
    assert report.converted == ["0"], report
    new = model[0]
    assert type(new) is (Derf2d if channel_dim == 1 else Derf) and new.channel_dim == channel_dim
    assert (new.bias is not None) == has_bias
    x = 3 * torch.randn((2, 5, C) if channel_dim == -1 else (2, C, 3, 4), dtype=torch.float64)
    torch.testing.assert_close(new(x), reference(x, 0.75, -0.25, scale, bias, channel_dim), atol=1e-12, rtol=1e-12)
    assert swap_norms(model, "derf").converted == []  # already Derf
    assert swap_norms(model, "dyt").converted == ["0"]  # Derf is not DyT: a dyt swap replaces it


def test_the_defaults_and_the_report() -> None:
    model = nn.Sequential(nn.LayerNorm(4), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4))
    report = swap_norms(model, "derf")
    assert report.changes == {"0": ("LayerNorm", "Derf(alpha0=0.5, shift0=0)"),
                              "2": ("BatchNorm2d", "Derf2d(alpha0=0.5, shift0=0)")}
    assert [(m.alpha.item(), m.shift.item()) for m in (model[0], model[2])] == [(0.5, 0.0)] * 2


def test_fused_norm_act_keeps_its_activation() -> None:
    old = ta.BatchNormAct2d(C, act_layer=nn.ReLU).double()
    with torch.no_grad():
        old.weight.uniform_(-2, 2)
        old.bias.uniform_(-2, 2)
    weight, bias = old.weight.detach().clone(), old.bias.detach().clone()
    model = nn.Sequential(old)
    swap_norms(model, "derf")
    assert isinstance(model[0], NormAct) and isinstance(model[0].norm, Derf2d)
    x = torch.randn(2, C, 3, 3, dtype=torch.float64)
    torch.testing.assert_close(model(x), reference(x, 0.5, 0.0, weight, bias, 1).relu())


def test_record_rebuilds_with_the_trained_scalars() -> None:
    def make() -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, C, 3), nn.BatchNorm2d(C), nn.Flatten(2), nn.Unflatten(2, (1, -1)),
                             nn.Flatten(1), nn.LayerNorm(C * 36))

    model = make()
    swap_norms(model, "derf", shift0=0.2)
    _randomised(model[1])
    records = describe_layers(model, "derf")
    assert {name: (r["kind"], r["channel_dim"]) for name, r in records.items()} == {"1": ("derf", 1), "5": ("derf", -1)}
    assert describe_layers(model, "dyt") == {}
    fresh = make()
    rebuild(fresh, "derf", records)
    fresh.load_state_dict(model.state_dict())  # the same parameters, alpha and shift included
    x = torch.randn(2, 3, 8, 8)
    assert torch.equal(fresh(x), model(x))


# ------------------------------------------------------------------ alpha0 and shift0
def test_alpha0_and_shift0_values_or_patterns() -> None:
    model = nn.Sequential(nn.LayerNorm(4), nn.Sequential(nn.LayerNorm(4), nn.LayerNorm(4)))
    report = swap_norms(model, "derf", alpha0={"1.1": 0.8, "1": 0.2}, shift0={"1": -0.5})
    layers = [m for m in model.modules() if isinstance(m, Derf)]
    assert [m.alpha.item() for m in layers] == pytest.approx([0.5, 0.2, 0.8])  # "0": the default
    assert [m.shift.item() for m in layers] == pytest.approx([0.0, -0.5, -0.5])
    assert report.changes["1.1"] == ("LayerNorm", "Derf(alpha0=0.8, shift0=-0.5)")


def test_alpha0_and_shift0_errors() -> None:
    with pytest.raises(ValueError, match=r"shift0=0.1 is the initial shift of Derf layers, but target='dyt'; use "
                                         r"target='derf', or drop shift0"):
        SwapOptions("dyt", shift0=0.1)
    assert SwapOptions("derf", alpha0=0.3).alpha0 == 0.3  # alpha0 is Derf's too
    for bad in (math.nan, -math.inf, True, "0.5", {"*": math.nan}, {}, [("*",)]):
        with pytest.raises(ValueError, match="shift0"):
            SwapOptions("derf", shift0=bad)
    assert SwapOptions("derf", shift0=-2).shift0 == -2.0 and SwapOptions("derf", shift0={"a": 0}).shift0 == (("a", 0.0),)
    model = nn.Sequential(nn.LayerNorm(4))
    with pytest.raises(ValueError, match=r"shift0='\*.input_layernorm' matches no module of Sequential"):
        swap_norms(model, "derf", shift0={"*.input_layernorm": 0.1})
    assert isinstance(model[0], nn.LayerNorm)  # nothing was changed


# ------------------------------------------------------------------ transformers: QK-norms, save and reload
def test_qwen3_qk_norms_follow_the_target_and_train() -> None:
    """Qwen3's per-head q_norm/k_norm (RMSNorm over a head's 16 channels) become Derf with the body's norms, each
    computing the formula on the real inputs with the old weight and no bias; a step trains alpha and shift."""
    from helpers.hf import tiny_causal_lm, token_batch

    model = tiny_causal_lm("qwen3")
    old = dict(model.named_modules())
    report = swap_norms(model, "derf")
    assert not report.skipped
    qk = {n: m for n, m in model.named_modules() if n.endswith(("q_norm", "k_norm"))}
    assert len(qk) == 4 and all(type(m) is Derf and m.bias is None for m in qk.values())
    seen = {}
    name, layer = next(iter(qk.items()))
    scale = old[name].weight.detach().clone()
    handle = layer.register_forward_hook(lambda m, a, out: seen.update(x=a[0], y=out))
    tokens = token_batch()
    loss = model(tokens, labels=tokens).loss
    handle.remove()
    torch.testing.assert_close(seen["y"].double(), reference(seen["x"], 0.5, 0.0, scale, None, -1))
    loss.backward()
    assert all(m.shift.grad is not None and m.shift.grad.abs() > 0 for m in model.modules() if isinstance(m, Derf))


@pytest.mark.parametrize("family", ["gpt2", "qwen3"])
def test_a_derf_model_saves_and_loads_with_its_scalars(tmp_path, family: str) -> None:
    """save_pretrained + lightning_mrs.from_pretrained rebuild the Derf layers (the config's record, QK-norms
    included) and load the trained alpha, shift, weight and bias: the very same logits."""
    from helpers.hf import tiny_causal_lm, token_batch
    from lightning_mrs import from_pretrained

    model = tiny_causal_lm(family)  # gpt2: LayerNorm with a bias (kept); qwen3: RMSNorm and QK-norms (none)
    swap_norms(model, "derf", alpha0=0.3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".alpha", ".shift")):
                p.uniform_(-0.5, 1.0)
    tokens = token_batch()
    with torch.no_grad():
        expected = model(tokens).logits
    model.save_pretrained(tmp_path)
    loaded = from_pretrained(tmp_path, attn_implementation="eager")  # the attention the saved model ran
    layers = {n: (type(m), m.bias is not None) for n, m in loaded.named_modules() if isinstance(m, Derf)}
    assert layers == {n: (type(m), m.bias is not None) for n, m in model.named_modules() if isinstance(m, Derf)}
    assert len(layers) == {"gpt2": 5, "qwen3": 9}[family]
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, expected)
