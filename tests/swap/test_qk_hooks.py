"""QK-norms on transformers attention compose with whatever wraps the projections.

The norm is applied to the projection's output by a hook that follows the module at the
projection's attribute (:mod:`lightning_mrs.swap.qk_hooks`): PEFT's LoRA adapts the projection
*before* the norm (``merge_and_unload`` leaves the logits as they were), accelerate's hooked
forwards keep it, copies and pickles keep it on their own norms, and Phi's own
``q_layernorm``/``k_layernorm`` are swapped in place, never doubled.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from helpers.hf import tiny_causal_lm, token_batch
from lightning_mrs import MRSNorm, iter_attention_layers, swap_norms
from lightning_mrs.swap.qk_hooks import ProjectionNorm, qk_state

peft = pytest.importorskip("peft")


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(token_batch()).logits


def _scaled_norms_change_the_logits(model: nn.Module, layers) -> bool:
    before = _logits(model)
    with torch.no_grad():
        for attn in layers:
            attn.q_norm.weight.mul_(3.0)
    return not torch.allclose(_logits(model), before, atol=1e-4)


@pytest.mark.parametrize("targets", [["q_proj", "k_proj"], None], ids=["q_k", "peft-default"])
@pytest.mark.parametrize("qk_norm", ["rms", "mrs"])
def test_lora_adapts_the_projection_before_the_norm(targets, qk_norm):
    model = tiny_causal_lm("llama")
    swap_norms(model, None, qk_norm=qk_norm)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets, init_lora_weights=False))
    adapted = _logits(lora)
    attn = lora.base_model.model.model.layers[0].self_attn
    assert any(isinstance(h, ProjectionNorm) for h in attn.q_proj._forward_hooks.values())  # on the lora.Linear
    assert not attn.q_proj.base_layer._forward_hooks  # not on the layer it wraps
    merged = lora.merge_and_unload()
    assert type(merged.model.layers[0].self_attn.q_proj) is nn.Linear
    torch.testing.assert_close(_logits(merged), adapted, atol=1e-5, rtol=1e-5)
    # the reference: the norm of the merged projection's output, per head, by hand
    attn = merged.model.layers[0].self_attn
    h = torch.randn(2, 5, 32)
    q = attn.q_norm((h @ attn.q_proj.weight.T).unflatten(-1, (4, 8))).flatten(-2)
    torch.testing.assert_close(attn.q_proj(h), q)


def test_lora_before_the_swap_is_normed_too():
    model = tiny_causal_lm("llama")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj"], init_lora_weights=False))
    report = swap_norms(lora, None, qk_norm="mrs")
    assert len(report.qk_added) == 4
    adapted = _logits(lora)
    torch.testing.assert_close(_logits(lora.merge_and_unload()), adapted, atol=1e-5, rtol=1e-5)


def test_a_projection_replaced_by_setattr_takes_the_norm_at_once():
    model = tiny_causal_lm("llama")
    swap_norms(model, None, qk_norm="rms")
    attn = model.model.layers[0].self_attn
    old = attn.q_proj
    attn.q_proj = copy.deepcopy(old)  # what PEFT and quantizers do
    assert not old._forward_hooks and any(isinstance(h, ProjectionNorm) for h in attn.q_proj._forward_hooks.values())
    attn._modules["k_proj"] = copy.deepcopy(attn.k_proj)  # written into _modules: the pre-hook moves it at the forward
    before = _logits(model)
    assert qk_state(attn).hooked["k_proj"] is attn.k_proj
    with torch.no_grad():
        attn.k_norm.weight.mul_(2.0)
    assert not torch.allclose(_logits(model), before)


def test_copies_and_pickles_keep_their_own_norms():
    model = tiny_causal_lm("llama")
    swap_norms(model, "mrs", qk_norm="mrs")
    expected = _logits(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for twin in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        torch.testing.assert_close(_logits(twin), expected, atol=0, rtol=0)
        layers = [twin.model.layers[i].self_attn for i in range(2)]
        assert _scaled_norms_change_the_logits(twin, layers)
        torch.testing.assert_close(_logits(model), expected, atol=0, rtol=0)  # the original untouched


def test_accelerate_hooks_keep_the_swap_and_the_qk_norms():
    accelerate = pytest.importorskip("accelerate.hooks")
    plain = tiny_causal_lm("llama")
    swap_norms(plain, "rms", qk_norm="mrs")
    model = tiny_causal_lm("llama")
    accelerate.attach_execution_device_hook(model.model.layers[0], "cpu")
    report = swap_norms(model, "rms", qk_norm="mrs")
    assert len(report.converted) == 5 and len(report.qk_added) == 4 and not report.skipped
    for layer in model.model.layers:
        assert type(layer.input_layernorm) is nn.RMSNorm and type(layer.post_attention_layernorm) is nn.RMSNorm
    torch.testing.assert_close(_logits(model), _logits(plain), atol=1e-6, rtol=1e-6)
    assert _scaled_norms_change_the_logits(model, [model.model.layers[0].self_attn])
    assert "_hf_hook" in vars(model.model.layers[0].input_layernorm)  # the device hook moved to the new layer


def test_accelerate_offloaded_norms_are_refused_with_the_reason():
    accelerate = pytest.importorskip("accelerate")
    model = tiny_causal_lm("llama")
    accelerate.cpu_offload(model, execution_device="cpu")  # every weight kept aside, loaded per forward
    with pytest.warns(UserWarning, match="converted none"):
        report = swap_norms(model, "mrs")
    assert report.skipped and all("accelerate offloads its weights" in r for r in report.skipped.values())
    with pytest.raises(ValueError, match="accelerate offloads"):
        swap_norms(model, "mrs", strict=True)


def test_torchvision_attention_under_accelerate_is_refused_not_copied():
    accelerate = pytest.importorskip("accelerate.hooks")
    model = nn.Sequential(nn.TransformerEncoderLayer(8, 2, batch_first=True))
    accelerate.attach_execution_device_hook(model, "cpu")
    report = swap_norms(model, None, qk_norm="mrs")
    assert "accelerate hooks this MultiheadAttention" in report.attention_skipped["0.self_attn"]


def test_phi_own_qk_layernorms_are_swapped_in_place():
    model = tiny_causal_lm("phi", qk_layernorm=True)
    report = swap_norms(model, "mrs", qk_norm="mrs")
    assert not report.qk_added and not report.attention_skipped
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        assert isinstance(attn.q_layernorm, MRSNorm) and isinstance(attn.k_layernorm, MRSNorm)
        assert not hasattr(attn, "q_norm") and qk_state(attn) is None  # never a second QK-norm
        assert report.changes[f"model.layers.{i}.self_attn.q_layernorm"] == ("LayerNorm", "MRSNorm")
    infos = [info for _, _, info in iter_attention_layers(model)]
    assert [i.qk_attrs for i in infos] == [("q_layernorm", "k_layernorm")] * 2 and infos[0].qk_norm == "mrs"
    before = _logits(model)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_layernorm.weight.mul_(3.0)
    assert not torch.allclose(_logits(model), before, atol=1e-4)
