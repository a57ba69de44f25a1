"""What is particular to the ``cpp`` backend (``lightning_mrs.ops.cpu_kernels``): the build
and its cache, the fallbacks when it cannot be built or is switched off, thread-count
independence and its own float -> bfloat16 rounding. Its results against the float64
reference are in ``test_backends.py``; what ``auto`` picks is in ``test_dispatch.py``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lightning_mrs import mrs_norm
from lightning_mrs.ops import cpu_kernels, dispatch, which_backend
from helpers.checks import forced, grads, make_inputs, needs_cpp
from helpers.reference import mrs_norm_ref

pytestmark = needs_cpp


@pytest.fixture
def fresh_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """A process with no library loaded, no cached backend choice and an empty cache folder."""
    saved = dict(cpu_kernels._STATE)
    cpu_kernels._STATE.clear()
    dispatch.clear_cache()
    monkeypatch.setenv("LIGHTNING_MRS_CACHE", str(tmp_path))
    yield tmp_path
    cpu_kernels._STATE.clear()
    cpu_kernels._STATE.update(saved)
    dispatch.clear_cache()  # choices made without the library must not outlive the test


def test_build_is_cached_on_disk_and_reused(fresh_build: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_kernels.available()
    built = list(fresh_build.iterdir())
    assert len(built) == 1 and built[0].name.startswith("mrs_norm_cpu_")  # no temp file left
    cpu_kernels._STATE.clear()  # a new process: must load, not compile again
    commands: list[list[str]] = []
    real_run = cpu_kernels.subprocess.run
    monkeypatch.setattr(cpu_kernels.subprocess, "run",
                        lambda cmd, **kw: commands.append(cmd) or real_run(cmd, **kw))
    assert cpu_kernels.available()
    assert commands and not any(str(cpu_kernels.SOURCE) in map(str, cmd) for cmd in commands)  # `c++ --version` only


def test_no_compiler_falls_back_with_one_warning_and_a_clear_error(
    fresh_build: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: None)
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


def test_read_only_home_builds_in_the_temp_dir(
    fresh_build: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("LIGHTNING_MRS_CACHE")
    home_cache = tmp_path / "home_cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home_cache))
    real_access = os.access
    # a read-only home (root ignores chmod, so the permission check itself is simulated)
    monkeypatch.setattr(cpu_kernels.os, "access",
                        lambda p, mode: False if str(p).startswith(str(home_cache)) else real_access(p, mode))
    monkeypatch.setattr(cpu_kernels.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    assert cpu_kernels._cache_dir().parent == tmp_path / "tmp"
    assert cpu_kernels.available()
    assert list((tmp_path / "tmp").glob("lightning_mrs_*/mrs_norm_cpu_*.so"))


# name -> (shape, channel_dim, spatial): one per C++ kernel (rows per position, rows per
# sample, NCHW per sample)
KERNELS = {
    "rows_per_position": ((5, 7, 64), -1, False),
    "rows_per_sample": ((3, 35, 64), -1, True),
    "nchw_per_sample": ((3, 64, 5, 7), 1, True),
}


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_results_do_not_depend_on_the_thread_count(kernel: str) -> None:
    shape, channel_dim, spatial = KERNELS[kernel]
    x, w, gy = make_inputs(shape, channel_dim, None, torch.float32)
    cpp = forced("cpp", channel_dim, spatial)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = grads(cpp, x, w, gy)
        torch.set_num_threads(max(3, before))  # 3: groups split unevenly over the threads
        many = grads(cpp, x, w, gy)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(one[0], many[0], atol=0, rtol=0)  # each group summed in one order
    torch.testing.assert_close(one[1], many[1], atol=0, rtol=0)
    torch.testing.assert_close(one[2], many[2], atol=1e-5, rtol=1e-5)  # dw: per-thread partial sums


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_bfloat16_output_rounds_to_nearest_even_like_torch(kernel: str) -> None:
    # the kernel's own float -> bfloat16 store (cpu_kernels.cpp, st) against torch's rounding
    # of the same float32 maths; bfloat16 inputs are exact in float32, so only the store differs
    shape, channel_dim, spatial = KERNELS[kernel]
    x, w, _ = make_inputs(shape, channel_dim, None, torch.bfloat16)
    cpp = forced("cpp", channel_dim, spatial)
    y = cpp(x, w)
    y32 = cpp(x.float(), w.float())
    assert torch.equal(y, y32.to(torch.bfloat16))
