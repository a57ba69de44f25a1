"""``benchmarks/bench_compiled_norm.py`` (and ``bench_lm_step.py``'s ``mrs-python-ops``): each row
times the compiled path it names - the C++ operators, or a Python operator body around them - not the other."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from helpers import ROOT

from helpers.checks import needs_cpp

sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_compiled_norm as bench  # noqa: E402 - the benchmark under test

pytestmark = needs_cpp

ROWS = ["mrs_norm_bwd", "mrs_norm_fwd"]
GENERAL = ["mrs_norm_bwd", "mrs_norm_bwd_fallback", "mrs_norm_fwd", "mrs_norm_fwd_fallback"]  # the body calls them


def test_each_row_runs_the_ops_it_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "compiled.json"
    argv = ["--shapes", "decode_1x128", "--rounds", "2", "--calls", "2", "--json", str(out)]
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    assert "decode_1x128 float32 train" in printed and "x nn.RMSNorm compiled" in printed
    data = json.loads(out.read_text())
    assert data["decode_1x128 float32 train"]["ops"]["MRSNorm compiled"] == ROWS
    assert data["decode_1x128 float32 train"]["ops"]["MRSNorm compiled, Python ops"] == GENERAL
    assert data["decode_1x128 float32 inference"]["ops"]["MRSNorm compiled"] == ["mrs_norm_fwd"]
    assert data["decode_1x128 float32 inference"]["ops"][bench.DENOMINATOR] == []
    for key in data:
        assert all(t > 0 for t in data[key]["median_s"].values())


def test_the_lm_steps_python_ops_variant_traces_the_fallback_pair() -> None:
    pytest.importorskip("transformers")
    import bench_lm_step

    tokens = torch.randint(0, 256, (2, 8))
    seen = {}
    for variant in ("mrs", "mrs-python-ops"):
        model, how = bench_lm_step.build(variant, layers=1, width=32, seq=8)
        forward = torch.compile(model.forward, fullgraph=True)

        def step() -> None:
            forward(input_ids=tokens, labels=tokens).loss.backward()

        step()  # traced here
        seen[variant] = bench.lightning_ops(step)
    assert seen == {"mrs": ROWS, "mrs-python-ops": GENERAL}


def test_groups_do_not_add_up_to_dynamo_s_recompile_limit() -> None:
    # every (shape, dtype, mode) group compiles MRSNorm.forward twice (two of its rows); 3 dtypes x
    # 2 modes ran past the limit of 8 and stopped the benchmark. With a limit of 2, two groups do.
    argv = ["--shapes", "decode_1x128", "--modes", "inference", "--dtype", "float32", "bfloat16",
            "--rounds", "1", "--calls", "1"]
    with torch._dynamo.config.patch(recompile_limit=2):  # config.patch: an alias-safe setting
        assert bench.main(argv) == 0
