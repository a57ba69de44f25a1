"""``benchmarks/bench_norm.py --cpu-kernels``: a row per named C++ kernel set, each timed on that set."""

from __future__ import annotations

import sys
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from helpers import ROOT
from helpers.checks import needs_cpp

sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_norm  # noqa: E402 - the benchmark under test

from lightning_mrs import MRSNorm  # noqa: E402
from lightning_mrs.ops import cpu_kernels, library  # noqa: E402


@needs_cpp
def test_each_kernel_set_row_runs_on_its_set(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []  # the kernels each forward of the default module ran on
    real = library.FWD  # the forward operator (its C++ kernels) that the autograd Function calls

    def spy(*args, **kwargs):
        seen.append(cpu_kernels.loaded_kernels())
        return real(*args, **kwargs)

    monkeypatch.setattr(library, "FWD", spy)
    entered: list[str] = []
    real_using = cpu_kernels.using

    @contextmanager
    def using(name: str):
        entered.append(name)
        with real_using(name):
            yield

    monkeypatch.setattr(cpu_kernels, "using", using)
    factories = {"MRSNorm (default)": lambda: MRSNorm(64), "nn.LayerNorm": lambda: nn.LayerNorm(64)}
    res = bench_norm.run_case("tiny", (300, 64), factories, "nn.LayerNorm", repeats=2, inner=1,
                              dtype=torch.float32, kernel_sets=("generic",))
    rows = {r["impl"]: r for r in res["rows"]}
    assert set(rows) == {"MRSNorm (default)", "nn.LayerNorm", "MRSNorm (default) [generic]"}
    assert all(r["ms"] > 0 for r in rows.values())
    # 3 warm-up steps and 2 timed ones on the set, and the saved-memory forward outside it
    assert entered == ["generic"] * 5
    assert seen.count("generic") >= 5 and cpu_kernels.loaded_kernels() in seen


def test_an_unknown_kernel_set_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_norm.main(["--cpu-kernels", "avx512", "--cases", "ln_8192x1024"])
    assert "invalid choice: 'avx512'" in capsys.readouterr().err
