"""``benchmarks/bench_cpu_kernels.py``: it times the op's own kernels and ATen's norms, each pass apart."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn.functional as F

from helpers import ROOT
from helpers.checks import needs_cpp

sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_cpu_kernels as bench  # noqa: E402 - the benchmark under test

from lightning_mrs import mrs_norm  # noqa: E402
from lightning_mrs.ops import cpu_kernels, library  # noqa: E402

# small stand-ins for the benchmark's cases: (shape, the op's channel_dim, spatial, peer)
TINY = {
    "rows": ((6, 10), 1, False, "layer_norm"),
    "spatial": ((3, 6, 4, 5), 1, True, "group_norm"),
}


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(TINY))
def test_the_timed_calls_are_the_op_and_atens_norm(case: str, dtype: torch.dtype) -> None:
    shape, channel_dim, spatial, peer = TINY[case]
    x, g = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    ours = bench.ours(x, g, channel_dim, spatial)
    # ours: the forward and the input gradient of the op (through autograd) with a weight of ones
    xr = x.detach().requires_grad_()
    y = mrs_norm(xr, torch.ones(shape[channel_dim] // 2, dtype=dtype), channel_dim=channel_dim, spatial=spatial)
    y.backward(g)
    torch.testing.assert_close(ours["fwd"]()[0].view(shape), y, atol=0, rtol=0)
    torch.testing.assert_close(ours["bwd"]()[0].view(shape), xr.grad, atol=0, rtol=0)
    # ATen's: what nn.LayerNorm / nn.GroupNorm(1, C) compute
    theirs = bench.aten(x, g, peer)
    xr = x.detach().requires_grad_()
    c = shape[channel_dim]
    w, b = torch.ones(c, dtype=dtype), torch.zeros(c, dtype=dtype)  # the modules' initial affine parameters
    ref = F.layer_norm(xr, (c,), w, b, bench.EPS) if peer == "layer_norm" else F.group_norm(xr, 1, w, b, bench.EPS)
    ref.backward(g)
    torch.testing.assert_close(theirs["fwd"]()[0], ref, atol=0, rtol=0)
    torch.testing.assert_close(theirs["bwd"]()[0], xr.grad, atol=0, rtol=0)


@needs_cpp
def test_rows_per_pass_and_kernel_set_each_timed_on_its_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "CASES", {"tiny": TINY["spatial"]})
    seen: list[tuple[str, str | None]] = []  # (pass, the kernels it ran on)
    real_fwd, real_bwd = library.FWD, library.BWD
    monkeypatch.setattr(library, "FWD", lambda *a: seen.append(("fwd", cpu_kernels.loaded_kernels())) or real_fwd(*a))
    monkeypatch.setattr(library, "BWD", lambda *a: seen.append(("bwd", cpu_kernels.loaded_kernels())) or real_bwd(*a))
    rows = bench.run_case("tiny", torch.float32, repeats=2, inner=1, kernel_sets=("generic",))
    by = {(r["impl"], r["pass"]): r for r in rows}
    impls = ["MRSNorm cpp", "aten group_norm", "MRSNorm cpp [generic]"]
    assert list(by) == [(i, p) for i in impls for p in ("fwd", "bwd", "f+b")]
    for p in ("fwd", "bwd", "f+b"):
        assert by[("aten group_norm", p)]["time_ratio"] == 1.0 and by[("aten group_norm", p)]["min_time_ratio"] == 1.0
    for i in impls:
        assert by[(i, "f+b")]["ms"] == pytest.approx(by[(i, "fwd")]["ms"] + by[(i, "bwd")]["ms"])
    # the [generic] rows ran on the generic loops (setup forward, warm-up and 2 rounds), the others on the default
    default = cpu_kernels.loaded_kernels()
    assert seen.count(("fwd", "generic")) == 4 and seen.count(("bwd", "generic")) == 3
    assert {k for _, k in seen} == {default, "generic"} or default == "generic"


def test_an_unknown_kernel_set_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--cpu-kernels", "avx512"])
    assert "invalid choice: 'avx512'" in capsys.readouterr().err


@needs_cpp
def test_main_prints_the_cpu_and_a_row_per_pass_and_keeps_the_figures(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    monkeypatch.setattr(bench, "CASES", {"tiny": TINY["rows"][:4]})
    out = tmp_path / "k.json"
    assert bench.main(["--cases", "tiny", "--dtype", "bfloat16", "--repeats", "2", "--inner", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "CPU: " in printed and "kernel set auto" in printed
    assert sum(line.startswith("tiny") for line in printed.splitlines()) == 6  # 2 impls x (fwd, bwd, f+b)
    assert [(r["impl"], r["pass"]) for r in json.loads(out.read_text())["results"]][:3] == [
        ("MRSNorm cpp", "fwd"), ("MRSNorm cpp", "bwd"), ("MRSNorm cpp", "f+b")]
