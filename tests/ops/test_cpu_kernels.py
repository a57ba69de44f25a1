"""What is particular to the ``cpp`` backend (``lightning_mrs.ops.cpu_kernels``): the build
and its cache, the fallbacks when it cannot be built or is switched off, thread-count
independence and its own float -> bfloat16 rounding. Its results against the float64
reference are in ``test_backends.py``; what ``auto`` picks is in ``test_dispatch.py``.
"""

from __future__ import annotations

import functools
import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lightning_mrs import mrs_norm
from lightning_mrs.ops import cpp_build, cpu_kernels, dispatch, inductor_kernels, which_backend
from helpers.checks import LAYOUTS, check_against_reference, forced, grads, make_inputs, needs_cpp
from helpers.reference import mrs_norm_ref

pytestmark = needs_cpp


@pytest.fixture
def fresh_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """A process with no library loaded, no cached backend choice and an empty cache folder."""
    monkeypatch.setattr(cpu_kernels, "_STATE", {})  # the loaded library comes back after the test
    monkeypatch.setattr(cpu_kernels, "_SETS", {})
    monkeypatch.delenv("LIGHTNING_MRS_CPU_KERNEL_SET", raising=False)
    dispatch.clear_cache()
    monkeypatch.setenv("LIGHTNING_MRS_CACHE", str(tmp_path))
    yield tmp_path
    dispatch.clear_cache()  # choices made without the library must not outlive the test


def test_build_is_cached_on_disk_and_reused(fresh_build: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_kernels.available()
    built = list(fresh_build.iterdir())
    assert len(built) == 1 and built[0].name.startswith("mrs_norm_cpu_")  # no temp file left
    cpu_kernels._STATE.clear()  # a new process: must load, not compile again
    commands: list[list[str]] = []
    real_run = cpp_build.subprocess.run
    monkeypatch.setattr(cpp_build.subprocess, "run",
                        lambda cmd, **kw: commands.append(cmd) or real_run(cmd, **kw))
    assert cpu_kernels.available()
    assert commands and not any(str(cpu_kernels.SOURCE) in map(str, cmd) for cmd in commands)  # `c++ --version` only


@pytest.mark.slow  # a second C++ build (~19 s): the default suite keeps test_build_is_cached_on_disk_and_reused
def test_an_edited_header_is_a_new_build(
    fresh_build: Path, monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # every header the source includes, directly or not, is in the key: a library built from an older one must not load
    included, todo = set(), [cpu_kernels.SOURCE]
    while todo:
        for name in re.findall(r'^#include "([^"]+)"', todo.pop().read_text(), flags=re.M):
            if name not in included:
                included.add(name)
                todo.append(cpu_kernels.SOURCE.with_name(name))
    assert {h.name for h in cpu_kernels.HEADERS} == included == {"cpu_half.h", "cpu_rows.h", "cpu_sample.h", "cpu_avx2.h", "cpu_avx512.h"}
    headers = cpu_kernels.HEADERS
    assert cpu_kernels.available()
    seen = {p.name for p in fresh_build.iterdir()}
    for i, header in enumerate(headers):
        edited = tmp_path_factory.mktemp("edited") / header.name
        edited.write_text(header.read_text() + "\n// edited\n")
        monkeypatch.setattr(cpu_kernels, "HEADERS", (*headers[:i], edited, *headers[i + 1:]))
        cpu_kernels._STATE.clear()
        assert cpu_kernels.available()
        now = {p.name for p in fresh_build.iterdir()}
        assert len(now - seen) == 1, header.name
        seen = now


def test_no_compiler_falls_back_with_one_warning_and_a_clear_error(
    fresh_build: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpp_build, "compiler", lambda: None)
    # a cache of its own: the answer "no compiler" must not outlive the test
    monkeypatch.setattr(inductor_kernels, "_toolchain", functools.cache(inductor_kernels._toolchain.__wrapped__))
    x = torch.randn(16, 64)
    with pytest.warns(RuntimeWarning, match="building the one-pass CPU kernels failed"):
        assert which_backend(x) == "torch"  # small: no compile either
    assert "no C++ compiler" in cpu_kernels.build_error()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per process, not per call
        y = mrs_norm(x)
        with pytest.raises(ValueError, match=r"no C\+\+ compiler"):
            mrs_norm(x, backend="cpp")
        assert which_backend(x.bfloat16()) == "torch"  # a new key: still no second warning
    torch.testing.assert_close(y.double(), mrs_norm_ref(x), atol=2e-5, rtol=2e-5)


def test_env_switch_turns_the_kernels_off(fresh_build: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_MRS_CPU_KERNELS", "0")
    assert not cpu_kernels.available()
    assert "lib" not in cpu_kernels._STATE  # switched off: not even built
    assert which_backend(torch.randn(16, 64)) == "torch"
    with pytest.raises(ValueError, match="LIGHTNING_MRS_CPU_KERNELS=0"):
        mrs_norm(torch.randn(16, 64), backend="cpp")


@pytest.mark.slow  # a build of its own (~10 s of CPU)
def test_read_only_home_builds_in_the_temp_dir(
    fresh_build: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("LIGHTNING_MRS_CACHE")
    home_cache = tmp_path / "home_cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home_cache))
    real_access = os.access
    # a read-only home (root ignores chmod, so the permission check itself is simulated)
    monkeypatch.setattr(cpp_build.os, "access",
                        lambda p, mode: False if str(p).startswith(str(home_cache)) else real_access(p, mode))
    monkeypatch.setattr(cpp_build.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    assert cpp_build.cache_dir().parent == tmp_path / "tmp"
    assert cpu_kernels.available()
    assert list((tmp_path / "tmp").glob("lightning_mrs_*/mrs_norm_cpu_*.so"))


def _cpu_flags() -> set[str]:
    try:
        return {f for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
                for f in line.split(":", 1)[1].split()}
    except OSError:
        return set()


HAS_AVX2 = {"avx2", "fma", "f16c"} <= _cpu_flags()
needs_avx2 = pytest.mark.skipif(not HAS_AVX2, reason="the avx2 kernel set needs a CPU with AVX2, FMA and F16C")


@pytest.fixture(params=["generic", pytest.param("avx2", marks=needs_avx2)])
def one_kernel_family(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every dtype on the same kernels (``auto`` on AVX-512 mixes them: float16 on cpu_avx2.h's, the
    others on the generic loops), so that a half result can be compared bit for bit with float32's."""
    with cpu_kernels.using(request.param):
        yield request.param


# name -> (shape, channel_dim, spatial): one per C++ kernel (rows per position, rows per
# sample, NCHW per sample)
KERNELS = {
    "rows_per_position": ((5, 7, 64), -1, False),
    "rows_per_sample": ((3, 35, 64), -1, True),
    "nchw_per_sample": ((3, 64, 5, 7), 1, True),
    # rows wider than the kernels' block of 512 values (kBlock): several blocks, a short one
    "rows_per_position_wide": ((3, 2, 2 * 1024 + 6), -1, False),
    "rows_per_sample_wide": ((2, 3, 1024 + 2), -1, True),
    # rows of positions longer than a block (float16 goes through it): 621 = 512 + 109
    "nchw_per_sample_wide": ((2, 4, 23, 27), 1, True),
}


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_results_do_not_depend_on_the_thread_count(kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    shape, channel_dim, spatial = KERNELS[kernel]
    x, w, gy = make_inputs(shape, channel_dim, None, torch.float32)
    cpp = forced("cpp", channel_dim, spatial)
    before, per_thread = torch.get_num_threads(), cpu_kernels.min_numel_per_thread(1)  # small inputs on every thread
    try:
        torch.set_num_threads(1)
        one = grads(cpp, x, w, gy)
        torch.set_num_threads(max(3, before))  # 3: groups split unevenly over the threads
        many = grads(cpp, x, w, gy)
    finally:
        torch.set_num_threads(before)
        cpu_kernels.min_numel_per_thread(per_thread)
    torch.testing.assert_close(one[0], many[0], atol=0, rtol=0)  # each group summed in one order
    torch.testing.assert_close(one[1], many[1], atol=0, rtol=0)
    torch.testing.assert_close(one[2], many[2], atol=1e-5, rtol=1e-5)  # dw: per-thread partial sums


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernel", ["rows_per_position_wide", "rows_per_sample_wide", "nchw_per_sample_wide"])
def test_rows_wider_than_a_block_match_the_reference(kernel: str, dtype: torch.dtype) -> None:
    # the kernels run a block of values at a time: S, c and the weight gradient gathered
    # over every block, the weight read at each block's offset, the short last block
    shape, channel_dim, spatial = KERNELS[kernel]
    check_against_reference("cpp", (shape, channel_dim, spatial, None), dtype)


def test_small_inputs_run_on_one_thread_and_large_ones_on_all() -> None:
    assert cpu_kernels.threads(2048) == 1
    assert cpu_kernels.threads(2**30) == torch.get_num_threads()


# weights whose outputs reach the half type's subnormals and overflow to inf
HALF_WEIGHT_DECADES = {torch.float16: (-7, 4.5), torch.bfloat16: (-41, 38.5)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("family", ["auto", "generic", pytest.param("avx2", marks=needs_avx2)])
def test_half_output_rounds_to_nearest_even_like_torch(kernel: str, dtype: torch.dtype, family: str) -> None:
    # the kernel's own float -> half store (cpu_half.h: st and the F16C/AVX-512 conversions, and AVX512_BF16's with
    # its fallback for subnormals) against torch's rounding of the same float32 maths; half inputs are exact in
    # float32, so only the store differs. Weights from subnormal outputs to overflows (HALF_WEIGHT_DECADES).
    with cpu_kernels.using(family):
        kinds = cpu_kernels.loaded_kernels()
        if dtype == torch.float16 and "avx2 for float16," in kinds:
            pytest.skip("auto runs float16 and float32 on different kernels here (avx2 and generic cover both)")
        _half_output_rounds_like_torch(kernel, dtype)


def _half_output_rounds_like_torch(kernel: str, dtype: torch.dtype) -> None:
    shape, channel_dim, spatial = KERNELS[kernel]
    x, _, gy = make_inputs(shape, channel_dim, None, dtype)
    w = torch.logspace(*HALF_WEIGHT_DECADES[dtype], shape[channel_dim] // 2).to(dtype)
    cpp = forced("cpp", channel_dim, spatial)
    exact = kernel.startswith("rows") and not kernel.endswith("wide")  # the half rows are converted, then run the
    # float32 code; the sums of half rows wider than a block (and of rows of positions) are taken in another order
    # than float32's (by block, or in the loop), and the backward's products may fuse in another order: an ulp

    def same_as_float32_rounded(half: torch.Tensor, f32: torch.Tensor) -> None:
        assert torch.equal(half.isinf(), f32.to(dtype).isinf())
        if exact:
            assert torch.equal(half, f32.to(dtype))
        else:
            eps = torch.finfo(dtype).eps
            torch.testing.assert_close(half, f32.to(dtype), atol=torch.finfo(dtype).smallest_normal * eps, rtol=eps)

    same_as_float32_rounded(cpp(x, w), cpp(x.float(), w.float()))
    # the backward's stores: gradients of every size, then so small that most of dx is subnormal
    for scale in (1.0, torch.finfo(dtype).smallest_normal / 8):
        g = (gy.float() * scale).to(dtype)
        dx, dx32 = grads(cpp, x, None, g)[1], grads(cpp, x.float(), None, g.float())[1]
        if scale < 1:
            assert (dx32.abs() < torch.finfo(dtype).smallest_normal).float().mean() > 0.5
        same_as_float32_rounded(dx, dx32)


def test_float16_loads_every_finite_value_exactly(one_kernel_family: str) -> None:
    # every finite float16 (subnormals, zeros of both signs, the largest) in rows of 64: the
    # kernel's float16 -> float conversion (ld) against torch's, through the whole op
    bits = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.float16)
    x = x[x.isfinite()]
    x = x[: x.numel() // 64 * 64].view(-1, 64)  # (rows, 64)
    y = forced("cpp")(x, None)
    torch.testing.assert_close(y, forced("cpp")(x.float(), None).to(torch.float16), atol=0, rtol=0)


def test_the_portable_build_converts_float16_like_torch(fresh_build: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the build without -march=native (a compiler that refuses it) has no F16C: every float16
    # value goes through the integer conversions of cpu_half.h, which must agree with torch too
    portable = cpu_kernels._flag_sets()[1]
    assert "-march=native" not in portable
    monkeypatch.setattr(cpu_kernels, "_flag_sets", lambda: [portable])
    assert cpu_kernels.available(torch.float16)
    bits = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.float16)
    x = x[x.isfinite()]
    x = x[: x.numel() // 64 * 64].view(-1, 64)  # (rows, 64): every finite float16
    torch.testing.assert_close(forced("cpp")(x, None), forced("cpp")(x.float(), None).to(torch.float16), atol=0, rtol=0)
    w = torch.logspace(-7, 4.5, 32).to(torch.float16)  # subnormal outputs up to overflow
    xs = torch.randn(9, 64).to(torch.float16)
    assert torch.equal(forced("cpp")(xs, w), forced("cpp")(xs.float(), w.float()).to(torch.float16))


def test_the_portable_build_can_be_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LIGHTNING_MRS_CPU_NATIVE", raising=False)
    native, portable = cpu_kernels._flag_sets()
    assert "-march=native" in native and "-march=native" not in portable
    monkeypatch.setenv("LIGHTNING_MRS_CPU_NATIVE", "0")
    assert cpu_kernels._flag_sets() == [portable]


# one build each (~13 s of CPU since the library holds the operators too): the default suite keeps
# test_the_portable_build_converts_float16_like_torch (a build of its own) and the default build
@pytest.mark.parametrize("other", [pytest.param("portable", marks=pytest.mark.slow), pytest.param("generic", marks=pytest.mark.slow),
                                   pytest.param("avx2", marks=(needs_avx2, pytest.mark.slow)),
                                   pytest.param("haswell", marks=(needs_avx2, pytest.mark.slow))])
def test_every_build_agrees_with_the_default_one(other: str, fresh_build: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the default build (-march=native, kernel set auto) against: the portable build (no -march: the generic loops on
    # the x86-64 baseline), an AVX2-only build (-march=haswell: what -march=native gives on an AVX2 CPU, cpu_avx2.h
    # without any AVX-512 instruction), and each kernel set (cpu_avx2.h, the compiler-vectorised loops): the same
    # maths, sums in another order
    cases = [(KERNELS[k], dtype, affine) for k in KERNELS for dtype in (torch.float32, torch.bfloat16, torch.float16)
             for affine in (True, False)]
    cases += [(LAYOUTS["simd_tails"][:3], torch.bfloat16, True), (LAYOUTS["odd_phasors"][:3], torch.float16, True)]

    def run_all() -> list[tuple]:
        dispatch.clear_cache()
        out = []
        for (shape, channel_dim, spatial), dtype, affine in cases:
            x, w, gy = make_inputs(shape, channel_dim, None, dtype, affine=affine)
            out.append(grads(forced("cpp", channel_dim, spatial), x, w, gy))
        return out

    assert cpu_kernels.available()
    default = run_all()
    if other in ("portable", "haswell"):
        flags = cpu_kernels._flag_sets()[1] + (["-march=haswell"] if other == "haswell" else [])
        monkeypatch.setattr(cpu_kernels, "_flag_sets", lambda: [flags])
        cpu_kernels._STATE.clear()
        assert cpu_kernels.available() and "-march=native" not in cpu_kernels.build_flags()
        assert cpu_kernels.loaded_kernels() == ("avx2" if other == "haswell" else "generic")
        theirs_all = run_all()
    else:
        with cpu_kernels.using(other):
            assert cpu_kernels.loaded_kernels() == other and f"-DMRS_KERNELS_{other.upper()}" in cpu_kernels.build_flags()
            theirs_all = run_all()
    for (_, dtype, _), ours, theirs in zip(cases, default, theirs_all):
        # float32: a few ulps of the largest value (measured: 6e-7 of it); half outputs: an ulp or two
        tol = 4e-6 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
        for a, b in zip(ours, theirs):
            if a is not None or b is not None:
                torch.testing.assert_close(a, b, rtol=0, atol=tol * b.abs().max().item())


@pytest.mark.slow  # one build each (~13 s of CPU)
@pytest.mark.parametrize("name", ["generic", pytest.param("avx2", marks=needs_avx2)])
def test_a_kernel_set_is_its_own_build_chosen_by_env_or_block(
    name: str, fresh_build: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # using() runs the set inside its block only; the environment variable makes it the process's set
    x, w, gy = make_inputs((7, 5, 64), -1, None, torch.bfloat16)
    default = grads(forced("cpp"), x, w, gy)
    before = cpu_kernels.loaded_kernels()
    with cpu_kernels.using(name):
        assert (cpu_kernels.kernel_set(), cpu_kernels.loaded_kernels()) == (name, name)
        check_against_reference("cpp", ((7, 5, 64), -1, False, None), torch.bfloat16)
    assert (cpu_kernels.kernel_set(), cpu_kernels.loaded_kernels()) == ("auto", before)
    assert len(list(fresh_build.glob("mrs_norm_cpu_*.so"))) == 2  # the default build, and this set's
    torch.testing.assert_close(grads(forced("cpp"), x, w, gy)[0], default[0], atol=0, rtol=0)  # the default again
    monkeypatch.setenv("LIGHTNING_MRS_CPU_KERNEL_SET", name)
    cpu_kernels._STATE.clear()  # a new process with the variable set
    assert cpu_kernels.available() and cpu_kernels.loaded_kernels() == name


def test_the_default_set_runs_the_faster_kernels_of_each_dtype(fresh_build: Path) -> None:
    # auto: cpu_avx2.h on a CPU with AVX2, FMA and F16C and no AVX-512; on AVX-512 for float16 only (measured
    # faster there, the generic loops for float32 and bfloat16: docs/performance-lm.md); the generic loops elsewhere;
    # with AVX512_BF16 the kernels over cpu_avx512.h's 16 lanes for every dtype and layout
    assert cpu_kernels.available()
    if not HAS_AVX2:
        expected = "generic"
    elif {"avx512f", "avx512_bf16", "avx512dq", "avx512vl"} <= _cpu_flags():  # and the bfloat16 stores of cpu_half.h
        expected = "avx512"
    elif "avx512f" in _cpu_flags():
        expected = "avx2 for float16, generic for float32 and bfloat16"
    else:
        expected = "avx2"
    assert cpu_kernels.loaded_kernels() == expected


def test_an_unknown_kernel_set_is_a_clear_error(fresh_build: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="choose one of auto, avx2, generic"):
        with cpu_kernels.using("avx512"):
            pass
    monkeypatch.setenv("LIGHTNING_MRS_CPU_KERNEL_SET", "avx512")
    with pytest.raises(ValueError, match="LIGHTNING_MRS_CPU_KERNEL_SET='avx512' is not a CPU kernel set"):
        mrs_norm(torch.randn(16, 64))  # at the first call, not a warning and a silent fallback


@pytest.mark.slow  # a failing build (~15 s of CPU)
def test_a_kernel_set_that_cannot_build_here_says_why(fresh_build: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_kernels.available()
    monkeypatch.setenv("LIGHTNING_MRS_CPU_NATIVE", "0")  # avx2 is built with -march=native only
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="LIGHTNING_MRS_CPU_NATIVE=0 turns off"):
        with cpu_kernels.using("avx2"):
            pass
    monkeypatch.delenv("LIGHTNING_MRS_CPU_NATIVE")
    # a compiler target without AVX2 (the CPU of another machine): the source refuses the set, not a crash at run time
    monkeypatch.setattr(cpu_kernels, "_flag_sets", lambda: [["-O3", "-fPIC", "-shared", "-fopenmp", "-std=c++17",
                                                             "-DMRS_KERNELS_AVX2", "-march=x86-64"]])
    monkeypatch.setattr(cpu_kernels, "_SETS", {})
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="avx2 needs a CPU with AVX2, FMA and F16C"):
        with cpu_kernels.using("avx2"):
            pass
    assert cpu_kernels.kernel_set() == "auto" and cpu_kernels.available()  # the default set is untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_a_nan_input_gives_nan_in_its_group_only(kernel: str, dtype: torch.dtype) -> None:
    # a NaN makes its group's S NaN: that group's outputs are NaN (the half stores keep NaN, none rounds it to inf or a
    # number) and every other group is untouched, as in the float64 reference
    shape, channel_dim, spatial = KERNELS[kernel]
    x, w, _ = make_inputs(shape, channel_dim, None, dtype)
    x.view(-1)[x.numel() // 2] = float("nan")
    y = forced("cpp", channel_dim, spatial)(x, w)
    ref = mrs_norm_ref(x, w, channel_dim=channel_dim, spatial=spatial)
    assert y.isnan().any() and torch.equal(y.isnan(), ref.isnan())
    ok = ~ref.isnan()
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(y[ok].double(), ref[ok], rtol=4 * eps, atol=4 * eps)
