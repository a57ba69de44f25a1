"""The half-precision norms inside real mixed precision (P1m) and 16-true with float32 master weights (P1t):
a couple of steps per arm, and the norm really computed in float16 inside 16-mixed."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from lightning_mrs.swap.half import RMSNormHalf
from recipes.sweeps.runner import run
from recipes.sweeps.cells.half_inputs import HalfInputs
from recipes.sweeps.cells.master_weights import FP32MasterAdamW

TINY = ["--lrs", "0.01", "--seeds", "0", "--max-steps", "2", "--log-every", "1", "--jobs", "1", "--mrs-backend",
        "eager", "--arch-kwargs", '{"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, '
        '"num_key_value_heads": 2, "intermediate_size": 32}']


def test_quick_cells_compute_the_norms_in_float16_inside_16_mixed(tmp_path: Path) -> None:
    arms = ["rms-half-fp16", "mrs-half-safe-fp16", "mrs-half-safe-fp16-master"]
    assert run(["--sweep", "lm", "--lm-arms", *arms, *TINY, "--out", str(tmp_path)]) == 0
    cells = {a: json.loads((tmp_path / "cells" / f"lm-{a}_lr0.01_bs16_seed0.json").read_text()) for a in arms}
    for arm in arms[:2]:
        seen = cells[arm]["norm_input_dtypes"]  # every forward of every half norm, training and validation
        assert cells[arm]["precision"] == "16-mixed" and list(seen) == ["torch.float16"] and seen["torch.float16"] > 0
    assert cells[arms[2]]["precision"] == "16-true+fp32-master" and "norm_input_dtypes" not in cells[arms[2]]


def test_half_inputs_cast_only_under_float16_autocast() -> None:
    model = nn.Sequential(nn.Linear(4, 4), RMSNormHalf(4))
    inputs = HalfInputs(model)
    model(torch.randn(2, 4))  # no autocast: float32, as computed
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(2, 4))  # Linear -> bfloat16: left as it is
    with torch.autocast("cpu", dtype=torch.float16):
        y = model[1](torch.randn(2, 4))  # a float32 input, as the residual stream gives it
    assert dict(inputs.seen) == {"torch.float32": 1, "torch.bfloat16": 1, "torch.float16": 1}
    assert y.dtype == torch.float16
    inputs.remove()
    assert not model[1]._forward_pre_hooks


def test_master_weights_step_in_float32_against_adamw_on_float32_weights() -> None:
    """The master-weight step equals AdamW on a float32 copy fed the same (float16) gradient, rounded to float16."""
    torch.manual_seed(0)
    ref = nn.Linear(3, 2)
    model = nn.Linear(3, 2).half()
    model.load_state_dict({k: v.half() for k, v in ref.state_dict().items()})
    master = FP32MasterAdamW([{"params": list(model.parameters())}], lr=0.1, max_grad_norm=None, weight_decay=0.0)
    plain = torch.optim.AdamW([p for p in ref.parameters()], lr=0.1, weight_decay=0.0)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.half().float())
    for _ in range(3):
        x = torch.randn(4, 3)
        model(x.half()).float().sum().backward()
        for p, q in zip(ref.parameters(), model.parameters()):
            p.grad = q.grad.float()
        master.step()
        plain.step()
        master.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        for p, q in zip(ref.parameters(), model.parameters()):
            assert torch.equal(q, p.detach().half())  # the model holds the float32 result rounded
    assert all(s["exp_avg"].dtype == torch.float32 for s in master.state.values())
