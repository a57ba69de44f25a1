"""A swapped transformers model loads, initialises and saves as its transformers class does, not as
custom code: transformers' checkpoint conversions (a mixture of experts' fused tensors) and a parent
model's ``_init_weights`` filling its children's non-persistent buffers (FalconH1's ``mup_vector``)
apply to ``LightningMRS<Base>`` exactly as to the unswapped family, and a family that shares
another's model class (``exaone``: ``LlamaForCausalLM``) loads its own config class, so a reload is bit for bit.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors import safe_open

from helpers.hf import tiny_causal_lm, token_batch, transformers
from lightning_mrs import from_pretrained, swap_norms
from lightning_mrs.swap.hf_format import swapped_class


@pytest.fixture(autouse=True)
def _quiet_transformers():
    transformers.logging.set_verbosity_error()


def _keys(path) -> set[str]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return set(f.keys())


def _swapped(model_type: str) -> torch.nn.Module:
    model = tiny_causal_lm(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        swap_norms(model, "mrs", qk_norm="mrs", eps=1e-6)
    return model


@pytest.mark.parametrize("model_type", ["flex_olmo", "exaone"])  # fused experts; Llama's class, its own config
def test_a_swapped_model_saves_in_its_familys_checkpoint_format_and_reloads_bit_for_bit(tmp_path, model_type):
    plain = tiny_causal_lm(model_type)
    plain.save_pretrained(tmp_path / "plain")
    model = _swapped(model_type)
    model.save_pretrained(tmp_path / "swapped")
    # transformers' own save of the family reverts its conversion (per-expert keys, exaone's legacy names)
    saved, family = _keys(tmp_path / "swapped"), _keys(tmp_path / "plain")
    assert family <= saved and all(k.split(".")[-2] in ("q_norm", "k_norm") for k in saved - family)
    again = from_pretrained(tmp_path / "swapped", attn_implementation="eager")
    assert again.config.model_type == plain.config.model_type == model_type  # the family's config in memory
    assert type(again.config) is type(plain.config)
    for name, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    tokens = token_batch()
    with torch.no_grad():
        assert torch.equal(again.eval()(tokens).logits, model.eval()(tokens).logits)


def test_a_buffer_its_family_fills_from_the_parent_model_reloads(tmp_path):
    model = _swapped("falcon_h1")
    model.save_pretrained(tmp_path)
    plain_dir = tmp_path / "plain"
    tiny_causal_lm("falcon_h1").save_pretrained(plain_dir)
    reference = transformers.AutoModelForCausalLM.from_pretrained(plain_dir)  # the family's own load
    again = from_pretrained(tmp_path, attn_implementation="eager")
    expected = dict(reference.named_buffers())
    for name, buffer in again.named_buffers():
        assert torch.equal(buffer, expected[name]), name
        assert torch.equal(buffer, dict(model.named_buffers())[name]), name
    tokens = token_batch()
    with torch.no_grad():
        assert torch.equal(again.eval()(tokens).logits, model.eval()(tokens).logits)


def test_the_swapped_class_is_custom_code_exactly_when_the_class_it_extends_is():
    class MyLM(transformers.LlamaForCausalLM):
        pass

    for own in (transformers.LlamaForCausalLM, transformers.FalconH1Model, MyLM):
        assert swapped_class(own).is_custom_code() is own.is_custom_code(), own
    assert swapped_class(MyLM).is_custom_code()
