"""swap_norms over the torchvision and timm model zoos.

After ``swap_norms(model, "mrs")``: no torch/timm/torchvision norm is left unless the report
names it in ``skipped`` (checked with an independent list of norm classes, not the
registry), forward and backward run with the same output shape and finite values, and a
second swap converts nothing.

The default run covers a representative subset at 32 px for convnets, 64 px for
transformers (the swap does not depend on the input size), batch 2. The full torchvision classification list (minus models over 300M parameters) and
a broad timm list are ``@pytest.mark.slow``. The MRS layers run their eager formula here
(``norm.backend = "eager"``): this file tests the swap, and the eager path avoids compiling
kernels for every shape on the CPU; ``test_default_backend_in_the_zoo`` keeps the default
backend in the loop.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mrs import SWAP_TARGETS, swap_norms

timm = pytest.importorskip("timm")
torchvision = pytest.importorskip("torchvision")
from torchvision.models.convnext import LayerNorm2d as TVLayerNorm2d  # noqa: E402
from torchvision.ops.misc import FrozenBatchNorm2d  # noqa: E402

_TIMM_NORM_MODULES = {
    "timm.layers.norm", "timm.layers.norm_act", "timm.layers.evo_norm",
    "timm.layers.filter_response_norm", "timm.layers.grn", "timm.layers.split_batchnorm",
    "timm.layers.inplace_abn",
}
_TORCH_NORMS = (
    nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.RMSNorm, nn.LocalResponseNorm,
    FrozenBatchNorm2d, TVLayerNorm2d,
)


def foreign_norms(model: nn.Module) -> set[str]:
    """Names of torch/timm/torchvision norm layers in ``model`` (independent of the registry)."""
    found = set()
    for name, module in model.named_modules(remove_duplicate=False):
        timm_norm = any(k.__module__ in _TIMM_NORM_MODULES for k in type(module).__mro__)
        if isinstance(module, _TORCH_NORMS) or timm_norm:
            found.add(name)
    return found


def _first(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        return out["out"]
    return out[0]


#: the layers a swap to these targets builds: their weights must get gradients
NEW = {"mrs": ("MRSNorm", "MRSNorm2d"), "dyt": ("DyT", "DyT2d"), "derf": ("Derf", "Derf2d")}


def check_zoo_model(model: nn.Module, size: int, target: str = "mrs", eager: bool = True) -> None:
    torch.manual_seed(0)
    with torch.no_grad():  # zero-initialised heads (timm Mixer) would zero every gradient
        for p in model.parameters():
            if p.is_floating_point() and not p.any():
                p.normal_(0, 0.02)
    x = torch.randn(2, 3, size, size)
    model.train()
    with torch.no_grad():
        shape = _first(model(x)).shape
    report = swap_norms(model, target)
    left = foreign_norms(model) - set(report.skipped)
    if target in ("mrs", "dyt", "derf"):  # nothing of torch/timm/torchvision is left (a "layer" swap keeps GroupNorm(1))
        assert not left, f"unconverted norms not in report.skipped: {sorted(left)[:5]}"
    if eager:
        for module in model.modules():
            if hasattr(module, "backend"):
                module.backend = "eager"
    out = _first(model(x))
    assert out.shape == shape
    assert torch.isfinite(out).all()
    out.float().square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    new_norm_grads = [
        m.weight.grad for m in model.modules() if type(m).__name__ in NEW.get(target, ()) and m.weight is not None
    ]
    if target in NEW and report.converted:
        assert any(g is not None and g.abs().sum() > 0 for g in new_norm_grads)
    again = swap_norms(model, target)
    assert again.converted == []


TV_DEFAULT = [
    ("resnet18", 32), ("mobilenet_v3_small", 32), ("efficientnet_b0", 32), ("convnext_tiny", 32),
    ("swin_t", 64), ("regnet_y_400mf", 32), ("shufflenet_v2_x0_5", 32), ("mnasnet0_5", 32),
]
TIMM_DEFAULT = [
    ("resnet10t", {}, 32), ("resnetv2_50x1_bit", {}, 32), ("convnext_atto", {}, 32),
    ("convnextv2_atto", {}, 32), ("deit_tiny_patch16_224", dict(img_size=64), 64),
    ("vit_tiny_patch16_224", dict(img_size=32, depth=2, qk_norm=True), 32),
    ("vit_tiny_patch16_224", dict(img_size=32, depth=2, norm_layer="rmsnorm"), 32),
    ("efficientnet_b0", {}, 32), ("test_efficientnet_gn", {}, 32), ("test_efficientnet_ln", {}, 32),
    ("mobilenetv3_small_050", {}, 32), ("regnetx_002", {}, 32), ("cs3darknet_focus_s", {}, 32),
    ("dla46x_c", {}, 32), ("levit_128s", dict(img_size=64), 64), ("poolformerv2_s12", {}, 32),
    ("mobilevit_xxs", {}, 32), ("edgenext_xx_small", {}, 32), ("ghostnet_050", {}, 32),
    ("fastvit_t8", {}, 32), ("coatnet_nano_rw_224", dict(img_size=64), 64),
    ("swin_tiny_patch4_window7_224", dict(img_size=64, window_size=4), 64),
    ("test_byobnet", {}, 32), ("test_mambaout", {}, 64),
]


@pytest.mark.parametrize("name,size", TV_DEFAULT, ids=[n for n, _ in TV_DEFAULT])
def test_torchvision_subset(name, size):
    kwargs = {"init_weights": False, "aux_logits": False} if name == "googlenet" else {}
    check_zoo_model(torchvision.models.get_model(name, weights=None, num_classes=10, **kwargs), size)


@pytest.mark.parametrize("name,kwargs,size", TIMM_DEFAULT, ids=[f"{n}-{'-'.join(k)}" for n, k, _ in TIMM_DEFAULT])
def test_timm_subset(name, kwargs, size):
    check_zoo_model(timm.create_model(name, pretrained=False, num_classes=10, **kwargs), size)


def test_timm_rexnet_odd_widths_are_reported():
    model = timm.create_model("rexnet_100", pretrained=False)
    report = swap_norms(model)
    assert report.skipped and all("odd channel count" in r for r in report.skipped.values())
    assert report.skipped.keys() == foreign_norms(model)


BASELINE_MODELS = {
    "resnet18": lambda: torchvision.models.resnet18(num_classes=10),
    "convnext_atto": lambda: timm.create_model("convnext_atto", pretrained=False, num_classes=10),
    "test_vit": lambda: timm.create_model("test_vit", pretrained=False, num_classes=10),
}


@pytest.mark.parametrize("target", [t for t in SWAP_TARGETS if t != "mrs" and not t.endswith("-half")])
@pytest.mark.parametrize("name", list(BASELINE_MODELS))
def test_baseline_targets_run(name, target):
    check_zoo_model(BASELINE_MODELS[name](), 64 if name == "test_vit" else 32, target)


DYT_ZOO = [("tv", n, {}, s) for n, s in TV_DEFAULT] + [("timm", n, k, s) for n, k, s in TIMM_DEFAULT]


@pytest.mark.slow
@pytest.mark.parametrize("target", ["dyt", "derf"])
@pytest.mark.parametrize("lib,name,kwargs,size", DYT_ZOO, ids=[f"{lib}-{n}-{'-'.join(k)}" for lib, n, k, _ in DYT_ZOO])
def test_dyt_over_the_default_zoo(lib, name, kwargs, size, target):
    """Every model of the default subsets swapped to DyT and to Derf: nothing left but what the report skips
    (EvoNorm...)."""
    if lib == "tv":
        model = torchvision.models.get_model(name, weights=None, num_classes=10)
    else:
        model = timm.create_model(name, pretrained=False, num_classes=10, **kwargs)
    check_zoo_model(model, size, target)


def test_default_backend_in_the_zoo():
    """The MRS layers' default backend (whatever it picks on this machine) in real models,
    including in-place activations right after a norm (torchvision ResNet, timm BatchNormAct2d)."""
    # 16 px keeps every tensor small, so no backend compiles kernels on the CPU here
    check_zoo_model(torchvision.models.resnet18(num_classes=10), 16, eager=False)
    check_zoo_model(timm.create_model("efficientnet_b0", pretrained=False, num_classes=10), 16, eager=False)


# ------------------------------------------------------------------ slow: the whole zoo
def _torchvision_all() -> list[str]:
    too_big = {"vit_h_14", "regnet_y_128gf", "vit_l_16", "vit_l_32"}  # > 300M parameters
    return [n for n in torchvision.models.list_models(module=torchvision.models) if n not in too_big]


_TV_SIZE = {"inception_v3": 299, "maxvit_t": 224, "vit_b_16": 224, "vit_b_32": 224}


@pytest.mark.slow
@pytest.mark.parametrize("name", _torchvision_all())
def test_torchvision_all(name):
    kwargs = {"init_weights": False, "aux_logits": False} if name in ("googlenet", "inception_v3") else {}
    check_zoo_model(torchvision.models.get_model(name, weights=None, num_classes=10, **kwargs), _TV_SIZE.get(name, 64))


TIMM_ALL = [
    "resnet18", "resnet50d", "seresnext26d_32x4d", "resnetv2_50x1_bit", "resnetv2_18", "convnext_atto",
    "convnext_nano", "convnextv2_atto", "vit_tiny_patch16_224", "deit_tiny_patch16_224",
    "vit_small_patch16_rope_224", "efficientnet_b0", "efficientnet_lite0", "efficientnetv2_rw_t",
    "mobilenetv3_small_050", "mobilenetv3_large_100", "mobilenetv4_conv_small", "regnetx_002",
    "regnety_002", "regnetz_b16", "cspresnet50", "cs3darknet_focus_s", "cspnext_tiny", "dla34",
    "dla46x_c", "levit_128s", "poolformer_s12", "poolformerv2_s12", "convformer_s18", "caformer_s18",
    "mobilevit_xxs", "mobilevitv2_050", "edgenext_xx_small", "ghostnet_050", "ghostnetv2_100",
    "rexnet_100", "fastvit_t8", "coatnet_nano_rw_224", "coatnext_nano_rw_224", "efficientformer_l1",
    "efficientformerv2_s0", "swin_tiny_patch4_window7_224", "swinv2_tiny_window8_256",
    "swinv2_cr_tiny_224", "maxvit_pico_rw_256", "maxxvit_rmlp_nano_rw_256", "halonet_h1",
    "mobileone_s1", "repvgg_a0", "gernet_s", "cait_xxs24_224", "coat_tiny", "convit_tiny",
    "convmixer_768_32", "cpubone_nano", "crossvit_tiny_240", "csatv2", "davit_tiny", "dpn48b",
    "efficientvim_m1", "efficientvit_b0", "efficientvit_m0", "eva02_tiny_patch14_224", "fasternet_t0",
    "focalnet_tiny_srf", "gcvit_xxtiny", "hardcorenas_b", "hgnetv2_b0", "hiera_tiny_224",
    "sam2_hiera_tiny", "hrnet_w18_small", "iformer_t", "inception_next_atto", "lcnetv2_small",
    "lowformer_b0", "mambaout_femto", "gmlp_ti16_224", "mixer_s32_224", "mvitv2_tiny", "nest_tiny",
    "nextvit_small", "nfnet_l0", "dm_nfnet_f0", "pit_ti_224", "pvt_v2_b0", "rdnet_tiny",
    "repghostnet_050", "repvit_m1", "res2next50", "resnest14d", "selecsls42", "legacy_seresnet18",
    "sequencer2d_s", "shvit_s1", "skresnet18", "starnet_s050", "swiftformer_xs", "tiny_vit_5m_224",
    "tnt_s_legacy_patch16_224", "tresnet_m", "twins_svt_small", "visformer_tiny",
    "vit_tiny_r_s16_p8_224", "vit_relpos_small_patch16_224", "vitamin_small_224", "volo_d1_224",
    "ese_vovnet19b_slim_dw", "xception41p", "legacy_xception", "xcit_nano_12_p8_224", "densenet121",
    "inception_v3", "inception_v4", "beit_base_patch16_224", "vgg11_bn", "hgnet_tiny",
    "maxvit_nano_rw_256", "coatnet_0_rw_224", "test_efficientnet_evos", "test_vit2", "test_vit3",
]


@pytest.mark.slow
@pytest.mark.parametrize("name", TIMM_ALL)
def test_timm_all(name):
    model = timm.create_model(name, pretrained=False, num_classes=10)
    try:  # convnets at 64 px; models with fixed token grids at their own size
        with torch.no_grad():
            model.eval()(torch.randn(1, 3, 64, 64))
        size = 64
    except Exception:  # noqa: BLE001
        size = model.pretrained_cfg.get("input_size", (3, 224, 224))[-1]
    check_zoo_model(model, size)
