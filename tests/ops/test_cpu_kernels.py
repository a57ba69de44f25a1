"""The hand-written CPU kernels (``lightning_mrs.kernels_cpu``, ``backend="cpp"``).

Forward, input gradient and weight gradient against the independent float64 reference for
the layouts they cover, every dtype, odd sizes; thread-count independence; dispatch; the
build cache; and the fallback when no compiler is there.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from lightning_mrs import MRSNorm, MRSNorm2d, mrs_norm
from lightning_mrs import fused
from lightning_mrs import kernels_cpu as kc
from helpers.checks import check_against_reference, grads, make_inputs, saved_bytes
from helpers.reference import mrs_norm_ref

pytestmark = pytest.mark.skipif(not kc.available(), reason=f"CPU kernels not built: {kc.build_error()}")

CPP_DTYPES = (torch.float32, torch.bfloat16)

# name -> (shape, channel_dim, spatial, memory_format); odd sizes on purpose
LAYOUTS = {
    "tokens": ((5, 7, 64), -1, False, None),
    "tokens_per_sample": ((3, 7, 64), -1, True, None),
    "nhwc_per_sample": ((3, 64, 5, 7), 1, True, torch.channels_last),
    "rows_one_pair": ((9, 2), -1, False, None),  # P = 1
    "rows_odd_pairs": ((1, 3, 30), -1, False, None),  # 15 phasors: a SIMD tail
    "wide_rows": ((3, 4098), -1, False, None),
    "nhwc_per_position": ((3, 64, 5, 7), 1, False, torch.channels_last),
    "nchw_per_sample": ((3, 64, 5, 7), 1, True, None),
    "ncl_per_sample": ((2, 10, 13), 1, True, None),
    "ncdhw_per_sample": ((2, 6, 3, 1, 5), 1, True, None),
    "nc_per_sample": ((4, 6), 1, True, None),  # no spatial dims: L = 1
}


def _cpp(cd, spatial):
    return lambda a, b: mrs_norm(a, b, channel_dim=cd, spatial=spatial, backend="cpp")


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("dtype", CPP_DTYPES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cpp_matches_reference(layout, dtype, affine):
    check_against_reference("cpp", LAYOUTS[layout], dtype, affine)


def test_cpp_equals_the_inductor_bodies_run_eagerly():
    # the two implementations of the same maths (the ``function`` path runs the plain-torch
    # bodies): close to float32 rounding, and the same saved scale
    x, w, gy = make_inputs((33, 128), -1, None, torch.float32)
    a = grads(_cpp(-1, False), x, w, gy)
    b = grads(lambda u, v: mrs_norm(u, v, backend="function"), x, w, gy)
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("layout", ["tokens", "nhwc_per_sample", "nchw_per_sample"])
def test_results_do_not_depend_on_the_thread_count(layout):
    shape, cd, spatial, mf = LAYOUTS[layout]
    x, w, gy = make_inputs(shape, cd, mf, torch.float32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = grads(_cpp(cd, spatial), x, w, gy)
        torch.set_num_threads(max(2, before))
        many = grads(_cpp(cd, spatial), x, w, gy)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(one[0], many[0], atol=0, rtol=0)  # per group: same order
    torch.testing.assert_close(one[1], many[1], atol=0, rtol=0)
    torch.testing.assert_close(one[2], many[2], atol=1e-5, rtol=1e-5)  # dw: summation order


def test_zeros_give_zeros_and_finite_gradients():
    for shape, cd, spatial in (((4, 64), -1, False), ((2, 8, 3, 3), 1, True)):
        for dtype in CPP_DTYPES:
            x = torch.zeros(shape, dtype=dtype, requires_grad=True)
            w = torch.ones(shape[cd] // 2, dtype=dtype, requires_grad=True)
            y = mrs_norm(x, w, channel_dim=cd, spatial=spatial, backend="cpp")
            y.sum().backward()
            assert (y == 0).all()
            assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()


def test_float16_goes_to_the_other_kernels_and_explicit_cpp_says_why():
    x = torch.randn(8, 64, dtype=torch.float16)
    assert fused.resolve_backend(x, 1, False, "auto") in ("inductor", "function")
    with pytest.raises(ValueError, match="float32/bfloat16"):
        mrs_norm(x, backend="cpp")


def test_bfloat16_rounds_to_nearest_even_like_torch():
    # the kernel's own float -> bfloat16 store must agree with torch's conversion
    x = torch.randn(64, 256, dtype=torch.bfloat16)
    y = mrs_norm(x, backend="cpp")
    ref = mrs_norm(x.float(), backend="cpp").to(torch.bfloat16)  # same fp32 maths, torch rounds
    assert torch.equal(y, ref)


def test_auto_picks_cpp_only_for_the_layouts_it_covers():
    big = torch.randn(2, 64, 4, 4)
    assert fused.resolve_backend(big, 1, True, "auto") == "cpp"  # NCHW per sample
    assert fused.resolve_backend(big.contiguous(memory_format=torch.channels_last), 1, False, "auto") == "cpp"
    assert fused.resolve_backend(big, 1, False, "auto") != "cpp"  # NCHW per position: Inductor
    nhwc = big.contiguous(memory_format=torch.channels_last)
    assert fused.resolve_backend(nhwc, 1, True, "auto") == "cpp"  # NHWC per sample
    assert fused.resolve_backend(big.double(), 1, True, "auto") != "cpp"  # float64
    assert fused.resolve_backend(torch.randn(8, 64)[:, ::2], 1, False, "auto") != "cpp"  # strided


def test_explicit_cpp_on_an_uncovered_layout_says_what_it_needs():
    with pytest.raises(ValueError, match="channels contiguous, or the positions contiguous"):
        mrs_norm(torch.randn(2, 8, 3, 3), channel_dim=1, backend="cpp")  # NCHW per position


def test_modules_default_to_cpp_and_save_only_x_and_one_scale_per_group():
    for norm, x, cd, spatial in (
        (MRSNorm(64), torch.randn(40, 64), 1, False),
        (MRSNorm2d(64, spatial=True), torch.randn(3, 64, 5, 7), 1, True),
    ):
        assert fused.resolve_backend(x, cd, spatial, "auto") == "cpp"
        x.requires_grad_()
        y, nbytes = saved_bytes(norm, x)
        groups = x.shape[0]
        budget = x.numel() * 4 + norm.weight.numel() * 4 + groups * 4  # x, weight, P*S
        assert nbytes <= budget
        y.sum().backward()
        assert torch.isfinite(x.grad).all()


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """A process state with no library loaded and an empty cache folder."""
    saved = dict(kc._STATE)
    kc._STATE.clear()
    monkeypatch.setenv("LIGHTNING_MRS_CACHE", str(tmp_path))
    yield tmp_path
    kc._STATE.clear()
    kc._STATE.update(saved)


def test_build_is_cached_on_disk_and_reused(fresh_build, monkeypatch):
    assert kc.available()
    built = list(fresh_build.iterdir())
    assert len(built) == 1 and built[0].name.startswith("mrs_norm_cpu_")  # no temp file left
    kc._STATE.clear()  # a new process: must load, not compile again
    calls = []
    real_run = kc.subprocess.run
    monkeypatch.setattr(kc.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or real_run(cmd, **kw))
    assert kc.available()
    assert not any(str(kc.SOURCE) in map(str, cmd) for cmd in calls)  # only `c++ --version`


def test_no_compiler_falls_back_with_one_warning_and_a_clear_error(fresh_build, monkeypatch):
    monkeypatch.setattr(kc, "_compiler", lambda: None)
    x = torch.randn(16, 64)
    with pytest.warns(RuntimeWarning, match="building the one-pass CPU kernels failed"):
        assert fused.resolve_backend(x, 1, False, "auto") in ("inductor", "function")
    assert "no C++ compiler" in kc.build_error()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        y = mrs_norm(x)
        with pytest.raises(ValueError, match="no C\\+\\+ compiler"):
            mrs_norm(x, backend="cpp")
    torch.testing.assert_close(y.double(), mrs_norm_ref(x), atol=2e-5, rtol=2e-5)


def test_env_switch_turns_the_kernels_off(monkeypatch):
    monkeypatch.setenv("LIGHTNING_MRS_CPU_KERNELS", "0")
    assert not kc.available()
    assert fused.resolve_backend(torch.randn(16, 64), 1, False, "auto") != "cpp"


def test_unwritable_home_builds_in_the_temp_dir(fresh_build, monkeypatch, tmp_path):
    monkeypatch.delenv("LIGHTNING_MRS_CACHE")
    home_cache = tmp_path / "home_cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home_cache))
    real_access = os.access
    # read-only home (root ignores chmod, so the check itself is simulated)
    monkeypatch.setattr(kc.os, "access", lambda p, mode: False if str(p).startswith(str(home_cache)) else real_access(p, mode))
    monkeypatch.setattr(kc.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    assert kc._cache_dir().parent == tmp_path / "tmp"
    assert kc.available()
    assert list((tmp_path / "tmp").glob("lightning_mrs_*/mrs_norm_cpu_*.so"))
