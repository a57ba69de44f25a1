"""NormSwap around a LightningModule holding a transformers model: swap at setup, checkpoint,
resume, and restore onto a model freshly built from the same config; the record says what the
probe found each replaced layer computed."""

from __future__ import annotations

import pytest

from helpers.hf import NORMS, lit_causal_lm, token_batch, token_data
from helpers.lightning import assert_same_model, fit, normswap_record
from lightning_mrs import MRSNorm, iter_norm_layers
from lightning_mrs.callbacks import NormSwap

CLASSES = {"llama": "LlamaRMSNorm", "gemma": "GemmaRMSNorm", "gpt2": "LayerNorm"}


@pytest.mark.parametrize("family", list(CLASSES))
def test_checkpoint_resume_and_restore(tmp_path, family):
    trainer, trained = fit(lit_causal_lm(family), callbacks=[NormSwap("mrs")], data=token_data(), batch_size=4)
    norms = list(iter_norm_layers(trained))
    assert len(norms) == 5 and all(isinstance(m, MRSNorm) for _, m, _ in norms)
    path = tmp_path / "lm.ckpt"
    trainer.save_checkpoint(path)
    layers = normswap_record(path)["layers"]
    assert len(layers) == 5 and all(r["kind"] == "mrs" and r["channel_dim"] == -1 for r in layers.values())
    if NORMS[family] == "torch":  # nn.LayerNorm: a registered class, no probe
        assert all("from" not in r for r in layers.values())
    else:
        eps = "1e-06"
        assert {r["from"] for r in layers.values()} == {f"{CLASSES[family]}: {NORMS[family]}, eps={eps}"}

    resumed, model = fit(lit_causal_lm(family), steps=4, callbacks=[NormSwap("mrs")], data=token_data(),
                         batch_size=4, ckpt_path=str(path))
    assert resumed.global_step == 4

    assert_same_model(NormSwap.restore(lit_causal_lm(family), path), path, trained, token_batch())


def test_a_second_fit_keeps_the_probed_formula_in_the_record(tmp_path):
    _, model = fit(lit_causal_lm("gemma"), callbacks=[NormSwap("rms")], data=token_data(), batch_size=4)
    trainer, model = fit(model, callbacks=[NormSwap("rms")], data=token_data(), batch_size=4)
    path = tmp_path / "second.ckpt"
    trainer.save_checkpoint(path)
    layers = normswap_record(path)["layers"]
    assert len(layers) == 5 and all(r["from"].startswith("GemmaRMSNorm: rms(x) * (1 + w)") for r in layers.values())
    assert_same_model(NormSwap.restore(lit_causal_lm("gemma"), path), path, model, token_batch())


def test_a_restored_model_saves_in_the_format_transformers_loads(tmp_path):
    """NormSwap.restore gives what swap_norms gives: the transformers model becomes
    LightningMRS<Base>, so its save_pretrained writes the code and auto_map that a plain
    ``AutoModelForCausalLM.from_pretrained(trust_remote_code=True)`` runs, with the same logits."""
    import torch
    from transformers import AutoModelForCausalLM

    import lightning_mrs

    trainer, trained = fit(lit_causal_lm("llama"), callbacks=[NormSwap("mrs")], data=token_data(), batch_size=4)
    path = tmp_path / "lm.ckpt"
    trainer.save_checkpoint(path)
    restored = NormSwap.restore(lit_causal_lm("llama"), path).eval()
    assert type(restored.lm).__name__ == "LightningMRSLlamaForCausalLM"
    restored.lm.save_pretrained(tmp_path / "hf")
    assert (tmp_path / "hf" / "modeling_lightning_mrs.py").is_file()
    tokens = token_batch()
    with torch.no_grad():
        expected = restored(tokens)
        # the helper's model runs eager attention; so do the loaded ones (same kernels, so bit for bit)
        for loaded in (AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True, attn_implementation="eager"),
                       lightning_mrs.from_pretrained(tmp_path / "hf", attn_implementation="eager")):
            got = loaded.eval()(input_ids=tokens).logits
            assert torch.equal(got, expected), (type(loaded).__name__, (got - expected).abs().max())
