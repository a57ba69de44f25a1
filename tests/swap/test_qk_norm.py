"""QK-norms: ``swap_norms(model, target, qk_norm=...)`` and the attention-layer protocol.

Every covered family gets a QK-norm that trains (finite gradients, gradients on the new
weights); what cannot take one is reported with the reason; varying the QK-norm alone keeps the
body's norms; the MRS QK-norm makes attention blind to the scale of q
(docs/method.md#phase-preservation: MRSNorm is scale invariant), which fails without it; hooks
on ``q_norm`` see the per-head queries an independent computation from the projection weights
gives.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_mrs import MRSNorm, SwapOptions, iter_attention_layers, swap_norms

timm = pytest.importorskip("timm")
torchvision = pytest.importorskip("torchvision")
from timm.layers import Attention, AttentionPoolLatent, AttentionRope, SimPool2d  # noqa: E402
from timm.models import eva, gemma4_vit, vision_transformer_relpos, vision_transformer_sam  # noqa: E402
from timm.models import vision_transformer as tvit  # noqa: E402
from torchvision.models import maxvit, swin_transformer as swin  # noqa: E402
from helpers.models import tv_maxvit, tv_swin, tv_vit  # noqa: E402

VIT = dict(img_size=32, patch_size=8, embed_dim=16, depth=1, num_heads=2, num_classes=3)


def _vit(**kwargs) -> nn.Module:
    return timm.create_model("vit_tiny_patch16_224", **{**VIT, **kwargs})


class _Tokens(nn.Module):
    """A bare timm attention layer fed (B, N, C) tokens from a (B, C, H, W) input."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x.flatten(2).transpose(1, 2))  # (B, N, C)


# family -> (factory, input size, attention classes counted independently of the swap)
FAMILIES = {
    "vit": (lambda: _vit(), 32, Attention),
    "deit": (lambda: timm.create_model("deit_tiny_patch16_224", **VIT), 32, Attention),
    "deit3": (lambda: timm.create_model("deit3_small_patch16_224", **VIT), 32, Attention),
    "vit_map_pool": (lambda: _vit(global_pool="map"), 32, (Attention, AttentionPoolLatent)),
    "vit_diff": (lambda: _vit(attn_layer="diff"), 32, timm.layers.DiffAttention),
    "vit_parallel": (lambda: _vit(block_fn=tvit.ParallelScalingBlock), 32, tvit.ParallelScalingBlock),
    "vit_relpos": (lambda: timm.create_model("vit_relpos_small_patch16_224", **VIT), 32,
                   vision_transformer_relpos.RelPosAttention),
    "eva02": (lambda: timm.create_model("eva02_tiny_patch14_224", **{**VIT, "img_size": 28, "patch_size": 14}), 28,
              eva.EvaAttention),
    "samvit": (lambda: timm.create_model("samvit_base_patch16", **VIT, global_attn_indexes=(), window_size=0,
                                         neck_chans=8), 32, vision_transformer_sam.Attention),
    "pit": (lambda: timm.create_model("pit_ti_224", img_size=32, patch_size=4, stride=2, base_dims=[8, 8],
                                      depth=[1, 1], heads=[2, 4], num_classes=3), 32, Attention),
    "naflexvit": (lambda: timm.create_model("naflexvit_base_patch16_gap", **VIT), 32, Attention),
    "qwen3_vit": (lambda: timm.create_model("qwen3_vit_88m", **VIT), 32, AttentionRope),
    "deepseek_vit": (lambda: timm.create_model("deepseek_vit_412m", **VIT), 32, AttentionRope),
    "vit_diff_parallel": (lambda: _vit(block_fn=tvit.DiffParallelScalingBlock), 32, tvit.DiffParallelScalingBlock),
    "crossvit": (lambda: timm.create_model("crossvit_tiny_240", img_size=[32, 32], patch_size=[8, 16],
                                           embed_dim=[16, 32], depth=[[1, 1, 0]], num_heads=[2, 2], num_classes=3),
                 32, Attention),  # its CrossAttention fusion layers are reported as skipped
    "vit_hybrid": (lambda: timm.create_model("vit_tiny_r_s16_p8_224", img_size=32, embed_dim=16, depth=1,
                                             num_heads=2, num_classes=3), 32, Attention),
    "attention_rope": (lambda: _Tokens(AttentionRope(16, num_heads=2)), 4, AttentionRope),
    "simpool": (lambda: SimPool2d(16, num_heads=2), 4, SimPool2d),
    "tv_vit": (tv_vit, 32, nn.MultiheadAttention),
    "tv_swin": (tv_swin, 32, swin.ShiftedWindowAttention),
    "tv_swin_v2": (lambda: tv_swin(v2=True), 32, swin.ShiftedWindowAttentionV2),
    "tv_maxvit": (tv_maxvit, 32, maxvit.RelativePositionalMultiHeadAttention),
    "torch_encoder": (lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2,
                                                    enable_nested_tensor=False), 4, nn.MultiheadAttention),
}
SLOW_FAMILIES = {  # bigger builds (seconds each)
    "mobilevit": (lambda: timm.create_model("mobilevit_xxs", num_classes=3), 32, Attention),
    "gemma4_vit": (lambda: timm.create_model("gemma4_vit_167m", **VIT), 32, gemma4_vit.Gemma4Attention),  # RMS QK-norms
}


def _input(name: str, size: int) -> torch.Tensor:
    if name == "torch_encoder":
        return torch.randn(2, 5, 16)
    return torch.randn(2, 3 if size > 4 else 16, size, size)


def _first(out):
    return out if isinstance(out, torch.Tensor) else out[0]


def _no_zero_weights(model: nn.Module) -> nn.Module:
    """Zero-initialised heads (torchvision ViT) would zero every gradient and output."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and not p.any():
                p.normal_(0, 0.02)
    return model


def check_family(name: str, factory, size: int, classes) -> None:
    torch.manual_seed(0)
    model = _no_zero_weights(factory())
    layers = sum(isinstance(m, classes) for m in model.modules())
    assert layers > 0
    report = swap_norms(model, None, qk_norm="mrs")
    swapped = [n for n in report.converted if n.endswith(("q_norm", "k_norm"))]  # QK-norms it already had
    assert len(report.qk_added) + len(swapped) == 2 * layers, str(report)
    infos = list(iter_attention_layers(model))
    assert len(infos) >= layers and all(info.qk_norm == "mrs" for _, _, info in infos)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = _input(name, size)
    _first(model(x)).float().square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    for _, module, _ in infos:
        for norm in (module.q_norm, module.k_norm):
            assert isinstance(norm, MRSNorm) and norm.weight.grad is not None and norm.weight.grad.abs().sum() > 0
    opt.step()
    with torch.no_grad():
        assert torch.isfinite(_first(model(x))).all()


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_covered_family_gets_a_trainable_qk_norm(name):
    check_family(name, *FAMILIES[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW_FAMILIES))
def test_every_covered_family_gets_a_trainable_qk_norm_slow(name):
    check_family(name, *SLOW_FAMILIES[name])


def test_norm_swap_callback_takes_the_qk_options():
    from lightning_mrs.callbacks import NormSwap

    assert NormSwap(None, qk_norm="mrs", verbose=False).options == SwapOptions(None, qk_norm="mrs")
    with pytest.raises(ValueError, match="qk_norm"):
        NormSwap("mrs", qk_norm="yes")


def test_vary_the_qk_norm_alone_keeps_every_body_norm():
    model = _vit(depth=2)
    before = {name: m for name, m in model.named_modules()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    layer_norms = sum(isinstance(m, nn.LayerNorm) for m in model.modules())  # 2 per block + the final one
    report = swap_norms(model, target=None, qk_norm="rms")
    after = dict(model.named_modules())
    new = sorted(n for n, m in after.items() if before.get(n) is not m)
    assert new == [f"blocks.{i}.attn.{n}" for i in range(2) for n in ("k_norm", "q_norm")]
    assert all(isinstance(after[n], nn.RMSNorm) and after[n].normalized_shape == (8,) for n in new)
    assert set(after) == set(before)  # the Identity QK-norms were replaced; LayerNorms and all else untouched
    assert sum(isinstance(m, nn.LayerNorm) for m in model.modules()) == layer_norms == 5
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in state.items())
    assert not report.converted and len(report.qk_added) == 4
    # the next arm of the sweep swaps the existing QK-norms only
    report = swap_norms(model, target=None, qk_norm="mrs")
    assert sorted(report.converted) == new and not report.qk_added
    assert sum(isinstance(m, nn.LayerNorm) for m in model.modules()) == layer_norms == 5
    assert not swap_norms(model, None, qk_norm="mrs").converted  # a second time: nothing to do


def test_existing_qk_norms_follow_qk_norm_or_target():
    built = _vit(qk_norm=True)
    model = copy.deepcopy(built)
    report = swap_norms(model, "mrs", qk_norm="rms")  # body MRS, QK-norms RMS
    attn = model.blocks[0].attn
    assert isinstance(attn.q_norm, nn.RMSNorm) and isinstance(model.blocks[0].norm1, MRSNorm)
    assert report.changes["blocks.0.attn.q_norm"] == ("LayerNorm", "RMSNorm") and not report.qk_added
    model = copy.deepcopy(built)
    report = swap_norms(model, "mrs", qk_norm=False)  # body MRS, QK-norms left alone
    assert type(model.blocks[0].attn.q_norm) is type(built.blocks[0].attn.q_norm)  # timm's LayerNorm, kept
    assert isinstance(model.blocks[0].norm1, MRSNorm)
    assert report.skipped["blocks.0.attn.k_norm"] == "QK-norm left alone (qk_norm=False)"
    model = copy.deepcopy(built)
    swap_norms(model, "mrs")  # qk_norm=None: as before, QK-norms are norms like the others
    assert isinstance(model.blocks[0].attn.q_norm, MRSNorm)
    plain = _vit()
    assert not swap_norms(plain, "mrs").qk_added and isinstance(plain.blocks[0].attn.q_norm, nn.Identity)


@pytest.mark.parametrize("kind,cls", [("mrs", MRSNorm), ("rms", nn.RMSNorm), ("layer", nn.LayerNorm)])
def test_qk_norm_true_adds_the_targets_kind(kind, cls):
    model = tv_vit()
    report = swap_norms(model, kind, qk_norm=True)
    attn = model.encoder.layers[0].self_attention
    assert isinstance(attn.q_norm, cls) and isinstance(attn.k_norm, cls)
    assert report.attention_replaced == {"encoder.layers.encoder_layer_0.self_attention":
                                         ("MultiheadAttention", "QKMultiheadAttention")}
    assert "QK-norms added: 2 in 1 attention layer" in str(report)


def test_report_of_target_none_says_body_norms_are_kept():
    model = tv_vit()
    first = str(swap_norms(model, None, qk_norm="mrs")).splitlines()[0]
    assert first.endswith("0 converted, 0 skipped, 0 already mrs (QK-norms only; body norms kept)"), first
    again = str(swap_norms(model, None, qk_norm="mrs")).splitlines()[0]  # the QK-norms are now MRS
    assert again.endswith("0 converted, 0 skipped, 2 already mrs (QK-norms only; body norms kept)"), again


def test_odd_head_dim_is_skipped_with_the_reason():
    model = _vit(embed_dim=30)  # 2 heads of 15
    report = swap_norms(model, None, qk_norm="mrs")
    assert "odd head_dim 15" in report.attention_skipped["blocks.0.attn"] and not report.qk_added
    assert isinstance(model.blocks[0].attn.q_norm, nn.Identity)
    assert "odd head_dim 15" in str(report)
    with pytest.raises(ValueError, match="odd head_dim 15"):
        swap_norms(model, "mrs", qk_norm=True, strict=True)
    assert isinstance(model.blocks[0].norm1, nn.LayerNorm)  # strict: nothing changed
    swap_norms(model, None, qk_norm="rms")
    assert isinstance(model.blocks[0].attn.q_norm, nn.RMSNorm)


def test_opaque_attention_and_no_attention_are_reported():
    cnn = torchvision.models.resnet18()
    report = swap_norms(cnn, None, qk_norm="mrs")
    assert "no attention layers" in str(report) and not report.qk_added and not report.attention_skipped
    assert isinstance(cnn.bn1, nn.BatchNorm2d)
    beit = timm.create_model("beit_base_patch16_224", **VIT)
    report = swap_norms(beit, None, qk_norm="mrs")
    assert "cannot see into" in report.attention_skipped["blocks.0.attn"] and not report.qk_added
    assert "cannot see into" in str(report)
    with pytest.raises(ValueError, match="blocks.0.attn"):
        swap_norms(beit, None, qk_norm="mrs", strict=True)
    report = swap_norms(nn.Linear(2, 2), target=None)  # asks for nothing: a no-op that says so
    assert "ask for nothing" in str(report)


def test_include_exclude_select_attention_layers():
    model = _vit(depth=2)
    report = swap_norms(model, None, qk_norm="mrs", exclude="blocks.1")
    assert sorted(report.qk_added) == ["blocks.0.attn.k_norm", "blocks.0.attn.q_norm"]
    assert report.attention_skipped["blocks.1.attn"] == "excluded by exclude='blocks.1'"
    report = swap_norms(model, None, qk_norm="mrs", include="blocks.1.*", strict=True)  # user choices never raise
    assert sorted(report.qk_added) == ["blocks.1.attn.k_norm", "blocks.1.attn.q_norm"]


def _logits_hooked(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Every attention layer's q and k as its q_norm/k_norm output them (the protocol)."""
    seen: list[torch.Tensor] = []
    handles = [n.register_forward_hook(lambda m, a, out: seen.append(out))
               for _, module, _ in iter_attention_layers(model) for n in (module.q_norm, module.k_norm)]
    model(x)
    for h in handles:
        h.remove()
    return seen


@pytest.mark.parametrize("factory", [lambda: _vit(), lambda: tv_vit(num_classes=1000)],
                         ids=["timm_vit", "tv_vit"])
@pytest.mark.parametrize("factor", [1e2, 1e4])
def test_mrs_qk_norm_makes_attention_blind_to_the_scale_of_q(factory, factor):
    """MRSNorm(a q) == MRSNorm(q): scaling the query projection changes nothing with the QK-norm,
    and changes the output without it."""
    torch.manual_seed(0)
    model = _no_zero_weights(factory()).double().eval()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)

    def scaled_output(m: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        attn = next(mod for mod in m.modules() if isinstance(mod, (Attention, nn.MultiheadAttention)))
        weight = attn.qkv.weight if isinstance(attn, Attention) else attn.in_proj_weight
        bias = attn.qkv.bias if isinstance(attn, Attention) else attn.in_proj_bias
        with torch.no_grad():
            before = m(x)
            dim = weight.shape[1]
            weight[:dim].mul_(factor)
            bias[:dim].mul_(factor)
            return before, m(x)

    plain = copy.deepcopy(model)
    swap_norms(model, None, qk_norm="mrs")
    for module in model.modules():
        if isinstance(module, MRSNorm):
            module.eps = 1e-12  # scale invariance is exact up to eps
    before, after = scaled_output(model)
    torch.testing.assert_close(after, before, atol=1e-6, rtol=1e-6)
    before, after = scaled_output(plain)
    assert not torch.allclose(after, before, atol=1e-3)


def test_qk_norm_bounds_every_logit():
    """|q_hat . k_hat| <= max(g)^2 P^2 (docs/method.md#phasor-attention-qk-norm: sum_i r_i / S = P),
    however large q and k."""
    model = _vit()
    swap_norms(model, None, qk_norm="mrs")
    with torch.no_grad():
        model.blocks[0].attn.qkv.weight.mul_(1e3)
    q, k = _logits_hooked(model, torch.randn(2, 3, 32, 32) * 100)
    logits = q @ k.transpose(-2, -1)  # (B, heads, N, N)
    P = q.shape[-1] // 2
    assert logits.abs().max() <= P**2 * (1 + 1e-5)
    assert q.abs().max() <= P  # each phasor's share of the mean


def test_hooks_see_per_head_queries_and_the_info_is_right():
    """q_norm's input equals q computed independently from the qkv weights, per head."""
    model = _vit(embed_dim=24, num_heads=3)
    (name, attn, info), = list(iter_attention_layers(model))
    assert (name, info.num_heads, info.head_dim, info.qk_norm, info.layout) == ("blocks.0.attn", 3, 8, None, "BHND")
    assert info.scale == pytest.approx(8**-0.5)
    seen, tokens = [], []
    attn.q_norm.register_forward_hook(lambda m, a, out: seen.append(a[0]))
    model.blocks[0].norm1.register_forward_hook(lambda m, a, out: tokens.append(out))
    model(torch.randn(2, 3, 32, 32))
    x = tokens[0]  # (B, N, C)
    q = (x @ attn.qkv.weight[:24].T + attn.qkv.bias[:24]).unflatten(-1, (3, 8)).transpose(1, 2)  # (B, H, N, D)
    torch.testing.assert_close(seen[0], q)


def test_swapped_state_dict_loads_into_a_fresh_model_swapped_alike(tmp_path):
    """What a checkpoint needs: the same options on a fresh model give the same keys; the
    rebuilt torchvision attention pickles (torch.save of the whole model)."""
    def build() -> nn.Module:
        model = tv_vit()
        swap_norms(model, "rms", qk_norm="mrs")
        return model

    model = build()
    with torch.no_grad():
        model.encoder.layers[0].self_attention.q_norm.weight.uniform_(0.5, 2.0)
    fresh = build()
    fresh.load_state_dict(model.state_dict())  # strict: same keys and shapes
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(fresh.eval()(x), model.eval()(x))
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    torch.testing.assert_close(loaded(x), model(x))
