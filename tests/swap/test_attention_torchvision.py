"""The torch/torchvision attention rebuilds (``lightning_mrs.swap.attention_torchvision``).

Before a QK-norm is added each rebuild must be the original module: the same parameter
objects and state-dict keys, and the same output as the original (torch's own module, the
independent reference) on random inputs in float64, with and without masks; ``q_norm`` and
``k_norm`` must see the per-head queries and keys the original computes.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_mrs import MRSNorm, expose_attention, iter_attention_layers, swap_norms

torchvision = pytest.importorskip("torchvision")
from torchvision.models import maxvit, swin_transformer as swin  # noqa: E402
from helpers.models import tv_maxvit, tv_swin, tv_vit  # noqa: E402

from lightning_mrs.swap.attention_torchvision import (  # noqa: E402
    QKMultiheadAttention,
    QKRelativePositionalMultiHeadAttention,
    QKShiftedWindowAttention,
    QKShiftedWindowAttentionV2,
)

TOL = dict(atol=1e-12, rtol=1e-10)  # float64: only the order of the sums may differ


def _same_module(old: nn.Module, new: nn.Module) -> None:
    """Same parameter/buffer objects under the same names; only q_norm/k_norm are new."""
    old_state = dict(old.named_parameters()) | dict(old.named_buffers())
    new_state = dict(new.named_parameters()) | dict(new.named_buffers())
    assert new_state.keys() == old_state.keys()
    assert all(new_state[k] is old_state[k] for k in old_state)
    assert set(new.state_dict()) == set(old.state_dict())
    assert isinstance(new, type(old)) and isinstance(new.q_norm, nn.Identity)


def _mha_case(batch_first: bool, kdim: int, bias: bool):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(12, 3, bias=bias, kdim=kdim, vdim=kdim, batch_first=batch_first).double()
    with torch.no_grad():  # non-zero biases, so the bias split is checked too
        for p in mha.parameters():
            p.normal_(0, 0.3)
    return mha, QKMultiheadAttention.from_module(mha)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("kdim,bias", [(12, True), (7, False)])
@pytest.mark.parametrize("mask", ["none", "bool2d", "float3d", "padding", "both", "causal"])
@pytest.mark.parametrize("need_weights,average", [(False, True), (True, True), (True, False)])
def test_multihead_attention_matches_torch(batch_first, kdim, bias, mask, need_weights, average):
    mha, qk = _mha_case(batch_first, kdim, bias)
    _same_module(mha, qk)
    B, L, S = 2, 5, 5 if mask == "causal" else 6
    q, k = torch.randn(B, L, 12, dtype=torch.float64), torch.randn(B, S, kdim, dtype=torch.float64)
    v = torch.randn(B, S, kdim, dtype=torch.float64)
    if not batch_first:
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    kwargs = dict(need_weights=need_weights, average_attn_weights=average)
    if mask in ("bool2d", "both"):
        kwargs["attn_mask"] = torch.rand(L, S) < 0.3
        kwargs["attn_mask"][:, 0] = False  # no fully masked row (NaN in both)
    if mask == "float3d":
        kwargs["attn_mask"] = torch.randn(B * 3, L, S, dtype=torch.float64)
    if mask in ("padding", "both"):
        kwargs["key_padding_mask"] = torch.tensor([[False] * S, [False] * (S - 2) + [True] * 2])
    if mask == "causal":
        kwargs.update(attn_mask=nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.float64), is_causal=True)
    want, want_w = mha(q, k, v, **kwargs)
    got, got_w = qk(q, k, v, **kwargs)
    torch.testing.assert_close(got, want, **TOL)
    if need_weights:
        torch.testing.assert_close(got_w, want_w, **TOL)
    else:
        assert got_w is None and want_w is None


def test_multihead_attention_unbatched_gradients_and_errors():
    mha, qk = _mha_case(True, 12, True)
    x = torch.randn(4, 12, dtype=torch.float64, requires_grad=True)  # unbatched (L, E)
    want, want_w = mha(x, x, x, average_attn_weights=False)
    got, got_w = qk(x, x, x, average_attn_weights=False)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got_w, want_w, **TOL)  # (heads, L, S)
    g_want = torch.autograd.grad(want.sum(), [x, mha.in_proj_weight])
    g_got = torch.autograd.grad(got.sum(), [x, qk.in_proj_weight])
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, **TOL)
    with pytest.raises(RuntimeError, match="attn_mask"):
        qk(x, x, x, is_causal=True)
    odd = nn.MultiheadAttention(8, 2, add_bias_kv=True)
    assert "bias_k" in QKMultiheadAttention.unsupported(odd)
    report = swap_norms(nn.Sequential(odd), None, qk_norm="mrs")
    assert "bias_k" in report.attention_skipped["0"] and not report.qk_added


def test_constructed_directly_like_multihead_attention():
    torch.manual_seed(1)
    qk = QKMultiheadAttention(8, 2, batch_first=True).double()
    mha = nn.MultiheadAttention(8, 2, batch_first=True).double()
    mha.load_state_dict(qk.state_dict())  # same keys, so the weights load across
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    torch.testing.assert_close(qk(x, x, x)[0], mha(x, x, x)[0], **TOL)


def _window_input(shape):
    return torch.randn(*shape, dtype=torch.float64)


@pytest.mark.parametrize("cls,qk_cls", [(swin.ShiftedWindowAttention, QKShiftedWindowAttention),
                                        (swin.ShiftedWindowAttentionV2, QKShiftedWindowAttentionV2)])
@pytest.mark.parametrize("shift,shape", [([0, 0], (2, 8, 8, 12)), ([2, 2], (2, 8, 8, 12)), ([2, 1], (1, 7, 9, 12)),
                                         ([2, 2], (2, 3, 3, 12))])
def test_swin_window_attention_matches_torchvision(cls, qk_cls, shift, shape):
    torch.manual_seed(0)
    old = cls(12, [4, 4], shift, 3).double()
    with torch.no_grad():
        old.qkv.bias.normal_(0, 0.3)  # V2 must still ignore the key bias
    new = qk_cls.from_module(old)
    _same_module(old, new)
    x = _window_input(shape)
    torch.testing.assert_close(new(x), old(x), **TOL)
    assert new.head_dim == 4 and (new.scale == 0.5 if qk_cls is QKShiftedWindowAttention else new.scale is None)


def test_maxvit_attention_matches_torchvision():
    torch.manual_seed(0)
    old = maxvit.RelativePositionalMultiHeadAttention(12, 4, 16).double()
    new = QKRelativePositionalMultiHeadAttention.from_module(old)
    _same_module(old, new)
    x = _window_input((2, 3, 16, 12))  # (B, groups, P, C)
    torch.testing.assert_close(new(x), old(x), **TOL)
    assert (new.num_heads, new.head_dim, new.scale) == (3, 4, 12**-0.5)


def _tv_models():
    return {
        "vit": (tv_vit, 1),
        "swin": (tv_swin, 2),
        "swin_v2": (lambda: tv_swin(v2=True), 2),
        "maxvit": (tv_maxvit, 2),
    }


@pytest.mark.parametrize("name", ["vit", "swin", "swin_v2", "maxvit"])
def test_exposed_models_keep_their_output_and_show_q_and_k(name):
    factory, layers = _tv_models()[name]
    torch.manual_seed(0)
    model = factory().double().eval()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        want = model(x)
        exposed = copy.deepcopy(model)
        assert len(expose_attention(exposed)) == layers
        seen = []
        for _, module, info in iter_attention_layers(exposed):
            module.q_norm.register_forward_hook(lambda m, args, out, info=info: seen.append((args[0].shape, info)))
        torch.testing.assert_close(exposed(x), want, **TOL)
    assert len(seen) == layers
    for shape, info in seen:  # (B*windows, heads, tokens, head_dim)
        assert shape[1] == info.num_heads and shape[-1] == info.head_dim and info.qk_norm is None


def test_encoder_layer_fast_path_cannot_skip_the_qk_norm():
    """nn.TransformerEncoderLayer's fused inference path reads in_proj_weight itself; with a
    QK-norm it must run the rebuilt module (eval + no_grad gives the same as with grad)."""
    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), 2,
                                  enable_nested_tensor=False).eval()
    swap_norms(model, None, qk_norm="mrs")
    assert isinstance(model.layers[0].self_attn.q_norm, MRSNorm)
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 2.0)
    x = torch.randn(2, 5, 8) * 10
    with torch.no_grad():
        fast = model(x)
    torch.testing.assert_close(fast, model(x), atol=1e-5, rtol=1e-5)
