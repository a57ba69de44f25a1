"""A swapped transformers model saves as a custom architecture that the ecosystem loads by itself.

``save_pretrained`` writes ``modeling_lightning_mrs.py`` beside the weights and ``config.json``'s
``auto_map`` names it, so transformers' Auto classes (``trust_remote_code=True``), ``pipeline``,
PEFT's ``AutoPeftModelForCausalLM`` and lm-evaluation-harness's ``hf`` model build the swapped model
and give the saved model's logits bit for bit; without ``trust_remote_code`` transformers refuses
with its own message for custom code, never loading other weights; directories saved by
lightning-mrs 0.2.0 (record format 1) are refused in one line.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import pytest
import torch

from helpers.hf import tiny_causal_lm, token_batch, transformers
from lightning_mrs import from_pretrained, swap_norms, transformers_class
from lightning_mrs.swap.hf_format import PREFIX, auto_map
from lightning_mrs.version import __version__

CASES = [
    ("llama", {}, dict(target="mrs")),
    ("llama", {}, dict(target=None, qk_norm="mrs")),
    ("llama", {}, dict(target="rms")),  # plain layers only: the custom class gives back nn.RMSNorm
    ("qwen3", {}, dict(target="mrs")),  # its own QK-norms, swapped
    ("gemma3_text", {}, dict(target="mrs", qk_norm="mrs")),
    ("gpt2", {}, dict(target="layer", qk_norm="rms")),
]
#: the guard lightning-mrs 0.2.0 wrote into config.json (record format 1)
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
    assert type(loaded) is transformers_class(type(model).__name__)  # what the saved file resolves it to
    _same_model(loaded, model)


@pytest.mark.parametrize("trust", [None, False])
def test_without_trust_remote_code_transformers_refuses_with_its_own_message(tmp_path, trust):
    model, path = _saved(tmp_path, "llama", {}, dict(target="mrs"))
    kwargs = {} if trust is None else {"trust_remote_code": trust}
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoConfig):
        with pytest.raises(ValueError, match=r"contains custom code which must be executed(.|\n)*trust_remote_code=True"):
            auto.from_pretrained(path, **kwargs)


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
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["LightningMRSLlamaForSequenceClassification"]
    assert saved["auto_map"] == auto_map(transformers.LlamaConfig)  # every head of the family, as for the causal LM
    assert saved["auto_map"]["AutoModelForSequenceClassification"] == (
        "modeling_lightning_mrs.LightningMRSLlamaForSequenceClassification")
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


def test_a_directory_saved_by_0_2_0_is_refused_in_one_line(tmp_path):
    """lightning-mrs 0.2.0 (unreleased) kept the family's model_type, a format-1 record and a guard."""
    _, path = _saved(tmp_path, "llama", {}, dict(target="mrs", qk_norm="mrs"))
    saved = json.loads((path / "config.json").read_text())
    saved.update(model_type="llama", attn_implementation=OLD_GUARD, architectures=["LightningMRSLlamaForCausalLM"])
    saved["lightning_mrs"].update(format=1, version="0.2.0")
    (path / "config.json").write_text(json.dumps(saved))
    now = re.escape(__version__)
    with pytest.raises(ValueError, match=rf"^'[^\n]*saved': config.json's lightning_mrs record has format 1, saved by "
                                         rf"lightning-mrs 0\.2\.0; lightning-mrs {now} reads format 2 \(written since "
                                         rf"lightning-mrs 0\.3\.0\): load it with lightning-mrs 0\.2\.0, save [^\n]*$"):
        from_pretrained(path)


def test_a_swapped_model_pickles_and_copies_as_its_class():
    import copy

    model = tiny_causal_lm("llama")
    swap_norms(model, "mrs")
    ids = token_batch()
    for again in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert type(again) is type(model)
        with torch.no_grad():
            assert torch.equal(again(ids).logits, model(ids).logits)
