"""``benchmarks/machine.py``: the CPU line every CPU benchmark prints first (model, ISA flags,
threads, how the C++ kernels were built)."""

from __future__ import annotations

import sys

import torch

from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import machine  # noqa: E402 - the benchmark helper under test


def test_isa_names_what_the_cpu_has_and_lacks() -> None:
    avx2 = {"flags": "fpu sse2 avx avx2 fma f16c"}
    assert machine.isa(avx2) == ["avx2", "fma", "f16c", "no avx512f"]
    avx512 = {"flags": "avx2 fma f16c avx512f avx512bw avx512_bf16"}
    assert machine.isa(avx512) == ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16"]


def test_cpu_line_names_the_model_threads_and_the_build() -> None:
    line = machine.cpu_line()
    assert line.startswith("CPU: ") and f"{torch.get_num_threads()} torch threads" in line
    assert "C++ kernels " in line and ("avx2" in line or "ISA flags unknown" in line)


def test_cpu_line_names_the_kernels_that_run() -> None:
    from lightning_mrs.ops import cpu_kernels

    if cpu_kernels.available():
        assert f"{cpu_kernels.loaded_kernels()} kernels (kernel set {cpu_kernels.kernel_set()})" in machine.cpu_line()
