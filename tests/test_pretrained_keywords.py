"""``lightning_mrs.from_pretrained`` takes what transformers' ``from_pretrained`` takes, with its
meaning there: each keyword is checked against transformers' own load of the unswapped model."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from helpers.hf import tiny_causal_lm, tiny_config, token_batch, transformers
from lightning_mrs import from_pretrained, swap_norms
from lightning_mrs.swap.hf_format import saved_config


@pytest.fixture(autouse=True)
def _quiet_transformers():
    transformers.logging.set_verbosity_error()


def _pair(tmp_path, model, **options):
    """Save ``model`` unswapped (``plain``) and swapped (``swapped``); returns the swapped model."""
    model.save_pretrained(tmp_path / "plain")
    swap_norms(model, **options)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "swapped")
    return model


def _classifier(num_labels: int = 3) -> torch.nn.Module:
    torch.manual_seed(0)
    config = tiny_config("llama", num_labels=num_labels)
    config._attn_implementation = "eager"
    return transformers.LlamaForSequenceClassification(config).eval()


def test_output_loading_info_is_transformers_info(tmp_path):
    _pair(tmp_path, tiny_causal_lm("llama"), target="mrs", qk_norm="mrs")
    model, info = from_pretrained(tmp_path / "swapped", output_loading_info=True)
    _, expected = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain", output_loading_info=True)
    assert isinstance(model, transformers.LlamaForCausalLM)
    assert info == expected and set(info) == {"missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"}


def test_config_overrides_go_to_the_config(tmp_path):
    _pair(tmp_path, tiny_causal_lm("llama"), target="mrs")
    kwargs = dict(use_cache=False, num_labels=5, pad_token_id=7)
    ours = from_pretrained(tmp_path / "swapped", **kwargs)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain", **kwargs)
    for key in kwargs:
        assert getattr(ours.config, key) == getattr(theirs.config, key) != getattr(tiny_config("llama"), key)


def test_ignore_mismatched_sizes_reinitialises_only_the_new_head(tmp_path):
    saved = _pair(tmp_path, _classifier(3), target="mrs", qk_norm="mrs")
    kwargs = dict(num_labels=5, ignore_mismatched_sizes=True, output_loading_info=True)
    model, info = from_pretrained(tmp_path / "swapped", **kwargs)
    _, expected = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "plain", **kwargs)
    assert info == expected and {k for k, *_ in info["mismatched_keys"]} == {"score.weight"}
    assert model.score.weight.shape == (5, 32)
    new = dict(model.named_parameters())
    for name, p in saved.named_parameters():  # every other weight, norms included, as saved
        if name != "score.weight":
            assert torch.equal(new[name], p), name
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):  # without it: refused, as transformers does
        from_pretrained(tmp_path / "swapped", num_labels=5)
    with pytest.raises(RuntimeError):
        transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "plain", num_labels=5)


def test_a_norm_mismatch_is_an_error_even_when_ignoring_sizes(tmp_path):
    _pair(tmp_path, tiny_causal_lm("llama"), target="mrs")
    config = json.loads((tmp_path / "swapped" / "config.json").read_text())
    del config["lightning_mrs"]["layers"]["model.norm"]  # that norm is built as LlamaRMSNorm: 32 weights, not 16
    (tmp_path / "swapped" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        from_pretrained(tmp_path / "swapped", ignore_mismatched_sizes=True)


@pytest.mark.parametrize("family, options", [("llama", dict(target=None, qk_norm="mrs")),
                                             ("qwen3", dict(target="mrs", qk_norm="mrs")),
                                             ("gemma3_text", dict(target=None, qk_norm="rms"))])
@pytest.mark.parametrize("extra", [{}, dict(dtype=torch.bfloat16), dict(device_map="cpu")], ids=["", "bf16", "cpu"])
def test_a_state_dict_and_a_config_without_a_directory(family, options, extra):
    model = tiny_causal_lm(family)
    swap_norms(model, **options)
    # the config save_pretrained would write (AutoConfig.from_pretrained of the directory, trust_remote_code=True)
    again = from_pretrained(None, config=saved_config(model), state_dict=model.state_dict(), **extra)
    dtype = extra.get("dtype", torch.float32)
    reference = copy.deepcopy(model).to(dtype)
    assert dict(again.named_parameters()).keys() == dict(reference.named_parameters()).keys()
    for (name, p), q in zip(again.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
    again.config._attn_implementation = "eager"
    with torch.no_grad():
        got, want = again(token_batch()).logits, reference(token_batch()).logits
    if dtype == torch.float32:
        assert torch.equal(got, want)
    else:  # .to(bfloat16) also casts the rotary buffers, which transformers' load keeps in float32
        torch.testing.assert_close(got.float(), want.float(), atol=0.02, rtol=0.02)


@pytest.mark.parametrize("copied", [True, False], ids=["copied-before", "the-model's"])
def test_a_config_without_the_record_refuses_the_swapped_weights(copied):
    """A config copied before the swap, or the swapped model's own (the record is written at save time,
    never kept on it), has no record: transformers would drop the QK-norm weights as unexpected (a model
    without them, silently); refused, naming them and the fix."""
    model = tiny_causal_lm("llama")
    config = copy.deepcopy(model.config)
    swap_norms(model, None, qk_norm="mrs")
    with pytest.raises(ValueError, match=r"q_norm\.weight.*config=AutoConfig\.from_pretrained\(directory, trust_remote_code=True\)"):
        from_pretrained(None, config=config if copied else model.config, state_dict=model.state_dict())


@pytest.mark.parametrize("name", ["./missing/dir", "missing/dir/", "/no/such/model", "a/b/c"])
def test_a_local_path_that_does_not_exist(name):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        from_pretrained(name)


def test_a_name_neither_local_nor_on_the_hub():
    with pytest.raises(FileNotFoundError, match="no such directory, and not a model on the hub"):
        from_pretrained("missing/dir", local_files_only=True)  # offline: no network retries in the test
