"""What machine a benchmark ran on, for its first lines: the CPU's model, the instruction sets the
kernels care about, cores and threads, and how the C++ kernels were built (``-march=native`` or
the portable flags). A CPU ratio means little without them: the kernels vectorise with AVX2 or
AVX-512, and convert float16 with F16C where the build may use it."""

from __future__ import annotations

import argparse
import os
import platform
from collections.abc import Iterable
from pathlib import Path

import torch

__all__ = ["ISA_FLAGS", "check_kernel_sets", "cpu_line", "isa"]

#: the /proc/cpuinfo flags printed (the SIMD widths and the half-precision conversions)
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "amx_bf16")


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty off Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def isa(fields: dict[str, str] | None = None) -> list[str]:
    """The :data:`ISA_FLAGS` this CPU has (``no avx512f`` etc. for those it lacks)."""
    flags = set((fields if fields is not None else _cpuinfo()).get("flags", "").split())
    return [f if f in flags else f"no {f}" for f in ISA_FLAGS[:4]] + [f for f in ISA_FLAGS[4:] if f in flags]


def cpu_line() -> str:
    """``CPU: <model>; <ISA flags>; <cores> cores, <threads> torch threads; C++ kernels: <flags>``."""
    from lightning_mrs.ops import cpu_kernels

    fields = _cpuinfo()
    model = fields.get("model name") or platform.processor() or platform.machine()
    built = cpu_kernels.build_flags() if cpu_kernels.available() else None
    if built:
        how = "-march=native" if "-march=native" in built else "portable (no -march)"
        kernels = f"{how}, {cpu_kernels.loaded_kernels()} kernels (kernel set {cpu_kernels.kernel_set()})"
    else:
        kernels = f"not built ({cpu_kernels.build_error()})"
    return (f"CPU: {model}; {' '.join(isa(fields)) or 'ISA flags unknown'}; {os.cpu_count()} cores, "
            f"{torch.get_num_threads()} torch threads; C++ kernels {kernels}")


def check_kernel_sets(parser: argparse.ArgumentParser, names: Iterable[str]) -> None:
    """Build each C++ kernel set of a ``--cpu-kernels`` option now: one that cannot be built here
    is a parser error that says why, before the first case runs."""
    from lightning_mrs.ops import cpu_kernels

    for name in names:
        try:
            with cpu_kernels.using(name):
                pass
        except RuntimeError as err:
            parser.error(f"--cpu-kernels {name}: {err}")
