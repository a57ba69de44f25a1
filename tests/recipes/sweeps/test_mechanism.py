"""The ``lm`` sweep's mechanism stress: the evaluation of one model with a planted channel (against the model
cast to float16 by hand and the float16 arithmetic of the norms), and claim M on hand-made tables."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

from recipes.sweeps.claims import engine as sc
from recipes.sweeps.claims.mechanism import (ARMS, BROKEN_SHARE, CLEAN_SHARE, MAGNITUDES, MARGIN_BPB, MECHANISM_LR,
                                             NAIVE, claims, figure, legacy, lines)
from recipes.sweeps.cells.mechanism_eval import mechanism_rows
from recipes.sweeps.score import DIVERGED_BPB

TINY = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
        "intermediate_size": 32}


def _lm(norm: str) -> Any:
    from recipes.text.byte_lm import ByteLM

    torch.manual_seed(0)
    return ByteLM(arch="llama", config=TINY, norm=norm, seq_len=16, sample_bytes=0)


@pytest.mark.parametrize("norm", ["rms", "mrs"])
def test_one_model_planted_in_float16(norm: str) -> None:
    lm = _lm(norm)
    windows = torch.randint(0, 256, (3, 17))  # (W, T + 1) bytes
    before = {k: v.clone() for k, v in lm.state_dict().items()}
    rows = mechanism_rows(lm.model, windows, norm, {"lr": 0.01, "batch_size": 16, "seed": 0})
    assert [(r["arm"], r["magnitude"]) for r in rows] == [(a, m) for a in (norm, f"{norm}-half", f"{norm}-half-safe")
                                                          for m in (0.0, *MAGNITUDES)]
    # the model is not touched: same weights, float32, no hook left
    assert all(torch.equal(v, before[k]) for k, v in lm.state_dict().items())
    assert next(lm.parameters()).dtype == torch.float32
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in lm.modules())
    norms = 2 * TINY["num_hidden_layers"] + 1  # input and post-attention norm per layer, the final norm
    assert {r["norm_tokens"] for r in rows} == {norms * 3 * 16}
    # nothing planted: the bpb of the model cast to float16 by hand
    with torch.no_grad():
        logits = lm.model.half()(input_ids=windows[:, :-1], use_cache=False).logits
    reference = F.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten()).item() / math.log(2)
    unplanted = [r for r in rows if r["magnitude"] == 0]
    assert [r["val_bpb"] for r in unplanted] == [pytest.approx(reference, abs=5e-3)] * 3
    for r in rows:
        # x^2 formed in float16 overflows from 256, RMSNorm and MRSNorm alike (rsqrt(Inf) = 0, x / Inf = 0: every
        # token zero); the safe arms and the shipped norms never break up to 2^15
        broken = r["arm"] in NAIVE and r["magnitude"] >= 256
        assert r["bad_frac"] == (1.0 if broken else 0.0) == r["zero_frac"] and r["nonfinite_frac"] == 0.0, r
        if broken:  # every norm output zero: the logits are the LM head's zero, a uniform guess over 256 bytes
            assert r["val_bpb"] == pytest.approx(DIVERGED_BPB, abs=1e-3)


# ----------------------------------------------------------------------------- claim M on hand-made tables
Fn = Callable[[str, float, int], tuple[float, float]]  # (arm, magnitude, seed) -> (bad share, bpb)


def _paper(arm: str, m: float, seed: int) -> tuple[float, float]:
    """What the arithmetic says: both naive arms break (all-zero outputs, 8 bpb) from 256 on; everything else stays."""
    if arm in NAIVE and m >= 256:
        return 1.0, DIVERGED_BPB
    return 0.0, 4.0 + 0.01 * seed + (0.001 * seed if "half" in arm else 0.0)


def _table(fn: Fn = _paper, seeds: tuple[int, ...] = (0, 1, 2), lr: float = MECHANISM_LR) -> list[dict[str, Any]]:
    rows = []
    for seed in seeds:
        for arm, norm in ARMS.items():
            for m in (0.0, *MAGNITUDES):
                bad, bpb = fn(arm, m, seed)
                rows.append({"norm": norm, "arm": arm, "lr": lr, "batch_size": 16.0, "seed": float(seed),
                             "magnitude": m, "val_bpb": bpb, "bad_frac": bad, "nonfinite_frac": 0.0, "zero_frac": bad,
                             "norm_tokens": 100.0})
    return rows


def _m(rows: list[dict[str, Any]]) -> sc.Claim:
    (claim,) = claims(rows)
    return sc.evaluate(claim)


def test_claim_m_supported_as_the_maths_says() -> None:
    claim = _m(_table())
    assert claim.verdict == "supported" and claim.why == "all 12 comparisons supported"
    (_, broken), _, (_, cost) = claim.outcomes
    assert broken[0].interval.estimate == 1.0 and cost[0].interval.estimate == pytest.approx(DIVERGED_BPB - 4.01)


@pytest.mark.parametrize("fn,verdict", [
    # the safe arms break too: contradicted
    (lambda a, m, s: (1.0, DIVERGED_BPB) if "half" in a and m >= 256 else (0.0, 4.0 + 0.01 * s), "contradicted"),
    # nothing breaks: the naive arms are not broken at 256
    (lambda a, m, s: (0.0, 4.0 + 0.01 * s), "contradicted"),
    # the paper's reading: the naive MRSNorm survives where the naive RMSNorm breaks: contradicted
    (lambda a, m, s: _paper(a, m, s) if a != "mrs-half" else (0.0, 4.0 + 0.01 * s), "contradicted"),
    # mrs-half-safe costs 0.05 bpb more than mrs, above the margin, on one seed only: inconclusive
    (lambda a, m, s: _paper(a, m, s) if a != "mrs-half-safe" else (0.0, 4.0 + 0.01 * s + (0.1, 0.0, 0.0)[s]),
     "inconclusive"),
])
def test_claim_m_contradicted_and_inconclusive(fn: Fn, verdict: str) -> None:
    assert _m(_table(fn)).verdict == verdict


def test_a_nan_bpb_counts_as_a_uniform_guess_and_missing_models_leave_it_inconclusive() -> None:
    nan = _table(lambda a, m, s: (1.0, math.nan) if a in NAIVE and m >= 256 else _paper(a, m, s))
    assert _m(nan).outcomes[2][1][0].interval.estimate == pytest.approx(DIVERGED_BPB - 4.01)
    elsewhere = _m(_table(lr=0.1))  # no fp32 model at MECHANISM_LR
    assert elsewhere.verdict == "inconclusive" and "no fp32 model at lr 0.01" in elsewhere.why + str(
        [o.comparison.reason for _, g in elsewhere.outcomes for o in g])
    assert _m(_table(seeds=(0,))).verdict == "inconclusive"
    assert (BROKEN_SHARE, CLEAN_SHARE, MARGIN_BPB) == (0.5, 0.01, 0.03)  # the thresholds the report states


def test_figure_and_table_lines(tmp_path: Path) -> None:
    bad, bpb = figure(_table(), tmp_path / "m.png")
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    curves = {line.get_label(): list(line.get_ydata()) for line in bad.get_lines() if line.get_label()[0] != "_"}
    assert curves["rms-half"] == curves["mrs-half"] == [0.0] * 5 + [1.0] * 8
    assert curves["rms-half-safe"] == curves["mrs-half-safe"] == [0.0] * 13
    text = lines(_table())
    assert "| 256 | 0 / 4.010 | 0 / 4.010 | 1 / 8.000 | 1 / 8.000 | 0 / 4.011 | 0 / 4.011 |" in text


def test_a_table_written_before_the_safe_arms_reads_its_mrs_half_as_the_hypot_one() -> None:
    """Before the safe arms, mechanism.csv's ``mrs-half`` was MRSNorm by hypot (today's ``mrs-half-safe``, which
    never broke): read as the naive MRSNorm it would contradict claim M; it is renamed, and the naive arms it did
    not have leave the claim inconclusive (missing), not contradicted."""
    old = [r for r in _table(lambda a, m, s: (0.0, 4.0 + 0.01 * s) if a == "mrs-half" else _paper(a, m, s))
           if r["arm"] in ("rms", "mrs", "rms-half", "mrs-half")]
    renamed = legacy(old)
    assert {r["arm"] for r in renamed} == {"rms", "mrs", "rms-half", "mrs-half-safe"}
    assert legacy(_table()) == _table()  # a table with the safe arms is read as it is
    claim = _m(old)
    assert claim.verdict == "inconclusive" and claim.why == "7 of 12 comparisons supported, 5 not (5 x too few seeds)"
    broken = {o.comparison.label: o.verdict for o in claim.outcomes[0][1]}
    assert broken == {"batch 16: rms-half, smallest share over m >= 256": "supported",
                      "batch 16: mrs-half, smallest share over m >= 256": "inconclusive"}
