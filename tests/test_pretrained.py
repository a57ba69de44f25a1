"""``save_pretrained`` and ``lightning_mrs.from_pretrained``: a swapped transformers model comes back exactly.

Every swap is recorded in the saved ``config.json`` (read off the live modules); the reloaded
model reproduces the saved one's logits bit for bit. The directory is a custom model: transformers
without ``trust_remote_code=True`` refuses it with its own message (never another model).
Families: Llama, Gemma (``1 + w``), Qwen3 (its own QK-norms), Phi with ``qk_layernorm``, GPT-2 and
GPT-NeoX (fused projections).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from helpers.hf import tiny_causal_lm, token_batch, transformers
from lightning_mrs import MRSNorm, OffsetRMSNorm, from_pretrained, swap_norms
from lightning_mrs.swap.hf_format import RECORD_KEY, saved_config

#: (family, config overrides, swap options)
CASES = [
    ("llama", {}, dict(target="mrs")),
    ("llama", {}, dict(target="rms")),
    ("llama", {}, dict(target="rms-half")),  # squares in float16: not the family's upcasting RMSNorm
    ("llama", {}, dict(target="layer")),
    ("llama", {}, dict(target=None, qk_norm="mrs")),
    ("llama", {}, dict(target="rms", qk_norm="rms")),
    ("gemma", {}, dict(target="rms")),
    ("gemma", {}, dict(target="mrs")),
    ("qwen3", {}, dict(target="mrs")),
    ("qwen3", {}, dict(target="rms")),
    ("phi", dict(qk_layernorm=True), dict(target="mrs", qk_norm="mrs")),
    ("gpt2", {}, dict(target="mrs", qk_norm="mrs")),
    ("gpt_neox", {}, dict(target=None, qk_norm="rms")),
]


def _ids(case: tuple) -> str:
    family, _, options = case
    return f"{family}-" + "-".join(f"{k}={v}" for k, v in options.items())


@pytest.fixture(autouse=True)
def _quiet_transformers():
    transformers.logging.set_verbosity_error()


def _saved(tmp_path: Path, family: str, config: dict, options: dict) -> tuple[torch.nn.Module, Path]:
    model = tiny_causal_lm(family, **config)
    swap_norms(model, **options)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.05 * torch.randn_like(p))  # "trained": no layer sits at its init
    model.save_pretrained(tmp_path)
    return model, tmp_path


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_reload_reproduces_the_logits_bit_for_bit(tmp_path, case):
    family, config, options = case
    model, path = _saved(tmp_path, family, config, options)
    again = from_pretrained(path, attn_implementation="eager")
    assert type(again) is type(model)
    assert [type(m) for m in again.modules()] == [type(m) for m in model.modules()]
    ids = token_batch()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
    saved = json.loads((path / "config.json").read_text())[RECORD_KEY]["layers"]
    assert getattr(saved_config(again), RECORD_KEY)["layers"] == saved  # a reload saves the same record
    assert type(again.config) is type(model.config) and RECORD_KEY not in vars(again.config)  # the family's config


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_plain_transformers_refuses_every_swap_as_custom_code(tmp_path, case):
    family, config, options = case
    model, path = _saved(tmp_path, family, config, options)
    saved = json.loads((path / "config.json").read_text())
    assert saved["model_type"] == f"lightning_mrs_{model.config.model_type}"
    with pytest.raises(ValueError, match="contains custom code which must be executed"):
        transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=False)
    loaded = transformers.AutoConfig.from_pretrained(path, trust_remote_code=True)
    assert isinstance(loaded, type(model.config)) and loaded.model_type == saved["model_type"]


def test_gemma_rms_keeps_the_stored_weight_convention(tmp_path):
    model = tiny_causal_lm("gemma")
    before = model.model.norm.weight.detach().clone()  # Gemma stores w; the layer computes 1 + w
    swap_norms(model, "rms")
    assert isinstance(model.model.norm, OffsetRMSNorm) and torch.equal(model.model.norm.weight, before)


@pytest.mark.parametrize("options", [dict(target="mrs"), dict(target=None, qk_norm="mrs"), dict(target="layer")])
def test_an_explicit_attention_still_gets_transformers_message(tmp_path, options):
    """``attn_implementation=`` changes nothing: the directory is custom code (before this format, a guard
    in two config keys did this, and a call naming both keys overrode it)."""
    _, path = _saved(tmp_path, "llama", {}, options)
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                          experts_implementation="eager", trust_remote_code=False)


def test_a_reloaded_model_saves_the_same_directory_again(tmp_path):
    model, path = _saved(tmp_path / "a", "llama", {}, dict(target=None, qk_norm="mrs"))
    again = from_pretrained(path)
    again.save_pretrained(tmp_path / "b")
    first, second = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("a", "b"))
    assert first == second
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b", trust_remote_code=False)
    third = from_pretrained(tmp_path / "b", attn_implementation="eager")
    ids = token_batch()
    with torch.no_grad():
        assert torch.equal(third(ids).logits, model(ids).logits)


def test_a_directory_without_a_record_loads_as_transformers_does(tmp_path):
    model = tiny_causal_lm("llama")
    model.save_pretrained(tmp_path)
    again = from_pretrained(tmp_path, attn_implementation="eager")
    ids = token_batch()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
    assert not hasattr(again.config, "lightning_mrs") and type(again) is transformers.LlamaForCausalLM


def test_weights_that_do_not_fit_the_record_are_an_error(tmp_path):
    _, path = _saved(tmp_path, "llama", {}, dict(target="mrs"))
    config = json.loads((path / "config.json").read_text())
    del config["lightning_mrs"]["layers"]["model.norm"]  # an edited config.json: that norm stays LlamaRMSNorm
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"mismatched \['model.norm.weight'\]"):
        from_pretrained(path)


def test_dtype_and_a_device_map_go_to_transformers(tmp_path):
    model, path = _saved(tmp_path, "llama", {}, dict(target="mrs", qk_norm="mrs"))
    again = from_pretrained(path, dtype=torch.bfloat16, device_map="cpu", attn_implementation="eager")
    assert isinstance(again.model.norm, MRSNorm) and again.model.norm.weight.dtype == torch.bfloat16
    ids = token_batch()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits.float(), model(ids).logits, atol=0.1, rtol=0.05)


def test_disk_offload_loads_the_swapped_model(tmp_path):
    """``device_map`` with disk offload: the swap happens before accelerate takes the weights."""
    pytest.importorskip("accelerate")
    model, path = _saved(tmp_path / "model", "llama", {}, dict(target="mrs", qk_norm="mrs"))
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = from_pretrained(path, device_map=device_map, offload_folder=str(tmp_path / "offload"),
                                attn_implementation="eager")
    ids = token_batch()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits, atol=1e-6, rtol=1e-6)


def test_a_second_swap_keeps_the_first_in_the_record(tmp_path):
    model = tiny_causal_lm("llama")
    config = model.config
    swap_norms(model, "rms")
    swap_norms(model, None, qk_norm="mrs")
    assert model.config is config and RECORD_KEY not in vars(config)  # nothing kept on the config
    model.save_pretrained(tmp_path)
    layers = json.loads((tmp_path / "config.json").read_text())[RECORD_KEY]["layers"]
    assert layers["model.norm"] == dict(kind="rms", channel_dim=-1, spatial=None, eps=1e-6,
                                        **{"from": "LlamaRMSNorm: rms(x) * w, eps=1e-06"})
    assert layers["model.layers.1.self_attn.k_norm"]["qk"]
    again = from_pretrained(tmp_path, attn_implementation="eager")
    ids = token_batch()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
