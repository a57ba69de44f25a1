"""P1t's controls (issue 56): the output-scale arms against float64 maths, the per-layer residual trace against
transformers' own hidden states, the pure-bf16 arm, and AdamW's eps warning only where the optimizer state is float16."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_mrs import swap_norms
from lightning_mrs.swap.half import MRSNormHalfSafe, RMSNormHalfSafe
from recipes.sweeps.cells.residual_trace import ResidualTrace
from recipes.sweeps.output_scale import OUTPUT_RMS, gain_factor, scale_gains, split_gain
from recipes.sweeps.runner import run

TINY = ["--lrs", "0.01", "--seeds", "0", "--max-steps", "2", "--log-every", "1", "--jobs", "1", "--mrs-backend",
        "eager", "--arch-kwargs", '{"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, '
        '"num_key_value_heads": 2, "intermediate_size": 32}']


def _output_rms(x: torch.Tensor, family: str) -> float:
    """The per-channel output RMS of unit-gain RMSNorm / MRSNorm, in float64 from the formulas (docs/method.md)."""
    if family == "rms":
        y = x / x.pow(2).mean(-1, keepdim=True).sqrt()
    else:
        pairs = x.unflatten(-1, (-1, 2))  # (N, C/2, 2)
        y = x / pairs.pow(2).sum(-1).sqrt().mean(-1, keepdim=True)
    return float(y.pow(2).mean().sqrt())


def test_gain_factor_is_the_ratio_of_the_formulas_gaussian_output_rms_in_float64() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 4096, dtype=torch.float64, generator=g)  # wide: the large-C limit the factor states
    rms, mrs = _output_rms(x, "rms"), _output_rms(x, "mrs")
    assert rms == pytest.approx(1.0, abs=1e-12)
    assert mrs == pytest.approx(OUTPUT_RMS["mrs"], abs=2e-4) and OUTPUT_RMS["mrs"] == pytest.approx(0.7979, abs=1e-4)
    assert gain_factor("rms-half-safe-as-mrs") == pytest.approx(mrs / rms, abs=2e-4)
    assert gain_factor("mrs-half-safe-as-rms") == pytest.approx(rms / mrs, abs=3e-4)
    assert gain_factor("mrs-half-safe") == 1.0 and split_gain("rms-half-as-mrs") == ("rms-half", "mrs")
    # at this model's width (32) a little below the limit, as the docs say
    assert _output_rms(torch.randn(50000, 32, dtype=torch.float64, generator=g), "mrs") == pytest.approx(0.793, abs=2e-3)
    with pytest.raises(ValueError, match="no output scale for the family 'layer'"):
        gain_factor("layer-as-mrs")


def test_scaled_rms_half_safe_has_mrsnorm_output_scale_on_gaussian_inputs() -> None:
    model = torch.nn.Sequential(RMSNormHalfSafe(4096), MRSNormHalfSafe(4096)).double()
    assert scale_gains(model[:1], (RMSNormHalfSafe,), gain_factor("rms-half-safe-as-mrs")) == 1
    x = torch.randn(200, 4096, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        scaled_rms, mrs = model[0](x).pow(2).mean().sqrt(), model[1](x).pow(2).mean().sqrt()
    assert float(scaled_rms) == pytest.approx(float(mrs), rel=1e-3)
    with pytest.raises(ValueError, match="no norm of types"):
        scale_gains(torch.nn.Linear(2, 2), (RMSNormHalfSafe,), 2.0)


def _llama(layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=layers, num_attention_heads=2,
                                        num_key_value_heads=2, intermediate_size=32))


def test_residual_trace_is_transformers_hidden_states_and_names_the_first_overflowing_layer() -> None:
    model = _llama(3).half()
    trace = ResidualTrace(model)
    assert trace.points == ["L0.attn", "L0.mlp", "L1.attn", "L1.mlp", "L2.attn", "L2.mlp", "final", "logits"]
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.enable_grad():
        out = model(ids, output_hidden_states=True)  # hidden_states[i]: the input of layer i (the last one is normed)
    for i in range(3):
        assert trace.steps[0][f"L{i}.attn"] == float(out.hidden_states[i].detach().abs().amax())
    assert trace.steps[0]["logits"] == float(out.logits.detach().abs().amax()) and trace.first_nonfinite is None
    trace.step = 1
    with torch.no_grad():
        attention = model.model.layers[1].self_attn
        attention.v_proj.weight.fill_(100.0)  # |v| ~ 16 x 100 x 1 (the normed input)
        attention.o_proj.weight.fill_(100.0)  # the attention output ~ 16 x 100 x |v|: beyond float16's 65504
    model(ids)
    assert trace.first_nonfinite == (1, "L1.mlp")
    assert all(math.isfinite(trace.steps[1][p]) for p in ("L0.attn", "L0.mlp", "L1.attn"))
    trace.step = 2
    model(ids)
    assert 2 not in trace.steps  # nothing after the first non-finite step
    with torch.no_grad():
        model(ids)  # a validation forward: not recorded
    rows = trace.rows(every=10, last=1)
    assert {r["step"] for r in rows} == {0, 1} and len(rows) == 2 * len(trace.points)
    trace.remove()


def test_as_and_bf16_master_arms_train_and_the_eps_warning_is_for_float16_optimizer_state_only(
        tmp_path: Path) -> None:
    arms = ["rms-half-safe-as-mrs-fp16-master", "mrs-half-safe-as-rms-bf16-master"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert run(["--sweep", "lm", "--lm-arms", *arms, *TINY, "--out", str(tmp_path)]) == 0
    assert not [w for w in caught if "AdamW's eps" in str(w.message)]  # its state is float32 (the masters')
    cells = {a: json.loads((tmp_path / "cells" / f"lm-{a}_lr0.01_bs16_seed0.json").read_text()) for a in arms}
    assert cells[arms[0]]["precision"] == "16-true+fp32-master"
    assert cells[arms[1]]["precision"] == "bf16-true+fp32-master"
    for cell in cells.values():
        assert {r["point"] for r in cell["growth"]} == {"L0.attn", "L0.mlp", "final", "logits"}
        assert {r["step"] for r in cell["growth"]} == {0, 1}


def test_gains_of_an_as_arm_start_at_the_factor() -> None:
    from recipes.sweeps.cells.lm import _norm_types

    model = _llama()
    swap_norms(model, "rms-half-safe")
    assert scale_gains(model, _norm_types("rms-half-safe"), gain_factor("rms-half-safe-as-mrs")) == 5  # 2 x 2 + final
    weights = [m.weight for m in model.modules() if isinstance(m, RMSNormHalfSafe)]
    assert all(torch.equal(w, torch.full_like(w, math.sqrt(2 / math.pi))) for w in weights)
