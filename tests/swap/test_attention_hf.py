"""QK-norms on Hugging Face transformers attention (tiny models built from configs).

The rewiring alone (``expose_attention``: wrapped q/k projections, Identity norms) leaves the
logits equal to the original's in float64; an added MRS QK-norm normalises each head on its
own (scaling one head's query or key rows leaves the model unchanged, which fails without it,
and fails if the norm spanned several heads); the hooks on ``q_norm`` see the per-head queries
an independent computation from the projection weights gives; a step trains the new weights;
what cannot take a QK-norm is reported.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from helpers.hf_attention import ADDS, NATIVE, tiny_lm, tokens
from lightning_mrs import MRSNorm, OffsetRMSNorm, expose_attention, iter_attention_layers, swap_norms
from lightning_mrs.swap.spec import describe_layers, rebuild

transformers = pytest.importorskip("transformers")


def _attention(model: nn.Module) -> dict[str, nn.Module]:
    """The attention layers, found independently of the swap (by class name)."""
    return {n: m for n, m in model.named_modules() if type(m).__name__.endswith("Attention")}


def _q_rows(family: str, attn: nn.Module, head: int, role: str = "q") -> list[tuple[torch.Tensor, object]]:
    """(parameter, index) of the output rows that make query (or key) head ``head`` of ``attn``,
    as each family's forward splits its projection (read off transformers' code)."""
    d = 16
    if family == "gpt2":  # Conv1D weight (in, 3C): [q | k | v] columns
        c = attn.c_attn.nf // 3
        cols = slice((role == "k") * c + head * d, (role == "k") * c + (head + 1) * d)
        return [(attn.c_attn.weight, (slice(None), cols)), (attn.c_attn.bias, cols)]
    if family == "gpt_neox":  # rows (H, 3, D) per head
        rows = slice(head * 3 * d + (role == "k") * d, head * 3 * d + ((role == "k") + 1) * d)
        return [(attn.query_key_value.weight, rows), (attn.query_key_value.bias, rows)]
    if family == "phi3":  # rows [q (4 heads) | k (2) | v (2)]
        start = (role == "k") * 4 * d + head * d
        return [(attn.qkv_proj.weight, slice(start, start + d))]
    proj = attn.q_proj if role == "q" else attn.k_proj
    return [(p, slice(head * d, (head + 1) * d)) for p in (proj.weight, proj.bias) if p is not None]


def _scale_head(family: str, model: nn.Module, factor: float, role: str) -> None:
    with torch.no_grad():
        for attn in _attention(model).values():
            for param, index in _q_rows(family, attn, head=1, role=role):
                param[index] *= factor


@pytest.mark.parametrize("family", ADDS)
def test_rewired_model_equals_the_original_in_float64(family: str) -> None:
    model = tiny_lm(family, torch.float64).eval()
    x = tokens()
    keys = list(model.state_dict())
    with torch.no_grad():
        ref = model(x).logits
    names = expose_attention(model)
    assert names == list(_attention(model))  # every layer, none missed
    assert list(model.state_dict()) == keys  # the wrapped projections keep their keys
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, ref, atol=1e-12, rtol=0)
    assert [(i.head_dim, i.qk_norm, i.layout) for _, _, i in iter_attention_layers(model)] == [(16, None, "BNHD")] * 2


@pytest.mark.parametrize("family", ADDS)
def test_mrs_qk_norm_normalises_each_head_on_its_own(family: str) -> None:
    x = tokens()
    model = tiny_lm(family, torch.float64).eval()
    report = swap_norms(model, None, qk_norm="mrs", eps=1e-12)
    layers = list(_attention(model))
    assert sorted(report.qk_added) == sorted(f"{n}.{a}" for n in layers for a in ("q_norm", "k_norm"))
    assert set(report.attention_replaced) == set(layers) and not report.attention_skipped
    assert all(isinstance(m, MRSNorm) and m.num_channels == 16 for n, m in model.named_modules()
               if n.endswith(("q_norm", "k_norm")))
    with torch.no_grad():
        ref = model(x).logits
        for role in ("q", "k"):  # MRSNorm is scale invariant: one head's scale no longer matters
            scaled = copy.deepcopy(model)
            _scale_head(family, scaled, 7.0, role)
            torch.testing.assert_close(scaled(x).logits, ref, atol=1e-9, rtol=1e-9)
        plain = tiny_lm(family, torch.float64).eval()  # without the QK-norm it does
        before = plain(x).logits
        _scale_head(family, plain, 7.0, "q")
        assert (plain(x).logits - before).abs().max() > 1e-3


@pytest.mark.parametrize("family", ADDS)
@pytest.mark.parametrize("qk_norm", [True, "mrs", "rms", "layer"])
def test_added_qk_norm_trains_a_step(family: str, qk_norm) -> None:
    model = tiny_lm(family).train()
    report = swap_norms(model, "mrs", qk_norm=qk_norm)
    kind = {"mrs": "MRSNorm", "rms": "RMSNorm", "layer": "LayerNorm", True: "MRSNorm"}[qk_norm]
    assert set(report.qk_added.values()) == {f"{kind}(16)"} and len(report.qk_added) == 4
    ids = tokens()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    new = [p for n, p in model.named_parameters() if ".q_norm." in n or ".k_norm." in n]
    assert len(new) == 4 * (2 if qk_norm == "layer" else 1) and all(p.grad.abs().sum() > 0 for p in new)
    before = [p.detach().clone() for p in new]
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert all(not torch.equal(b, p) for b, p in zip(before, new))  # the optimizer owns the new weights


def test_hooks_on_q_norm_see_the_per_head_queries_from_the_weights() -> None:
    model = tiny_lm("llama", torch.float64).eval()
    swap_norms(model, None, qk_norm="mrs")
    attn = model.model.layers[0].self_attn
    seen, inputs = {}, {}
    attn.q_norm.register_forward_hook(lambda m, a, out: seen.update(q_in=a[0]))
    attn.register_forward_pre_hook(lambda m, a, kw: inputs.update(h=kw["hidden_states"]), with_kwargs=True)
    with torch.no_grad():
        model(tokens())
    expected = (inputs["h"] @ attn.q_proj.weight.T).unflatten(-1, (4, 16))  # (B, N, H, D)
    torch.testing.assert_close(seen["q_in"], expected, atol=1e-12, rtol=0)


def test_copies_pickles_and_rebuilds_keep_the_wiring() -> None:
    x = tokens()
    model = tiny_lm("qwen2", torch.float64).eval()
    swap_norms(model, None, qk_norm="mrs")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "_norm." in n:
                p.uniform_(0.5, 2.0)
        ref = model(x).logits
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.model.layers[0].self_attn.q_norm.weight.mul_(3.0)  # the copy's norm, not the original's
        torch.testing.assert_close(model(x).logits, ref, atol=0, rtol=0)
        assert (twin(x).logits - ref).abs().max() > 1e-6
        torch.testing.assert_close(pickle.loads(pickle.dumps(model))(x).logits, ref, atol=0, rtol=0)
    fresh = tiny_lm("qwen2", torch.float64).eval()
    rebuild(fresh, None, describe_layers(model, None))  # what NormSwap.restore does
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(fresh(x).logits, ref, atol=0, rtol=0)


def test_odd_head_dim_is_skipped_for_mrs_with_the_reason() -> None:
    model = tiny_lm("gpt2", hidden_size=60)  # head_dim 15
    report = swap_norms(model, None, qk_norm="mrs")
    assert not report.qk_added
    assert set(report.attention_skipped) == {"transformer.h.0.attn", "transformer.h.1.attn"}
    reasons = set(report.attention_skipped.values())
    assert len(reasons) == 1 and reasons.pop().startswith("odd head_dim 15: MRSNorm pairs adjacent channels")
    with pytest.raises(ValueError, match=r"transformer.h.0.attn \(GPT2Attention\): odd head_dim 15"):
        swap_norms(tiny_lm("gpt2", hidden_size=60), None, qk_norm="mrs", strict=True)
    assert len(swap_norms(model, None, qk_norm="rms").qk_added) == 4  # RMSNorm needs no pairs


def test_unreachable_attention_is_listed_never_ignored() -> None:
    model = tiny_lm("gpt2", add_cross_attention=True)
    report = swap_norms(model, None, qk_norm="mrs")
    assert len(report.qk_added) == 4  # the self-attention
    assert set(report.attention_skipped) == {"transformer.h.0.crossattention", "transformer.h.1.crossattention"}
    assert "GPT-2 cross-attention" in report.attention_skipped["transformer.h.0.crossattention"]
    assert "attention layers without a QK-norm (2):" in str(report)


def test_a_family_outside_the_tested_list_gets_the_generic_rule_and_a_note() -> None:
    model = tiny_lm("olmo", torch.float64).eval()  # OLMo 1: Llama-like, not in the tested list
    report = swap_norms(model, None, qk_norm="mrs", eps=1e-12)
    assert len(report.qk_added) == 4
    assert any("OlmoAttention: QK-norms added by the generic q_proj/k_proj rule" in n for n in report.notes)
    x = tokens()
    with torch.no_grad():
        ref = model(x).logits
        _scale_head("olmo", model, 5.0, "k")
        torch.testing.assert_close(model(x).logits, ref, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("family", NATIVE)
def test_native_qk_norms_are_found_with_their_layout(family: str) -> None:
    model = tiny_lm(family)
    layers = list(iter_attention_layers(model))
    layout = {"qwen3": "BNHD", "gemma3_text": "BHND", "olmo2": "BN(HD)"}[family]
    assert [(n, i.layout, i.num_heads, i.head_dim) for n, _, i in layers] == [
        (f"model.layers.{i}.self_attn", layout, 4, 16) for i in range(2)]
    shapes = []
    layers[0][1].q_norm.register_forward_hook(lambda m, a, out: shapes.append(tuple(out.shape)))
    model(tokens(2, 7))
    assert shapes == [{"BNHD": (2, 7, 4, 16), "BHND": (2, 4, 7, 16), "BN(HD)": (2, 7, 64)}[layout]]


@pytest.mark.parametrize("family", NATIVE)
@pytest.mark.parametrize("qk_norm", ["rms", "layer"])
def test_native_qk_norms_swapped_to_a_baseline_keep_the_logits(family: str, qk_norm: str) -> None:
    """rms: the same formula, so the same logits (Gemma 3's 1 + w folded into the weight); layer:
    another formula, so the kinds and widths only."""
    model = tiny_lm(family).eval()
    x = tokens()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "_norm." in n:
                p.add_(0.1 * torch.randn_like(p))  # off the init, so an offset matters
        ref = model(x).logits
    report = swap_norms(model, None, qk_norm=qk_norm)
    names = sorted(f"model.layers.{i}.self_attn.{a}" for i in range(2) for a in ("q_norm", "k_norm"))
    assert sorted(report.converted) == names and not report.qk_added and not report.attention_skipped
    width = 64 if family == "olmo2" else 16  # OLMo 2: the whole projection (4 heads x 16), its k_norm 2 x 16
    # Gemma 3's QK-norms store 1 + w's offset: an rms swap keeps that convention (OffsetRMSNorm)
    kind = {"rms": OffsetRMSNorm if family == "gemma3_text" else nn.RMSNorm, "layer": nn.LayerNorm}[qk_norm]
    for name in names:
        norm = model.get_submodule(name)
        assert isinstance(norm, kind)
        assert norm.normalized_shape == ((width if name.endswith("q_norm") or family != "olmo2" else 32),)
    if qk_norm == "rms":
        with torch.no_grad():
            torch.testing.assert_close(model(x).logits, ref, atol=1e-5, rtol=1e-5)
    assert any("OLMo 2" in n for n in report.notes) == (family == "olmo2")


@pytest.mark.parametrize("family", NATIVE)
@pytest.mark.parametrize("qk_norm", [True, "mrs"])
def test_native_qk_norms_swapped_to_mrs_train_a_step(family: str, qk_norm) -> None:
    model = tiny_lm(family).train()
    report = swap_norms(model, "mrs", qk_norm=qk_norm)
    qk = [n for n in report.converted if n.endswith(("q_norm", "k_norm"))]
    assert len(qk) == 4 and all(isinstance(model.get_submodule(n), MRSNorm) for n in qk)
    assert [i.qk_norm for _, _, i in iter_attention_layers(model)] == ["mrs", "mrs"]
    ids = tokens()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(model.get_submodule(n).weight.grad.abs().sum() > 0 for n in qk)


def test_qk_norm_false_leaves_native_qk_norms_alone() -> None:
    model = tiny_lm("qwen3")
    report = swap_norms(model, "mrs", qk_norm=False)
    assert type(model.model.layers[0].self_attn.q_norm).__name__ == "Qwen3RMSNorm"
    assert report.skipped["model.layers.0.self_attn.q_norm"] == "QK-norm left alone (qk_norm=False)"
    assert isinstance(model.model.layers[0].input_layernorm, MRSNorm)
