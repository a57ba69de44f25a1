"""swap_norms: conversions checked against float64 reference maths, and every invariant."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mrs import LayerNorm2d, MRSNorm, MRSNorm2d, NormAct, RMSNorm2d, iter_norm_layers, swap_norms

ta = pytest.importorskip("timm.layers.norm_act")
tn = pytest.importorskip("timm.layers.norm")
from torchvision.ops.misc import FrozenBatchNorm2d  # noqa: E402


def ref_mrs(x: torch.Tensor, w: torch.Tensor, eps: float, channel_dim: int, spatial: bool) -> torch.Tensor:
    """docs/method.md in float64: r_i = sqrt(a^2 + b^2 + eps), S = mean r_i, y = g_i * z_i / S."""
    x = x.double().movedim(channel_dim, -1)  # (..., C)
    z = x.unflatten(-1, (-1, 2))  # (..., P, 2)
    r = torch.sqrt((z * z).sum(-1) + eps)  # (..., P)
    if spatial:  # one S per sample over all phasors at all positions
        s = r.flatten(1).mean(1).view(-1, *([1] * (r.ndim - 1)))[..., None]  # (N, 1.., 1)
    else:
        s = r.mean(-1, keepdim=True)[..., None]  # (..., 1, 1)
    y = (w.double()[:, None] * z / s).flatten(-2)  # (..., C)
    return y.movedim(-1, channel_dim)


def ref_rms(x, w, eps, dims):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps) * w.double().view(-1, *([1] * (x.ndim - 2)))


def _randomise(module: nn.Module) -> nn.Module:
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            if t.is_floating_point():
                t.uniform_(0.5, 1.5)
    return module


C = 10


_CF_SOURCES = [  # (factory, spatial under "auto", input shape): 4-D-only layers get 4-D inputs
    (lambda: nn.BatchNorm2d(C), True, (3, C, 5, 7)),
    (lambda: nn.BatchNorm1d(C), True, (2, C, 9)),
    (lambda: nn.GroupNorm(5, C), True, (3, C, 5, 7)),
    (lambda: nn.GroupNorm(5, C), True, (2, C, 9)),
    (lambda: nn.InstanceNorm2d(C, affine=True), True, (3, C, 5, 7)),
    (lambda: FrozenBatchNorm2d(C), True, (3, C, 5, 7)),
    (lambda: tn.LayerNorm2d(C), False, (3, C, 5, 7)),
    (lambda: tn.RmsNorm2d(C), False, (3, C, 5, 7)),
]


@pytest.mark.parametrize("factory,spatial_auto,shape", _CF_SOURCES)
@pytest.mark.parametrize("spatial", ["auto", True, False])
def test_channels_first_to_mrs_matches_reference(factory, spatial_auto, spatial, shape):
    old = _randomise(factory()).double()
    model = nn.Sequential(old)
    report = swap_norms(model, "mrs", spatial=spatial)
    new = model[0]
    want_spatial = spatial_auto if spatial == "auto" else spatial
    assert type(new) is MRSNorm2d and new.spatial is want_spatial and report.converted == ["0"]
    w = old.weight.detach().view(-1, 2).mean(1)  # init="inherit": mean of each pair
    torch.testing.assert_close(new.weight.detach(), w)
    assert new.weight.dtype == torch.float64
    x = torch.randn(shape, dtype=torch.float64)
    torch.testing.assert_close(new(x), ref_mrs(x, w, new.eps, 1, want_spatial), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("factory", [lambda: nn.LayerNorm(C), lambda: tn.RmsNorm(C), lambda: nn.RMSNorm(C), lambda: tn.SimpleNorm(C)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_channels_last_to_mrs_matches_reference(factory, dtype, tol):
    model = nn.Sequential(nn.Linear(4, C), _randomise(factory())).to(dtype)
    swap_norms(model)
    new = model[1]
    assert type(new) is MRSNorm and new.weight.dtype == dtype
    x = torch.randn(3, 7, C, dtype=dtype)
    torch.testing.assert_close(new(x).double(), ref_mrs(x, new.weight, new.eps, -1, False), atol=tol, rtol=tol)


def test_layer_and_rms_baselines_match_torch():
    x = torch.randn(2, C, 5, 3, dtype=torch.float64)
    # per-sample (BatchNorm source): GroupNorm(1, C) / RMSNorm2d(spatial=True)
    m = nn.Sequential(_randomise(nn.BatchNorm2d(C)).double())
    swap_norms(m, "layer")
    assert type(m[0]) is nn.GroupNorm and m[0].num_groups == 1
    ref = F.group_norm(x, 1, m[0].weight, m[0].bias, m[0].eps)
    torch.testing.assert_close(m[0](x), ref)
    m = nn.Sequential(_randomise(nn.BatchNorm2d(C)).double())
    w = m[0].weight.detach().clone()
    swap_norms(m, "rms")
    assert type(m[0]) is RMSNorm2d and m[0].spatial
    torch.testing.assert_close(m[0](x), ref_rms(x, w, m[0].eps, (1, 2, 3)))
    # per-position (LayerNorm2d source): LayerNorm2d / RMSNorm2d(spatial=False)
    m = nn.Sequential(_randomise(nn.GroupNorm(2, C)).double())
    swap_norms(m, "layer", spatial=False)
    assert type(m[0]) is LayerNorm2d
    ref = F.layer_norm(x.movedim(1, -1), (C,), m[0].weight, m[0].bias, m[0].eps).movedim(-1, 1)
    torch.testing.assert_close(m[0](x), ref)
    m = nn.Sequential(_randomise(tn.LayerNorm2d(C)).double())
    swap_norms(m, "rms")
    assert type(m[0]) is RMSNorm2d and not m[0].spatial
    torch.testing.assert_close(m[0](x), ref_rms(x, m[0].weight, m[0].eps, (1,)))
    # channels-last
    m = nn.Sequential(_randomise(nn.LayerNorm(C)))
    swap_norms(m, "rms")
    assert type(m[0]) is nn.RMSNorm
    m = nn.Sequential(_randomise(tn.RmsNorm(C)))
    w = m[0].weight.detach().clone()
    swap_norms(m, "layer")
    assert type(m[0]) is nn.LayerNorm and torch.equal(m[0].weight.detach(), w) and not m[0].bias.any()


def test_half_precision_layers_compute_in_fp32():
    x = torch.randn(2, C, 4, 4) * 300  # x^2 overflows fp16
    for layer in (RMSNorm2d(C, spatial=True), RMSNorm2d(C)):
        y = layer.half()(x.half())
        assert y.dtype == torch.float16 and torch.isfinite(y).all()
        torch.testing.assert_close(y.double(), layer.double()(x.double()), atol=2e-3, rtol=2e-3)


def test_inherit_keeps_zero_init_residual_and_ones_resets():
    import torchvision

    model = torchvision.models.resnet18(zero_init_residual=True)
    swap_norms(model)
    assert not model.layer1[0].bn2.weight.any()  # zero-init branch survives
    assert (model.layer1[0].bn1.weight == 1).all()
    model = torchvision.models.resnet18(zero_init_residual=True)
    swap_norms(model, init="ones")
    assert (model.layer1[0].bn2.weight == 1).all()


def test_device_dtype_requires_grad_training_flags():
    model = nn.Sequential(nn.Conv2d(3, 8, 1), nn.BatchNorm2d(8), nn.LayerNorm(6), FrozenBatchNorm2d(8)).double()
    model[1].weight.requires_grad_(False)
    model[2].eval()
    swap_norms(model)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert not model[1].weight.requires_grad  # frozen stays frozen
    assert model[2].weight.requires_grad and not model[2].training and model[1].training
    assert isinstance(model[3].weight, nn.Parameter) and not model[3].weight.requires_grad  # buffer -> frozen
    meta = nn.Sequential(nn.BatchNorm2d(8, device="meta"))
    swap_norms(meta)
    assert meta[0].weight.device.type == "meta"


def test_shared_instance_stays_shared():
    shared = nn.BatchNorm2d(4)
    inner = nn.ModuleDict({"a": shared, "b": nn.Sequential(nn.Identity(), shared)})
    model = nn.Sequential(nn.Conv2d(3, 4, 1), shared, inner, nn.ModuleList([shared, nn.LayerNorm(4)]))
    report = swap_norms(model)
    assert model[1] is model[2]["a"] is model[2]["b"][1] is model[3][0]
    assert isinstance(model[1], MRSNorm2d)
    assert report.converted == ["1", "3.1"]
    assert report.aliases == {"2.a": "1", "2.b.1": "1", "3.0": "1"}
    assert len([p for p in model.parameters()]) == 1 + 1 + 1 + 1  # conv w+b, shared MRS, LN->MRS


def test_root_norm_is_refused_and_untouched():
    norm = nn.BatchNorm2d(4)
    with pytest.raises(ValueError, match="wrap it"):
        swap_norms(norm)
    assert isinstance(norm, nn.BatchNorm2d)
    swap_norms(MRSNorm(4))  # already the target: nothing to do, no error


@pytest.mark.parametrize("target", ["mrs", "rms", "layer"])
def test_second_swap_converts_nothing(target):
    import torchvision
    import timm

    for model in (torchvision.models.mobilenet_v3_small(), timm.create_model("convnext_atto", pretrained=False)):
        first = swap_norms(model, target)
        assert first.converted or target == "layer"  # convnext is all LayerNorm already
        snapshot = {n: type(m) for n, m in model.named_modules()}
        second = swap_norms(model, target)
        assert second.converted == [] and len(second.unchanged) >= len(first.converted) - len(first.skipped)
        assert snapshot == {n: type(m) for n, m in model.named_modules()}


def test_include_exclude_by_type_and_pattern():
    def net():
        return nn.Sequential(
            nn.BatchNorm2d(4), nn.Sequential(nn.GroupNorm(2, 4), nn.LayerNorm(4)), nn.ModuleDict({"head": nn.LayerNorm(4)})
        )

    m = net()
    r = swap_norms(m, exclude=[nn.GroupNorm, "2.*"])
    assert r.converted == ["0", "1.1"] and set(r.skipped) == {"1.0", "2.head"}
    assert "GroupNorm" in r.skipped["1.0"] and "'2.*'" in r.skipped["2.head"]
    m = net()
    r = swap_norms(m, include="1")  # an ancestor's name selects its subtree
    assert r.converted == ["1.0", "1.1"] and isinstance(m[0], nn.BatchNorm2d)
    m = net()
    r = swap_norms(m, include=nn.LayerNorm, exclude="2.head", strict=True)  # user skips never raise
    assert r.converted == ["1.1"]
    with pytest.raises(TypeError, match="pattern"):
        swap_norms(net(), include=[3])


def test_strict_raises_before_changing_anything():
    model = nn.Sequential(nn.BatchNorm2d(4), nn.LayerNorm(5), nn.LayerNorm([2, 4]))
    before = list(model)
    with pytest.raises(ValueError) as info:
        swap_norms(model, strict=True)
    assert "1 (LayerNorm): odd channel count 5" in str(info.value) and "2 (LayerNorm): multi-dim" in str(info.value)
    assert list(model) == before
    report = swap_norms(model)
    assert report.converted == ["0"] and set(report.skipped) == {"1", "2"}
    assert "skipped (2):" in str(report) and "odd channel count 5" in str(report)
    swap_norms(nn.Sequential(nn.LayerNorm(5)), "rms", strict=True)  # odd is fine for baselines


def test_unsupported_norms_are_reported():
    from timm.layers.evo_norm import EvoNorm2dS0

    model = nn.Sequential(EvoNorm2dS0(8, groups=2), nn.LocalResponseNorm(2), nn.BatchNorm2d(8))
    report = swap_norms(model)
    assert report.converted == ["2"] and "EvoNorm" in report.skipped["0"] and "LocalResponseNorm" in report.skipped["1"]
    leftover = [n for n, _, s in iter_norm_layers(model) if s.kind != "mrs"]
    assert set(leftover) <= set(report.skipped)


@pytest.mark.parametrize(
    "factory,x_shape",
    [
        (lambda: ta.BatchNormAct2d(8, act_layer=nn.ReLU), (2, 8, 5, 5)),
        (lambda: ta.GroupNormAct(8, num_groups=2, act_layer=nn.ReLU), (2, 8, 5, 5)),
        (lambda: ta.LayerNormAct2d(8, act_layer=nn.ReLU), (2, 8, 5, 5)),
        (lambda: ta.LayerNormAct(8, act_layer=nn.ReLU), (2, 5, 8)),
        (lambda: ta.RmsNormAct(8, act_layer=nn.ReLU), (2, 5, 8)),
        (lambda: ta.RmsNormAct2d(8, act_layer=nn.ReLU), (2, 8, 5, 5)),
        (lambda: ta.FrozenBatchNormAct2d(8, act_layer=nn.ReLU), (2, 8, 5, 5)),
    ],
)
def test_fused_norm_act_keeps_its_act_and_drop(factory, x_shape):
    old = factory()
    drop = nn.Dropout(0.0)
    old.drop = drop
    act = old.act
    assert isinstance(act, nn.ReLU)
    model = nn.Sequential(old)
    report = swap_norms(model)
    new = model[0]
    assert isinstance(new, NormAct) and new.act is act and new.drop is drop
    assert isinstance(new.norm, (MRSNorm, MRSNorm2d)) and report.changes["0"][1].endswith("+act")
    x = torch.randn(x_shape, requires_grad=True)
    y = new(x)
    assert (y >= 0).all() and (y == 0).any()  # the ReLU still runs (in place by default)
    expected = torch.relu(new.norm(x.detach()))
    torch.testing.assert_close(y.detach(), expected)
    y.sum().backward()
    assert torch.isfinite(x.grad).all()
    assert "0.norm.weight" in model.state_dict()


def test_qk_norm_becomes_phasor_attention():
    import timm

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, qk_norm=True, depth=2, num_classes=4)
    report = swap_norms(model)
    attn = model.blocks[0].attn
    assert isinstance(attn.q_norm, MRSNorm) and isinstance(attn.k_norm, MRSNorm)
    assert attn.q_norm.num_channels == attn.head_dim
    assert "QK-norms" in str(report)
    model(torch.randn(2, 3, 32, 32)).sum().backward()


def test_report_summary_counts_by_type():
    model = nn.Sequential(nn.BatchNorm2d(4), nn.BatchNorm2d(4), nn.LayerNorm(4))
    text = str(swap_norms(copy.deepcopy(model)))
    assert "3 converted" in text
    assert "BatchNorm2d -> MRSNorm2d(spatial=True)  x2" in text and "LayerNorm -> MRSNorm" in text


def test_hooks_on_replaced_layers_are_reported():
    model = nn.Sequential(nn.BatchNorm2d(4))
    model[0].register_forward_hook(lambda *a: None)
    report = swap_norms(model)
    assert report.notes == ["0: hooks registered on the old BatchNorm2d were not moved"]
    assert "note: 0: hooks" in str(report)
