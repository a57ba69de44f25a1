"""AttentionMonitor on transformers models, against a float64 softmax built from the layers' weights.

The monitor reads the per-head queries and keys at the layers' ``q_norm``/``k_norm`` (added by
a QK-norm swap or ``expose_attention``, or the family's own), before the rotary embedding and
without the causal mask: the reference here materialises exactly that softmax (all keys) from
each layer's input and its own projection weights, and the warning names what is left out.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from helpers.hf_attention import TinyLM, token_data
from helpers.lightning import fit
from helpers.recording_logger import RecordingLogger
from helpers.reference import attention_ref, mrs_norm_ref
from lightning_mrs import expose_attention, swap_norms
from lightning_mrs.callbacks import AttentionMonitor

transformers = pytest.importorskip("transformers")

BATCH, LENGTH = 4, 7
FIGURES = ("logit_max", "entropy_mean", "entropy_min", "collapsed_frac")


def hot_llama(qk_norm):
    def prepare(model: nn.Module) -> None:
        with torch.no_grad():
            for layer in model.model.layers:  # peaky softmax rows
                layer.self_attn.q_proj.weight.mul_(30.0)
                layer.self_attn.k_proj.weight.mul_(30.0)
        if qk_norm is None:
            expose_attention(model)
        else:
            swap_norms(model, None, qk_norm=qk_norm)
            for layer in model.model.layers:  # weights away from 1, so that they matter
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    nn.init.uniform_(norm.weight, 0.5, 3.0)
    return prepare


def reference(qk_norm) -> dict[str, dict[str, float]]:
    """Step 0 by hand: each attention layer's input (a pre-hook), its q_proj/k_proj, the MRS
    reference norm, then every softmax row in float64."""
    torch.manual_seed(0)
    module = TinyLM("llama", prepare=hot_llama(qk_norm))
    inputs = {}
    for i, layer in enumerate(module.model.model.layers):
        layer.self_attn.register_forward_pre_hook(
            lambda m, a, kw, i=i: inputs.update({i: kw["hidden_states"].detach()}), with_kwargs=True)
    (ids,) = token_data(BATCH, LENGTH)[:BATCH]
    module(ids)
    out = {}
    for i, layer in enumerate(module.model.model.layers):
        attn = layer.self_attn
        h = inputs[i].double()
        q = (h @ attn.q_proj.weight.double().T).unflatten(-1, (4, 16)).transpose(1, 2)  # (B, 4, N, 16)
        k = (h @ attn.k_proj.weight.double().T).unflatten(-1, (2, 16)).transpose(1, 2)  # (B, 2, N, 16): GQA
        if qk_norm == "mrs":
            q = mrs_norm_ref(q, attn.q_norm.weight.double(), attn.q_norm.eps)
            k = mrs_norm_ref(k, attn.k_norm.weight.double(), attn.k_norm.eps)
        out[f"model.model.layers.{i}.self_attn"] = attention_ref(q, k, 16 ** -0.5)
    return out


@pytest.mark.parametrize("qk_norm", [None, "mrs"])
def test_llama_figures_match_materialised_softmax(qk_norm, recording_logger: RecordingLogger) -> None:
    torch.manual_seed(0)
    module = TinyLM("llama", prepare=hot_llama(qk_norm))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(module, steps=1, logger=recording_logger, data=token_data(BATCH, LENGTH), batch_size=BATCH,
            callbacks=[AttentionMonitor(max_queries=None)])
    ref = reference(qk_norm)
    assert 0 < max(f["collapsed_frac"] for f in ref.values()) < 1  # some rows collapse, not all
    got = recording_logger.history
    for layer, figures in ref.items():
        for stat in FIGURES + (("q_norm_mean", "k_norm_mean") if qk_norm else ()):
            assert got[f"attention/{layer}/{stat}"][0] == pytest.approx(figures[stat], rel=1e-4, abs=1e-5), stat
    unseen = [str(w.message) for w in caught if "does not recompute" in str(w.message)]
    assert len(unseen) == 1
    assert "model.model.layers.0.self_attn (rotary embeddings and the causal mask)" in unseen[0]


def test_olmo2_full_width_qk_norms_are_read_per_head(recording_logger: RecordingLogger) -> None:
    """OLMo 2's q_norm sees (B, N, heads*D): the monitor splits it into heads ("BN(HD)")."""
    torch.manual_seed(0)
    module = TinyLM("olmo2")
    seen = {}
    attn = module.model.model.layers[0].self_attn
    attn.q_norm.register_forward_hook(lambda m, a, out: seen.update(q=out.detach().double()))
    attn.k_norm.register_forward_hook(lambda m, a, out: seen.update(k=out.detach().double()))
    fit(module, steps=1, logger=recording_logger, data=token_data(BATCH, LENGTH), batch_size=BATCH,
        callbacks=[AttentionMonitor(max_queries=None)])
    q, k = (seen[r].unflatten(-1, (-1, 16)).transpose(1, 2) for r in ("q", "k"))  # (B, H, N, 16)
    ref = attention_ref(q, k, 16 ** -0.5)
    for stat in FIGURES:
        got = recording_logger.history[f"attention/model.model.layers.0.self_attn/{stat}"][0]
        assert got == pytest.approx(ref[stat], rel=1e-4, abs=1e-5), stat
