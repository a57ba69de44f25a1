"""A swapped transformers model saves as a custom architecture that the ecosystem loads by itself.

``save_pretrained`` writes ``modeling_lightning_mrs.py`` beside the weights and ``config.json``'s
``auto_map`` names it, so transformers' Auto classes (``trust_remote_code=True``), ``pipeline``,
PEFT's ``AutoPeftModelForCausalLM`` and lm-evaluation-harness's ``hf`` model build the swapped model
and give the saved model's logits bit for bit; without ``trust_remote_code`` a plain load refuses
with a message naming both ways in, never loading other weights; directories saved before this
format still load with ``lightning_mrs.from_pretrained``.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from helpers.hf import tiny_causal_lm, token_batch, transformers
from lightning_mrs import from_pretrained, swap_norms
from lightning_mrs.swap.modeling_lightning_mrs import PREFIX

CASES = [
    ("llama", {}, dict(target="mrs")),
    ("llama", {}, dict(target=None, qk_norm="mrs")),
    ("llama", {}, dict(target="rms")),  # plain layers only: the custom class gives back nn.RMSNorm
    ("qwen3", {}, dict(target="mrs")),  # its own QK-norms, swapped
    ("gemma3_text", {}, dict(target="mrs", qk_norm="mrs")),
    ("gpt2", {}, dict(target="layer", qk_norm="rms")),
]
#: the guard's message before this format (lightning-mrs 0.2.0's directories hold it)
OLD_GUARD = "lightning_mrs (norms swapped by lightning-mrs: load with lightning_mrs.from_pretrained)"


@pytest.fixture(autouse=True)
def _quiet_transformers():
    transformers.logging.set_verbosity_error()


def _saved(tmp_path: Path, family: str, config: dict, options: dict, seed: int = 0) -> tuple[torch.nn.Module, Path]:
    model = tiny_causal_lm(family, seed=seed, **config)
    swap_norms(model, **options)
    with torch.no_grad():  # "trained": no layer sits at its init
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.05 * torch.randn_like(p))
    path = tmp_path / "saved"
    model.save_pretrained(path)
    return model, path


def _same_model(loaded: torch.nn.Module, model: torch.nn.Module) -> None:
    assert type(loaded).__name__ == type(model).__name__ == PREFIX + type(model).__mro__[1].__name__
    assert isinstance(loaded, type(model).__mro__[1])  # still the family's class
    assert [type(m).__name__ for m in loaded.modules()] == [type(m).__name__ for m in model.modules()]
    loaded.config._attn_implementation = "eager"
    ids = token_batch()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize(("family", "config", "options"), CASES, ids=lambda v: str(v))
def test_auto_classes_load_the_swapped_model_with_trust_remote_code(tmp_path, family, config, options):
    model, path = _saved(tmp_path, family, config, options)
    saved = json.loads((path / "config.json").read_text())
    assert saved["auto_map"]["AutoModelForCausalLM"] == f"modeling_lightning_mrs.{type(model).__name__}"
    assert (path / "modeling_lightning_mrs.py").is_file()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
    assert type(loaded).__module__.startswith("transformers_modules.")  # the code saved beside the weights ran
    _same_model(loaded, model)


@pytest.mark.parametrize("trust", [None, False])
def test_without_trust_remote_code_a_plain_load_refuses(tmp_path, trust):
    model, path = _saved(tmp_path, "llama", {}, dict(target="mrs"))
    kwargs = {} if trust is None else {"trust_remote_code": trust}
    with pytest.raises(ValueError, match=r"lightning_mrs\.from_pretrained, or with trust_remote_code=True"):
        transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)
    with pytest.raises(ValueError, match="trust_remote_code=True"):  # the family's class, named directly
        transformers.LlamaForCausalLM.from_pretrained(path)


def test_lightning_mrs_from_pretrained_runs_the_installed_code_not_the_saved_file(tmp_path):
    model, path = _saved(tmp_path, "qwen3", {}, dict(target="mrs"))
    (path / "modeling_lightning_mrs.py").write_text("raise RuntimeError('the saved file ran')\n")
    loaded = from_pretrained(path)
    assert type(loaded).__module__ == "lightning_mrs.swap.modeling_lightning_mrs"
    _same_model(loaded, model)


def test_a_classification_head_saves_under_its_own_auto_class(tmp_path):
    torch.manual_seed(0)
    config = tiny_causal_lm("llama").config
    config.num_labels = 3
    model = transformers.AutoModelForSequenceClassification.from_config(config).eval()
    swap_norms(model, "mrs")
    model.save_pretrained(tmp_path)
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert auto_map == {"AutoModelForSequenceClassification": "modeling_lightning_mrs.LightningMRSLlamaForSequenceClassification"}
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path, trust_remote_code=True)
    loaded.config._attn_implementation = model.config._attn_implementation
    ids = token_batch()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_pipeline_generates_what_the_saved_model_generates(tmp_path):
    from helpers.tokenizers import tiny_tokenizer

    tokenizer = tiny_tokenizer(64)
    model, path = _saved(tmp_path, "llama", dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                                  eos_token_id=tokenizer.eos_token_id), dict(target="mrs"))
    tokenizer.save_pretrained(path)
    prompt = "def main"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    expected = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    pipe = transformers.pipeline("text-generation", model=str(path), trust_remote_code=True, device="cpu")
    assert type(pipe.model).__name__ == "LightningMRSLlamaForCausalLM"
    out = pipe(prompt, max_new_tokens=6, do_sample=False, return_tensors=True)
    assert out[0]["generated_token_ids"] == expected[0].tolist()


def test_auto_peft_model_loads_an_adapter_on_the_swapped_base(tmp_path):
    peft = pytest.importorskip("peft")
    _, path = _saved(tmp_path, "llama", {}, dict(target="mrs", qk_norm="mrs"))
    base = from_pretrained(path, attn_implementation="eager")  # as a user fine-tunes a saved model
    lora = peft.get_peft_model(base, peft.LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=["q_proj", "v_proj"],
                                                      init_lora_weights=False))
    lora.save_pretrained(tmp_path / "adapter")
    loaded = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter", trust_remote_code=True,
                                                            attn_implementation="eager")
    assert type(loaded.get_base_model()).__name__ == "LightningMRSLlamaForCausalLM"
    ids = token_batch()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, lora(ids).logits)


def test_lm_evaluation_harness_opens_the_directory(tmp_path):
    huggingface = pytest.importorskip("lm_eval.models.huggingface", reason="lm-evaluation-harness is not installed")
    from helpers.tokenizers import tiny_tokenizer

    tokenizer = tiny_tokenizer(64)
    model, path = _saved(tmp_path, "qwen3", dict(vocab_size=len(tokenizer)), dict(target="mrs"))
    tokenizer.save_pretrained(path)
    lm = huggingface.HFLM(pretrained=str(path), trust_remote_code=True, device="cpu", batch_size=1)
    assert type(lm.model).__name__ == "LightningMRSQwen3ForCausalLM"
    lm.model.config._attn_implementation = "eager"  # the attention the saved model ran
    ids = token_batch()
    with torch.no_grad():
        assert torch.equal(lm._model_call(ids), model(ids).logits)


def test_a_directory_saved_before_this_format_still_loads(tmp_path):
    model, path = _saved(tmp_path, "llama", {}, dict(target="mrs", qk_norm="mrs"))
    saved = json.loads((path / "config.json").read_text())
    del saved["auto_map"]
    saved["attn_implementation"] = OLD_GUARD
    saved["architectures"] = ["LlamaForCausalLM"]
    (path / "config.json").write_text(json.dumps(saved))
    (path / "modeling_lightning_mrs.py").unlink()
    _same_model(from_pretrained(path), model)


def test_a_record_of_another_format_is_refused_by_both_ways_in(tmp_path):
    _, path = _saved(tmp_path, "llama", {}, dict(target="mrs"))
    saved = json.loads((path / "config.json").read_text())
    saved["lightning_mrs"]["format"] = 2
    (path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"saved'?: config.json's lightning_mrs record has format 2; .*upgrade lightning-mrs"):
        from_pretrained(path)
    with pytest.raises(ValueError, match=r"^config.json's lightning_mrs record has format 2; .*upgrade lightning-mrs"):
        transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)


def test_a_swapped_model_pickles_and_copies_as_its_class():
    import copy

    model = tiny_causal_lm("llama")
    swap_norms(model, "mrs")
    ids = token_batch()
    for again in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert type(again) is type(model)
        with torch.no_grad():
            assert torch.equal(again(ids).logits, model(ids).logits)
