"""torch.fx and TorchScript on swapped models (QK-norms in torchvision attention included): a
traced, feature-extracted or scripted model gives the eager swapped model's outputs and gradients,
and the shape checks still fire.

Before the norms' forwards were fx-wrapped functions (``lightning_mrs.modules``,
``lightning_mrs.swap.layers``), ``symbolic_trace`` of any model holding an MRSNorm or a
channels-first baseline raised "symbolically traced variables cannot be used as inputs to control
flow", and ``torch.jit.script`` of a model swapped to ``rms`` failed to compile.
"""

import re
import warnings
from typing import Callable

import pytest
import torch
from torch import Tensor, nn

torchvision = pytest.importorskip("torchvision")
from torchvision.models.feature_extraction import create_feature_extractor  # noqa: E402
from torchvision.models.swin_transformer import PatchMergingV2, SwinTransformerBlockV2  # noqa: E402

from lightning_mrs import Derf, DyT, LayerNorm2d, MRSNorm, MRSNorm2d, NormAct, OffsetRMSNorm, RMSNorm2d, swap_norms
from lightning_mrs.modules import _mrs_norm_layer
from lightning_mrs.swap import attention_torchvision, derf, dyt, layers

timm = pytest.importorskip("timm")
ta = pytest.importorskip("timm.layers.norm_act")
tn = pytest.importorskip("timm.layers.norm")

TARGETS = ("mrs", "rms", "layer", *(pytest.param(t, marks=pytest.mark.slow) for t in ("dyt", "derf")))  # +16 s each
#: the fx-wrapped forwards: each norm of ours is exactly one call_function node of these
WRAPPED = {_mrs_norm_layer, layers._layer_norm_2d, layers._rms_norm_2d, layers._offset_rms_norm, dyt._dyt_layer,
           derf._derf_layer}
OURS = (MRSNorm, MRSNorm2d, LayerNorm2d, RMSNorm2d, OffsetRMSNorm, DyT, Derf)

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")


class EveryNorm(nn.Module):
    """One source norm of each kind the swap converts: channels-first per-sample (BatchNorm,
    GroupNorm), per-position (timm's LayerNorm2d), fused norm+act (BatchNormAct2d), and
    channels-last LayerNorm and RMSNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.gn = nn.GroupNorm(2, 8)
        self.ln2d = tn.LayerNorm2d(8)
        self.bnact = ta.BatchNormAct2d(8, act_layer=nn.ReLU)
        self.ln = nn.LayerNorm(8)
        self.rms = nn.RMSNorm(8)

    def forward(self, x: Tensor) -> Tensor:
        x = self.bnact(self.ln2d(self.gn(self.bn(self.conv(x)))))  # (N, 8, H, W)
        return self.rms(self.ln(x.flatten(2).transpose(1, 2)))  # (N, HW, 8)


def _randomise(model: nn.Module) -> nn.Module:
    """Weights away from their init, so a dropped weight or bias shows."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], dict]] = {
    "timm_resnet18": (lambda: timm.create_model("resnet18", num_classes=5), (2, 3, 32, 32), {}),
    "convnext_atto": (lambda: timm.create_model("convnext_atto", num_classes=5), (2, 3, 32, 32), {}),
    "vit_tiny_qk": (lambda: timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2,
                                              num_classes=5, qk_norm=True), (2, 3, 32, 32), {"qk_norm": True}),
    "tv_resnet18": (lambda: torchvision.models.resnet18(num_classes=5), (2, 3, 32, 32), {}),
    "every_norm_per_sample": (EveryNorm, (2, 3, 8, 8), {"spatial": True}),
    "every_norm_per_position": (EveryNorm, (2, 3, 8, 8), {"spatial": False}),
    "quick_check": (lambda: nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Flatten(), nn.LayerNorm(8 * 6 * 6)),
                    (2, 3, 8, 8), {}),
}


def _swapped(name: str, target: str) -> tuple[nn.Module, Tensor]:
    make, shape, options = MODELS[name]
    if target in ("dyt", "derf"):  # QK-norms of DyT/Derf are not added (qk_norm=True asks for the target's kind); those there follow
        options = {k: v for k, v in options.items() if k != "qk_norm"}
    torch.manual_seed(0)
    model = make()
    swap_norms(model, target, **options)
    return _randomise(model), torch.randn(shape)


def _wrapped_calls(gm: torch.fx.GraphModule) -> int:
    return sum(n.op == "call_function" and n.target in WRAPPED for n in gm.graph.nodes)


def _ours(model: nn.Module) -> int:
    return sum(isinstance(m, OURS) for m in model.modules())


def _grads(model: Callable[[Tensor], Tensor], params: list[Tensor], x: Tensor) -> tuple[Tensor, ...]:
    x = x.clone().requires_grad_(True)
    out = model(x)
    gy = torch.linspace(-1, 1, out.numel()).view_as(out)  # a fixed, non-uniform cotangent
    return (out.detach(), *torch.autograd.grad(out, [x, *params], gy))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", list(MODELS))
def test_symbolic_trace_matches_eager_forward_and_backward(name: str, target: str) -> None:
    model, x = _swapped(name, target)
    gm = torch.fx.symbolic_trace(model)
    assert _wrapped_calls(gm) == _ours(model)  # every norm of ours is one node, none traced away
    params = list(model.parameters())
    eager, traced = _grads(model, params, x), _grads(gm, params, x)
    for e, t in zip(eager, traced):
        # the graph runs the very same kernels; their multithreaded sums may round differently
        torch.testing.assert_close(t, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("target", TARGETS)
def test_torchvision_create_feature_extractor(target: str) -> None:
    model, x = _swapped("tv_resnet18", target)
    eager = {}
    handles = [getattr(model, name).register_forward_hook(lambda m, i, o, name=name: eager.__setitem__(name, o))
               for name in ("layer1", "layer4")]
    model(x)
    for handle in handles:
        handle.remove()  # else the tracer would run them too
    feats = create_feature_extractor(model, {"layer1": "layer1", "layer4": "layer4"})(x)
    for name in ("layer1", "layer4"):
        torch.testing.assert_close(feats[name], eager[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("target", TARGETS)
def test_timm_fx_feature_extraction(target: str) -> None:
    model, x = _swapped("convnext_atto", target)
    eager = model.forward_intermediates(x, indices=[0, 3], intermediates_only=True)
    # timm's own fx entry point (its tracer with timm's leaf modules and autowrapped functions)
    extractor = timm.models.create_feature_extractor(model, {"stages.0": "s0", "stages.3": "s3"})
    feats = extractor(x)
    torch.testing.assert_close(feats["s0"], eager[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(feats["s3"], eager[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("target", TARGETS)
def test_timm_features_only_fx_swapped_after_creation(target: str) -> None:
    plain = timm.create_model("resnet18", features_only=True, out_indices=(1, 4))
    fx = timm.create_model("resnet18", features_only=True, out_indices=(1, 4), feature_cls="fx")
    swap_norms(plain, target)
    swap_norms(fx, target)
    fx.graph_module.load_state_dict(_randomise(plain).state_dict())
    x = torch.randn(2, 3, 32, 32)
    for a, b in zip(fx.eval()(x), plain(x)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", ["every_norm_per_sample", "every_norm_per_position", "quick_check"])
def test_fx_then_torchscript_matches_eager(name: str, target: str) -> None:
    model, x = _swapped(name, target)
    scripted = torch.jit.script(torch.fx.symbolic_trace(model))
    # TorchScript runs the reference formula, not the kernels: equal up to float rounding
    torch.testing.assert_close(scripted(x), model(x), rtol=1e-5, atol=1e-5)


BASELINES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "LayerNorm2d": (lambda: LayerNorm2d(8), (2, 8, 3, 5)),
    "LayerNorm2d(affine=False)": (lambda: LayerNorm2d(8, affine=False), (2, 8, 3, 5)),
    "RMSNorm2d": (lambda: RMSNorm2d(8), (2, 8, 3, 5)),
    "RMSNorm2d(spatial=True, affine=False)": (lambda: RMSNorm2d(8, affine=False, spatial=True), (2, 8, 3, 5)),
    "OffsetRMSNorm": (lambda: OffsetRMSNorm(8), (2, 3, 8)),
    "OffsetRMSNorm(affine=False)": (lambda: OffsetRMSNorm(8, affine=False), (2, 3, 8)),
    "NormAct(RMSNorm2d)": (lambda: NormAct(RMSNorm2d(8, spatial=True), nn.Dropout(0.5), nn.ReLU()), (2, 8, 3, 5)),
    "MRSNorm": (lambda: MRSNorm(8), (2, 3, 8)),
    "MRSNorm2d(spatial=True)": (lambda: MRSNorm2d(8, spatial=True), (2, 8, 3, 5)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(BASELINES))
def test_every_layer_scripts_and_traces(name: str, dtype: torch.dtype) -> None:
    make, shape = BASELINES[name]
    layer = _randomise(make())
    x = torch.randn(shape, dtype=dtype)
    eager = layer(x)
    # scripted, an MRSNorm runs the reference formula instead of the kernels: equal up to rounding
    exact = not isinstance(layer, (MRSNorm, MRSNorm2d))
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(torch.fx.symbolic_trace(layer)(x), eager, rtol=0, atol=0)
    torch.testing.assert_close(torch.jit.script(layer)(x), eager, **tol)
    torch.testing.assert_close(torch.jit.script(torch.fx.symbolic_trace(layer))(x), eager, **tol)


@pytest.mark.parametrize("target,spatial", [("rms", True), ("rms", False), ("layer", True), ("layer", False)])
def test_swapped_resnet_scripts(target: str, spatial: bool) -> None:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=5)
    swap_norms(model, target, spatial=spatial)
    _randomise(model)
    assert any(isinstance(m, (RMSNorm2d, LayerNorm2d, nn.GroupNorm)) for m in model.modules())
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(torch.jit.script(model)(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("make,shape", [
    (lambda: MRSNorm(8), (2, 3, 6)),
    (lambda: MRSNorm2d(8, spatial=True), (2, 6, 4)),
    (lambda: RMSNorm2d(8), (2, 6, 4)),
    (lambda: LayerNorm2d(8), (2, 6, 4)),
])
def test_shape_check_fires_inside_a_traced_graph(make: Callable[[], nn.Module], shape: tuple[int, ...]) -> None:
    layer = make()
    x = torch.randn(shape)
    with pytest.raises(ValueError) as eager:
        layer(x)
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Identity(), layer))
    with pytest.raises(ValueError, match=re.escape(str(eager.value))):
        gm(x)


# QK-norms in torchvision attention (ViT's nn.MultiheadAttention, Swin V1/V2's window attention,
# MaxViT's). Before, symbolic_trace of each raised "symbolically traced variables cannot be used as
# inputs to control flow" (the rebuilt attention branched on the input's shape, and MaxViT's iterated
# a traced chunk). ViT's and MaxViT's now trace natively (the layout branches are fx-wrapped
# functions, each QK-norm its own node); Swin's window attention is one wrapped node, as
# torchvision's own shifted_window_attention is.

QK_MODELS: dict[str, tuple[Callable[[], nn.Module], str]] = {
    # (the model, the block whose output create_feature_extractor takes)
    "vit": (lambda: torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                                                         hidden_dim=32, mlp_dim=64, num_classes=5), "encoder.layers.encoder_layer_0"),
    "swin": (lambda: torchvision.models.SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 2],
                                                        window_size=[4, 4], num_classes=5), "features.1"),
    "swin_v2": (lambda: torchvision.models.SwinTransformer(
        patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 2], window_size=[4, 4], num_classes=5,
        block=SwinTransformerBlockV2, downsample_layer=PatchMergingV2), "features.1"),
    "maxvit": (lambda: torchvision.models.MaxVit(input_size=(32, 32), stem_channels=8, partition_size=2,
                                                 block_channels=[16, 32], block_layers=[1, 1], head_dim=8,
                                                 stochastic_depth_prob=0.0, num_classes=5), "blocks.0"),
}


def _qk_swapped(name: str, target: str) -> nn.Module:
    torch.manual_seed(0)
    model = QK_MODELS[name][0]()
    report = swap_norms(model, target, qk_norm=target)
    assert len(report.qk_added) >= 4, report.qk_added  # two per attention layer, every layer
    with torch.no_grad():  # weights away from their init, so a skipped QK-norm weight shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def _window_calls(gm: torch.fx.GraphModule) -> int:
    return sum(n.op == "call_function" and n.target is attention_torchvision._window_attention for n in gm.graph.nodes)


@pytest.mark.parametrize("target", ["mrs", "rms", "layer"])
@pytest.mark.parametrize("name", list(QK_MODELS))
def test_symbolic_trace_of_qk_attention_matches_eager(name: str, target: str) -> None:
    model = _qk_swapped(name, target)
    gm = torch.fx.symbolic_trace(model)
    assert _window_calls(gm) == (4 if name.startswith("swin") else 0)  # Swin: one node per window attention
    x = torch.randn(2, 3, 32, 32)
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    eager, traced = _grads(model, params, x), _grads(gm, params, x)
    for key, e, t in zip(["out", "x", *names], eager, traced):
        torch.testing.assert_close(t, e, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
    # not vacuous: every QK-norm weight gets a gradient, so a graph that skipped one would differ above
    qk = {key: g for key, g in zip(names, eager[2:]) if key.rpartition(".")[0].endswith(("q_norm", "k_norm"))}
    assert len(qk) >= 4 and all(g.abs().sum() > 0 for g in qk.values()), sorted(qk)


@pytest.mark.parametrize("name", list(QK_MODELS))
def test_create_feature_extractor_on_qk_attention(name: str) -> None:
    model = _qk_swapped(name, "mrs")
    block = QK_MODELS[name][1]
    x = torch.randn(2, 3, 32, 32)
    eager = {}
    handle = model.get_submodule(block).register_forward_hook(lambda m, i, o: eager.__setitem__("out", o))
    model(x)
    handle.remove()  # else the tracer would run it too
    feats = create_feature_extractor(model, {block: "block"})(x)
    torch.testing.assert_close(feats["block"], eager["out"], rtol=1e-5, atol=1e-6)


class _MaskedAttention(nn.Module):
    """A QK-norm attention called sequence-first with a padding mask and a per-head bool mask: the
    layout and mask branches ``symbolic_trace`` must not see (they are fx-wrapped)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2)  # batch_first=False: (L, B, E)

    def forward(self, x: Tensor, pad: Tensor, mask: Tensor) -> Tensor:
        out, weights = self.attn(x, x, x, key_padding_mask=pad, attn_mask=mask, average_attn_weights=False)
        return out.sum() + weights.sum(dim=-1).mean()


def test_traced_qk_multihead_attention_takes_masks_and_any_layout() -> None:
    torch.manual_seed(0)
    model = _MaskedAttention()
    swap_norms(model, None, qk_norm="mrs")
    assert type(model.attn).__name__ == "QKMultiheadAttention"
    with torch.no_grad():
        model.attn.q_norm.weight.uniform_(0.5, 1.5)
    gm = torch.fx.symbolic_trace(model)
    x = torch.randn(5, 3, 8)
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[0, -2:] = True
    mask = torch.rand(3 * 2, 5, 5) > 0.8
    mask[..., 0] = False  # every row attends somewhere
    torch.testing.assert_close(gm(x, pad, mask), model(x, pad, mask), rtol=0, atol=0)
    unbatched = (x[:, 0], pad[0], mask[:2])  # (L, E), (S,), (heads, L, S)
    torch.testing.assert_close(gm(*unbatched), model(*unbatched), rtol=0, atol=0)
