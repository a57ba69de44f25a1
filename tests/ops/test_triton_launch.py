"""The Triton kernels' launch arithmetic (:mod:`lightning_mrs.ops.triton_launch`) and the launches
the backend makes, for shapes no interpreter run could reach: grids past 65,535 tiles and
inputs past 2^31 elements (on meta tensors: nothing is allocated, no kernel runs)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_mrs.ops import triton_launch as launch
from lightning_mrs.ops.layout import Layout

CUDA_GRID_DIM0, CUDA_GRID_DIM12 = 2**31 - 1, 65535
WIDTHS = [2, 6, 10, 70, 128, 130, 256, 1022, 2048, 2050, 4096, 8192, 12290, 16384, 16386, 32768, 65536]


def _is_power_of_2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@pytest.mark.parametrize("c", WIDTHS)
def test_a_row_tile_holds_whole_rows_and_gives_each_thread_at_most_16_values_to_16384(c: int) -> None:
    cfg = launch.row_config(c)
    assert cfg.block_c >= c and cfg.block_c < 2 * max(c, 2) and _is_power_of_2(cfg.block_c)
    assert _is_power_of_2(cfg.rows) and _is_power_of_2(cfg.warps) and 1 <= cfg.warps <= 32
    assert cfg.rows * cfg.block_c == max(launch.TILE, cfg.block_c)  # several rows only while a row is short
    per_thread = cfg.rows * cfg.block_c / (32 * cfg.warps)
    assert per_thread <= (16 if cfg.block_c <= 16384 else 64), per_thread


def test_the_choices_the_docs_state() -> None:
    assert launch.row_config(128) == launch.RowConfig(128, 16, 4)  # QK-norm, head_dim 128
    assert launch.row_config(64) == launch.RowConfig(64, 32, 4)
    assert launch.row_config(1024) == launch.RowConfig(1024, 2, 4)
    assert [launch.row_config(c).warps for c in (2048, 4096, 8192, 16384, 65536)] == [4, 8, 16, 32, 32]
    assert launch.column_config(64, 35) == launch.ColumnConfig(32, 32, 4)
    assert launch.column_config(4098, 9) == launch.ColumnConfig(4096, 1, 16)  # wide NCHW: one position per tile


@pytest.mark.parametrize("c,l", [(2, 1), (2, 10**6), (6, 5), (64, 1024), (130, 7), (4096, 3), (16384, 100)])
def test_a_column_tile_holds_every_phasor(c: int, l: int) -> None:
    cfg = launch.column_config(c, l)
    assert cfg.block_p >= c // 2 and _is_power_of_2(cfg.block_p) and _is_power_of_2(cfg.block_l)
    assert 1 <= cfg.block_l <= max(1, launch.next_power_of_2(l))
    assert 2 * cfg.block_p * cfg.block_l <= max(launch.TILE, 2 * cfg.block_p)
    assert cfg.warps == launch.warps_for(2 * cfg.block_p * cfg.block_l)


def test_no_tile_is_made_for_rows_wider_than_the_registers() -> None:
    for config in (lambda: launch.row_config(65538), lambda: launch.column_config(65538, 4)):
        with pytest.raises(ValueError, match=r"at most 65536 channels .* not 65538"):
            config()


@pytest.mark.parametrize("blocks", [1, 65535, 65536, 10**6, 2**31 - 1, 2**31, 2**40])
def test_the_grid_never_passes_cudas_limit(blocks: int) -> None:
    (programs,) = launch.grid(blocks)
    assert 1 <= programs <= CUDA_GRID_DIM0 and programs == min(blocks, CUDA_GRID_DIM0)
    assert 1 <= launch.persistent_programs(blocks, sms=132, warps=4) <= min(blocks, 132 * 8)
    assert launch.persistent_programs(blocks, sms=132, warps=32) == min(blocks, 132)


@pytest.mark.parametrize("blocks,cap", [(1, 3), (7, 3), (10, 10), (100, 7), (65537, 65535)])
def test_the_fold_visits_every_tile_once(blocks: int, cap: int) -> None:
    (programs,) = launch.grid(blocks, cap)
    seen = [t for pid in range(programs) for t in range(pid, blocks, programs)]  # the kernels' loop
    assert sorted(seen) == list(range(blocks))


def test_an_empty_input_still_launches_one_program() -> None:
    assert launch.grid(0) == (1,) and launch.persistent_programs(0, 132, 4) == 1


class _Recorder:
    """Stands in for a jitted kernel: ``kernel[grid](*args, **meta)`` records the call."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, tuple, dict]] = []

    def __getitem__(self, grid: tuple) -> Any:
        return lambda *args, **meta: self.calls.append((grid, args, meta))


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> dict[str, _Recorder]:
    pytest.importorskip("triton")
    from lightning_mrs.ops import triton_kernels

    kernels = {name: _Recorder() for name in ("_rows_fwd", "_rows_bwd", "_cols_fwd", "_cols_bwd")}
    for name, recorder in kernels.items():
        monkeypatch.setattr(triton_kernels, name, recorder)
    return kernels


def test_tokens_past_2_31_elements_launch_within_the_limits(recorded: dict[str, _Recorder]) -> None:
    from lightning_mrs.ops import triton_kernels

    rows, c = 2**25 + 3, 128  # 2^32 + 384 elements: a long-context QK-norm
    x3 = torch.empty((rows, 1, c), device="meta", dtype=torch.bfloat16)
    w = torch.empty(c // 2, device="meta")
    y3, r_sum = triton_kernels.forward(x3, w, 1e-6, Layout(True, False))
    triton_kernels.backward(x3, w, r_sum, torch.empty_like(x3), 1e-6, Layout(True, False))
    (grid, args, meta), = recorded["_rows_fwd"].calls
    assert len(grid) == 1 and grid[0] <= CUDA_GRID_DIM0
    assert meta["ROWS"] == 16 and meta["BLOCK_C"] == 128 and meta["num_warps"] == 4
    assert args[-1] * meta["ROWS"] >= rows and grid[0] == args[-1]  # n_blocks tiles cover every row
    assert args[4] == rows and args[5] == c // 2 and args[2] is w  # the (P,) weight as it is
    (bgrid, bargs, _), = recorded["_rows_bwd"].calls
    assert len(bgrid) == 1 and bgrid[0] == bargs[5].shape[0] <= bargs[-1]  # one dw row per program


def test_nchw_past_65535_tiles_is_one_folded_dimension(recorded: dict[str, _Recorder]) -> None:
    from lightning_mrs.ops import triton_kernels

    a, c, l = 70000, 64, 2**20  # 70,000 images: the old (A, cdiv(L, BLOCK_L)) grid had 32,768 on dim 1
    x3 = torch.empty((a, c, l), device="meta", dtype=torch.float16)
    triton_kernels.forward(x3, None, 1e-6, Layout(False, False))
    (grid, args, meta), = recorded["_cols_fwd"].calls
    n_lb, blocks = args[7], args[8]
    assert len(grid) == 1 and grid[0] == min(blocks, CUDA_GRID_DIM0)
    assert blocks == a * n_lb and n_lb * meta["BLOCK_L"] >= l and meta["HAS_W"] is False
