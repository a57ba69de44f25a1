"""A swap records itself in the swapped model's config, and in no other model's: two models built
from one config object (transformers keeps the object it is given, as ``model.config``) stay
apart, so the unswapped one saves and loads as a plain model."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.hf import tiny_config, token_batch, transformers
from lightning_mrs import from_pretrained, swap_norms
from lightning_mrs.swap.hf_record import RECORD_KEY


@pytest.fixture(autouse=True)
def _quiet_transformers():
    transformers.logging.set_verbosity_error()


def test_the_swap_leaves_a_model_sharing_the_config_alone(tmp_path):
    config = tiny_config("llama")
    torch.manual_seed(0)
    swapped = transformers.LlamaForCausalLM(config).eval()
    plain = transformers.LlamaModel(config).eval()  # e.g. a base model built beside a head
    swap_norms(swapped, "mrs", qk_norm="mrs")
    assert isinstance(getattr(swapped.config, RECORD_KEY), dict)
    assert getattr(plain.config, RECORD_KEY, None) is None and getattr(config, RECORD_KEY, None) is None
    # every module of the swapped model reads the one config that holds the record
    holders = {id(m.config) for m in swapped.modules() if isinstance(getattr(m, "config", None), type(config))}
    assert holders == {id(swapped.config)}
    plain.save_pretrained(tmp_path)
    assert RECORD_KEY not in json.loads((tmp_path / "config.json").read_text())
    ids = token_batch()
    for again in (transformers.LlamaModel.from_pretrained(tmp_path), from_pretrained(tmp_path, auto_class=transformers.LlamaModel)):
        with torch.no_grad():
            torch.testing.assert_close(again.eval()(ids).last_hidden_state, plain(ids).last_hidden_state, rtol=0, atol=0)
