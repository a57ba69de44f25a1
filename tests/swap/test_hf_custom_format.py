"""A swapped transformers model saves as transformers' custom models do, and every place it goes
behaves as transformers does for the unswapped model (issue 54 §1, cases 1-4):

1. a model built from a swapped model's config is plain and saves as plain;
2. a user's subclass of a head class comes back as that head (or the loader asks for ``auto_class=``);
3. a causal LM's swapped directory loads as any head of its family, with the unswapped load report;
4. ``config.json`` holds the record and the guard that refuses the family's own class (issue 61;
   ``tests/swap/test_hf_exits.py``), the saved code imports one public entry point, and a newer
   record format is refused naming the release it needs.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

import lightning_mrs
from helpers.hf import tiny_causal_lm, tiny_config, token_batch, transformers
from lightning_mrs import from_pretrained, swap_norms
from lightning_mrs.swap.hf_guard import guard_text


@pytest.fixture(autouse=True)
def _quiet_transformers():
    transformers.logging.set_verbosity_error()


def _trained(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():  # no layer at its init: a weight that does not load changes the outputs
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("target", ["mrs", "rms-half", "layer"])
def test_a_model_built_from_a_swapped_models_config_is_plain_and_saves_plain(tmp_path, target):
    teacher = tiny_causal_lm("llama")
    swap_norms(teacher, target, qk_norm="mrs")
    student = _trained(transformers.AutoModelForCausalLM.from_config(teacher.config).eval())  # distillation
    assert type(student) is transformers.LlamaForCausalLM
    assert {type(m).__name__ for n, m in student.named_modules() if n.endswith("norm")} == {"LlamaRMSNorm"}
    student.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "llama" and "lightning_mrs" not in saved and "auto_map" not in saved
    assert not (tmp_path / "modeling_lightning_mrs.py").exists()
    ids = token_batch()
    # transformers loads it without remote code; so does lightning_mrs, as transformers does
    for again in (transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager"),
                  from_pretrained(tmp_path, attn_implementation="eager")):
        assert type(again) is transformers.LlamaForCausalLM
        with torch.no_grad():
            assert torch.equal(again(ids).logits, student(ids).logits)


class MyClassifier(transformers.LlamaForSequenceClassification):
    """A user's subclass of a head class (its ``__module__`` is this file)."""


def _classifier() -> torch.nn.Module:
    torch.manual_seed(0)
    config = tiny_config("llama", num_labels=3)
    config._attn_implementation = "eager"
    return _trained(MyClassifier(config).eval())


def test_a_subclass_of_a_head_comes_back_as_that_head(tmp_path):
    model = _classifier()
    model.save_pretrained(tmp_path / "plain")
    _, expected = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "plain",
                                                                                   output_loading_info=True)
    swap_norms(model, "mrs", qk_norm="mrs")
    assert isinstance(model, MyClassifier)  # in memory the user's class stays
    model.save_pretrained(tmp_path / "swapped")
    again, info = from_pretrained(tmp_path / "swapped", attn_implementation="eager", output_loading_info=True)
    assert isinstance(again, transformers.LlamaForSequenceClassification) and info == expected
    assert torch.equal(again.score.weight, model.score.weight)
    ids = token_batch()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
    mine = from_pretrained(tmp_path / "swapped", auto_class=MyClassifier, attn_implementation="eager")
    assert isinstance(mine, MyClassifier)
    with torch.no_grad():
        assert torch.equal(mine(ids).logits, model(ids).logits)


def test_a_directory_naming_a_class_transformers_lacks_asks_for_auto_class(tmp_path):
    model = _classifier()
    model.save_pretrained(tmp_path)  # unswapped: architectures = ["MyClassifier"]
    with pytest.raises(ValueError, match=r"^[^\n]*architectures name MyClassifier, [^\n]*pass auto_class=[^\n]*$"):
        from_pretrained(tmp_path)
    again = from_pretrained(tmp_path, auto_class=transformers.AutoModelForSequenceClassification)
    assert torch.equal(again.score.weight, model.score.weight)


AUTOS = ["AutoModel", "AutoModelForSequenceClassification", "AutoModelForCausalLM"]


def _hidden(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    base = getattr(model, model.base_model_prefix, model)
    return base(ids).last_hidden_state


@pytest.mark.parametrize("auto", AUTOS)
@pytest.mark.parametrize("options", [dict(target="mrs", qk_norm="mrs"), dict(target=None, qk_norm="rms")],
                         ids=["mrs", "qk-only"])
def test_a_causal_lm_directory_loads_as_every_head_of_its_family(tmp_path, auto, options):
    model = tiny_causal_lm("llama")
    model.save_pretrained(tmp_path / "plain")
    swap_norms(model, **options)
    _trained(model).save_pretrained(tmp_path / "swapped")
    cls = getattr(transformers, auto)
    plain, expected = cls.from_pretrained(tmp_path / "plain", output_loading_info=True)
    ids = token_batch()
    for load in (lambda **kw: cls.from_pretrained(tmp_path / "swapped", trust_remote_code=True, **kw),
                 lambda **kw: from_pretrained(tmp_path / "swapped", auto_class=cls, **kw)):
        again, info = load(attn_implementation="eager", output_loading_info=True)
        assert isinstance(again, type(plain)) and info == expected
        with torch.no_grad():
            assert torch.equal(_hidden(again, ids), _hidden(model, ids))


def test_a_base_model_directory_loads_as_a_causal_lm(tmp_path):
    model = tiny_causal_lm("llama")
    base = model.model
    base.save_pretrained(tmp_path / "plain")
    swap_norms(base, "mrs", qk_norm="mrs")
    _trained(base).save_pretrained(tmp_path / "swapped")
    _, expected = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain", output_loading_info=True)
    again, info = from_pretrained(tmp_path / "swapped", auto_class=transformers.AutoModelForCausalLM,
                                  attn_implementation="eager", output_loading_info=True)
    assert info == expected
    with torch.no_grad():
        assert torch.equal(_hidden(again, token_batch()), base(token_batch()).last_hidden_state)


def test_config_json_holds_the_guard_and_the_code_imports_one_public_entry_point(tmp_path):
    model = tiny_causal_lm("llama")
    swap_norms(model, "layer", qk_norm="mrs")
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["attn_implementation"] == saved["experts_implementation"] == guard_text(2)
    assert saved["model_type"] == "lightning_mrs_llama" and saved["lightning_mrs"]["format"] == 2
    tree = ast.parse((tmp_path / "modeling_lightning_mrs.py").read_text())
    imports = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert [(node.module, [a.name for a in node.names]) for node in imports] == [("lightning_mrs", ["transformers_class"])]
    assert "transformers_class" in lightning_mrs.__all__


def _saved(tmp_path: Path) -> Path:
    model = tiny_causal_lm("llama")
    swap_norms(model, "mrs")
    model.save_pretrained(tmp_path)
    return tmp_path


def test_a_record_of_a_newer_format_is_refused_naming_the_release_it_needs(tmp_path):
    path = _saved(tmp_path)
    saved = json.loads((path / "config.json").read_text())
    saved["lightning_mrs"].update(format=3, version="9.9.0")
    (path / "config.json").write_text(json.dumps(saved))
    need = r"record has format 3, written by lightning-mrs 9\.9\.0; .*pip install -U 'lightning-mrs>=9\.9\.0'$"
    with pytest.raises(ValueError, match=need):
        from_pretrained(path)
    with pytest.raises(ValueError, match=need):
        transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)


def test_saved_code_of_a_newer_format_is_refused_by_the_installed_entry_point(tmp_path):
    path = _saved(tmp_path)
    code = path / "modeling_lightning_mrs.py"
    code.write_text(code.read_text().replace("RECORD_FORMAT = 2", "RECORD_FORMAT = 3"))
    need = r"written for lightning-mrs record format 3; .* reads format 2 \(written since lightning-mrs 0\.3\.0\): pip install -U"
    with pytest.raises(ImportError, match=need):
        transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)


def test_a_heads_base_model_saves_its_own_swap(tmp_path):
    """transformers' test_correct_missing_keys: ``head.base_model.save_pretrained`` then the head's load."""
    model = _trained(tiny_causal_lm("llama"))
    model.base_model.save_pretrained(tmp_path / "plain")
    _, expected = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain", output_loading_info=True)
    swap_norms(model, "mrs", qk_norm="mrs")
    model.base_model.save_pretrained(tmp_path / "swapped")
    again, info = from_pretrained(tmp_path / "swapped", auto_class=transformers.LlamaForCausalLM,
                                  attn_implementation="eager", output_loading_info=True)
    assert info == expected and info["missing_keys"] == {"lm_head.weight"}
    with torch.no_grad():
        assert torch.equal(_hidden(again, token_batch()), _hidden(model, token_batch()))
    loaded = from_pretrained(tmp_path / "swapped", auto_class=transformers.LlamaForCausalLM)  # and once more
    loaded.base_model.save_pretrained(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["lightning_mrs"]["layers"] == (
        json.loads((tmp_path / "swapped" / "config.json").read_text())["lightning_mrs"]["layers"])
