"""A swap writes nothing into a config: two models built from one config object (transformers keeps
the object it is given, as ``model.config``) stay apart, so the unswapped one saves and loads as a
plain model, and the swapped one's directory holds its own record."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.hf import tiny_config, token_batch, transformers
from lightning_mrs import from_pretrained, swap_norms
from lightning_mrs.swap.hf_format import RECORD_KEY


@pytest.fixture(autouse=True)
def _quiet_transformers():
    transformers.logging.set_verbosity_error()


def test_the_swap_leaves_a_model_sharing_the_config_alone(tmp_path):
    config = tiny_config("llama")
    before = config.to_dict()
    torch.manual_seed(0)
    swapped = transformers.LlamaForCausalLM(config).eval()
    plain = transformers.LlamaModel(config).eval()  # e.g. a base model built beside a head
    swap_norms(swapped, "mrs", qk_norm="mrs")
    assert swapped.config is config and plain.config is config and config.to_dict() == before
    swapped.save_pretrained(tmp_path / "swapped")
    assert config.to_dict() == before  # the record went into the saved copy only
    assert RECORD_KEY in json.loads((tmp_path / "swapped" / "config.json").read_text())
    plain.save_pretrained(tmp_path / "plain")
    saved = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert RECORD_KEY not in saved and "auto_map" not in saved and saved["model_type"] == "llama"
    ids = token_batch()
    for again in (transformers.LlamaModel.from_pretrained(tmp_path / "plain"),
                  from_pretrained(tmp_path / "plain", auto_class=transformers.LlamaModel)):
        with torch.no_grad():
            torch.testing.assert_close(again.eval()(ids).last_hidden_state, plain(ids).last_hidden_state, rtol=0, atol=0)
