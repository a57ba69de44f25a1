"""The swap does not depend on where the model lives or what the defaults are.

The probe runs on the CPU in float64 whatever the default device and dtype; a model built on
the meta device (before ``fully_shard`` or a checkpoint load) converts, its replacements on meta
too; a verdict that came from an exception is not cached; a gated norm (``forward(h, gate)``)
is skipped with the reason instead of being replaced by a layer that drops the gate.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers.hf import tiny_causal_lm, tiny_config, token_batch, transformers
from lightning_mrs import MRSNorm, swap_norms


def _swapped_reference(**options) -> nn.Module:
    model = tiny_causal_lm("llama")
    swap_norms(model, **options)
    return model


def test_a_meta_model_converts_and_loads_the_weights_of_a_real_one():
    reference = _swapped_reference(target="mrs", qk_norm="mrs")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(tiny_config("llama"))
    report = swap_norms(model, "mrs", qk_norm="mrs")
    assert len(report.converted) == 5 and len(report.qk_added) == 4 and not report.skipped
    assert isinstance(model.model.norm, MRSNorm) and model.model.norm.weight.is_meta
    model.to_empty(device="cpu")
    model.load_state_dict(reference.state_dict(), strict=True)
    model.model.rotary_emb.inv_freq.copy_(reference.model.rotary_emb.inv_freq)  # a non-persistent buffer
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(token_batch()).logits, reference(token_batch()).logits)


@pytest.mark.parametrize("where", ["meta-context", "default-device", "default-dtype"])
def test_the_defaults_do_not_reach_the_probe(where):
    model = tiny_causal_lm("gemma")
    expected = _swapped_reference(target="mrs").state_dict()
    previous = torch.get_default_dtype()
    try:
        if where == "meta-context":
            with torch.device("meta"):
                report = swap_norms(model, "mrs")
        elif where == "default-device":
            torch.set_default_device("meta")
            report = swap_norms(model, "mrs")
        else:
            torch.set_default_dtype(torch.bfloat16)  # what transformers' from_pretrained(dtype=...) sets
            report = swap_norms(model, "mrs")
    finally:
        torch.set_default_device(None)
        torch.set_default_dtype(previous)
    assert len(report.converted) == 5 and not report.skipped
    assert not any(t.is_meta for t in model.state_dict().values())  # built where the old layers were
    assert expected.keys() == model.state_dict().keys()


class _FlakyNorm(nn.Module):
    """A norm whose forward fails once (a transient problem), then computes RMSNorm."""

    calls = 0

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(c)), 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        if type(self).calls == 1:
            raise RuntimeError("not yet")
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def test_a_verdict_from_an_exception_is_not_cached():
    model = nn.Sequential(nn.Linear(8, 8), _FlakyNorm())
    with pytest.warns(UserWarning, match="converted none"):
        first = swap_norms(model, "mrs")
    assert "forward fails" in first.skipped["1"]
    again = swap_norms(model, "mrs")
    assert again.converted == ["1"] and isinstance(model[1], MRSNorm)


def test_gated_norms_are_skipped_with_the_reason_and_the_model_runs():
    model = tiny_causal_lm("bamba", mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=1, attn_layer_indices=[1])
    report = swap_norms(model, "mrs")
    gated = [n for n, m in model.named_modules() if type(m).__name__.endswith("RMSNormGated")]
    assert gated and set(gated) <= set(report.skipped)
    assert all(report.skipped[n].startswith("its forward takes more than the input (gate)") for n in gated)
    assert report.converted  # the plain RMSNorms of the same model are converted
    with torch.no_grad():
        assert torch.isfinite(model(token_batch()).logits).all()
    with pytest.raises(ValueError, match="gated norm"):
        swap_norms(tiny_causal_lm("bamba", mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=1,
                                  attn_layer_indices=[1]), "mrs", strict=True)
