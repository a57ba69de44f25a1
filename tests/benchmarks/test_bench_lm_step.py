"""``benchmarks/bench_lm_step.py``: it times the model it says it times, and ``--split`` times the
phases of the same steps (forward with the loss, backward, optimizer) without counting any twice."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from helpers import ROOT

pytest.importorskip("transformers")
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_lm_step as bench  # noqa: E402 - the benchmark under test

TINY = ["--layers", "1", "--width", "32", "--batch", "2", "--seq", "8", "--rounds", "2", "--steps", "1"]


def test_the_mrs_variant_has_no_llama_norm_left() -> None:
    model, how = bench.build("mrs", layers=1, width=32, seq=8)
    kinds = {type(m).__name__ for m in model.modules()}
    assert "LlamaRMSNorm" not in kinds and "MRSNorm" in kinds
    assert how.startswith("3 x MRSNorm")  # 2 per layer and the final norm


def test_split_phases_are_within_their_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "lm.json"
    assert bench.main([*TINY, "--variants", "llama", "mrs", "--split", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "per phase" in printed and "forward" in printed
    data = json.loads(out.read_text())
    for v in ("llama", "mrs"):
        phases = data["phase_median_s"][v]
        assert len(phases) == 3 and all(t > 0 for t in phases)
        # one step per round: each round's phases are parts of that round's step, so the
        # medians of the phases add up to at most the slowest step
        assert sum(phases) <= max(data["all_s"][v])
    # the paired ratios: per round, against the same round's llama step
    assert data["paired_ratio_interval"]["llama"] == [1.0, 1.0, 1.0]
    ratios = [t / b for t, b in zip(data["all_s"]["mrs"], data["all_s"]["llama"])]
    med, lo, hi = data["paired_ratio_interval"]["mrs"]
    assert med == pytest.approx(sorted(ratios)[0] / 2 + sorted(ratios)[1] / 2)  # two rounds
    assert min(ratios) <= lo <= med <= hi <= max(ratios)
    assert "paired x" in printed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtype_builds_every_variant_in_it(dtype: torch.dtype) -> None:
    for variant in ("llama", "mrs"):
        model, _ = bench.build(variant, layers=1, width=32, seq=8, dtype=dtype)
        assert {p.dtype for p in model.parameters()} == {dtype}  # the swapped norms' weights too
        logits = model(input_ids=torch.randint(0, 256, (2, 8))).logits
        assert logits.dtype == dtype and torch.isfinite(logits).all()
