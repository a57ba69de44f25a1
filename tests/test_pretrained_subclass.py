"""A subclass of a transformers model (a user's own ``class MyLlama(LlamaForCausalLM)``) is a
transformers model: it saves as its transformers base swapped, and its directory loads back swapped."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.hf import tiny_config, token_batch, transformers
from lightning_mrs import from_pretrained, swap_norms
from lightning_mrs.swap.hf_format import RECORD_KEY, live_layers


class MyLlama(transformers.LlamaForCausalLM):
    """A user's subclass, defined outside transformers (its ``__module__`` is this file)."""


@pytest.fixture(autouse=True)
def _quiet_transformers():
    transformers.logging.set_verbosity_error()


@pytest.mark.parametrize("options", [dict(target="mrs"), dict(target="layer"), dict(target=None, qk_norm="mrs")],
                         ids=["mrs", "layer", "qk-only"])
def test_a_swapped_subclass_saves_its_record_and_loads_back(tmp_path, options):
    torch.manual_seed(0)
    model = MyLlama(tiny_config("llama")).eval()
    report = swap_norms(model, **options)
    assert report.changes or report.qk_added
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert set(saved[RECORD_KEY]["layers"]) == {*report.changes, *report.qk_added}
    assert saved["architectures"] == ["LightningMRSLlamaForCausalLM"] and saved["model_type"] == "lightning_mrs_llama"
    ids = token_batch()
    kinds = {n: type(m) for n, m in model.named_modules() if n.endswith("norm")}
    for again in (from_pretrained(tmp_path).eval(), from_pretrained(tmp_path, auto_class=transformers.LlamaForCausalLM).eval()):
        with torch.no_grad():
            torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=0, atol=0)
        assert kinds == {n: type(m) for n, m in again.named_modules() if n.endswith("norm")}


def test_a_peft_wrapper_is_not_taken_for_the_transformers_model():
    """PEFT's ``PeftModel`` derives from transformers' ``PushToHubMixin`` and forwards ``config``: the
    wrapped transformers model is the one that saves the swap, with names relative to it."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(tiny_config("llama")).eval()
    wrapped = peft.get_peft_model(base, peft.LoraConfig(target_modules=["q_proj"], task_type="CAUSAL_LM"))
    swap_norms(wrapped, "mrs")
    assert type(base).__name__ == "LightningMRSLlamaForCausalLM"
    names = set(live_layers(base))
    assert names and names <= {n for n, _ in base.named_modules()}, sorted(names)[:3]
