"""``benchmarks/machine.py``: the CPU line every CPU benchmark prints first (model, ISA flags,
threads, how the C++ kernels were built)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import machine  # noqa: E402 - the benchmark helper under test

from lightning_mrs.ops import cpu_kernels  # noqa: E402


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
    if cpu_kernels.available():
        assert f"{cpu_kernels.loaded_kernels()} kernels (kernel set {cpu_kernels.kernel_set()})" in machine.cpu_line()


def test_a_kernel_set_that_cannot_build_is_a_parser_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    @contextmanager
    def using(name: str) -> Iterator[None]:
        raise RuntimeError(f"{name} needs a CPU with AVX2, FMA and F16C")
        yield

    monkeypatch.setattr(cpu_kernels, "using", using)
    parser = argparse.ArgumentParser(prog="bench")
    with pytest.raises(SystemExit) as exit_:
        machine.check_kernel_sets(parser, ["avx2"])
    assert exit_.value.code == 2
    assert "--cpu-kernels avx2: avx2 needs a CPU with AVX2, FMA and F16C" in capsys.readouterr().err
    machine.check_kernel_sets(parser, [])  # nothing asked: nothing built, no error
