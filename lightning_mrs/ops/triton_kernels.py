"""The ``triton`` backend: the operators' CUDA kernels, one ``S`` per position (Liger-Kernel's
RMSNorm pattern; launch choices in :mod:`.triton_launch`), on the canonical views of :mod:`.layout`.

* **rows** (``(A, L, C)``, channels contiguous): a program loads a ``(ROWS, BLOCK_C)`` tile of
  whole rows in one vectorised load and splits even and odd channels with ``tl.reshape`` +
  ``tl.split`` (``tl.interleave`` puts them back);
* **columns** (``(A, C, L)``, or any strides): a tile of every phasor at ``BLOCK_L`` positions,
  the even and odd channels two loads vectorised along ``L``.

The forward stores ``y`` and ``r_sum = P * S`` (float32, ``(A, 1, L)``); the backward recomputes
``r`` and runs a few persistent programs per SM that each sum their part of ``dw`` in registers.
Offsets are 64-bit. Rows wider than 65,536 channels run the ``torch`` bodies. Imports without
triton; tested on the CPU under ``TRITON_INTERPRET=1`` (``tests/ops/test_triton_interpret.py``).
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
from torch import Tensor

from lightning_mrs.ops import torch_kernels, triton_launch as launch
from lightning_mrs.ops.layout import DispatchKey, Layout

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional
    triton = None

__all__ = ["available", "backward", "forward", "unavailable"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Triton is importable and a CUDA device is present."""
    return triton is not None and torch.cuda.is_available()


if triton is not None:

    @triton.jit
    def _rows_fwd(
        X, Y, W, RS, N, P, sx, sy, eps, n_blocks,
        HAS_W: tl.constexpr, BLOCK_C: tl.constexpr, ROWS: tl.constexpr,
    ):
        BLOCK_P: tl.constexpr = BLOCK_C // 2
        cols = tl.arange(0, BLOCK_C)
        cmask = cols < 2 * P
        p = tl.arange(0, BLOCK_P)
        pmask = p < P
        if HAS_W:
            wp = tl.load(W + p, mask=pmask, other=0.0).to(tl.float32)
            w = tl.interleave(wp, wp)  # (BLOCK_C,): the (P,) gain per channel, in registers
        for blk in range(tl.program_id(0).to(tl.int64), n_blocks, tl.num_programs(0)):
            n = tl.cast(blk, tl.int64) * ROWS + tl.arange(0, ROWS)  # (ROWS,) row index, 64 bits
            rmask = n < N
            mask = rmask[:, None] & cmask[None, :]
            x = tl.load(X + n[:, None] * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            xe, xo = tl.split(tl.reshape(x, (ROWS, BLOCK_P, 2)))  # even, odd channels
            r = tl.where(pmask[None, :], tl.sqrt(xe * xe + xo * xo + eps), 0.0)
            r_sum = tl.sum(r, axis=1)  # (ROWS,) = P * S
            y = x * (P / tl.where(rmask, r_sum, 1.0))[:, None]  # padded rows stay finite
            if HAS_W:
                y = y * w[None, :]
            tl.store(Y + n[:, None] * sy + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
            tl.store(RS + n, r_sum, mask=rmask)

    @triton.jit
    def _rows_bwd(
        X, G, DX, W, RS, DWP, N, P, sx, sg, sd, eps, n_blocks,
        HAS_W: tl.constexpr, BLOCK_C: tl.constexpr, ROWS: tl.constexpr,
    ):
        BLOCK_P: tl.constexpr = BLOCK_C // 2
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_C)
        cmask = cols < 2 * P
        p = tl.arange(0, BLOCK_P)
        pmask = p < P
        dw_acc = tl.zeros((BLOCK_P,), dtype=tl.float32)  # per phasor: half the registers of per channel
        for blk in range(pid.to(tl.int64), n_blocks, tl.num_programs(0)):
            n = tl.cast(blk, tl.int64) * ROWS + tl.arange(0, ROWS)  # (ROWS,) row index, 64 bits
            rmask = n < N
            mask = rmask[:, None] & cmask[None, :]
            x = tl.load(X + n[:, None] * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            g = tl.load(G + n[:, None] * sg + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            xe, xo = tl.split(tl.reshape(x, (ROWS, BLOCK_P, 2)))
            rinv = 1.0 / tl.sqrt(xe * xe + xo * xo + eps)  # (ROWS, BLOCK_P): r recomputed, not saved
            inv = P / tl.load(RS + n, mask=rmask, other=1.0)  # (ROWS,) 1/S
            gx = g * x
            if HAS_W:  # the gain reloaded per tile (a cache hit): not held in registers across the loop
                wp = tl.load(W + p, mask=pmask, other=0.0).to(tl.float32)
                w = tl.interleave(wp, wp)[None, :]  # (1, BLOCK_C)
                c = tl.sum(gx * w, axis=1)  # (ROWS,) sum_k w g x
                gw = g * w
            else:
                c = tl.sum(gx, axis=1)
                gw = g
            k = c * inv * inv / P  # c / (P S^2)
            dx = gw * inv[:, None] - (k[:, None] * x) * tl.interleave(rinv, rinv)
            tl.store(DX + n[:, None] * sd + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
            if HAS_W:
                de, do = tl.split(tl.reshape(gx * inv[:, None], (ROWS, BLOCK_P, 2)))
                dw_acc += tl.sum(de + do, axis=0)
        if HAS_W:
            tl.store(DWP + pid.to(tl.int64) * P + p, dw_acc, mask=pmask)

    @triton.jit
    def _cols_fwd(
        X, Y, W, RS, A, L, P, n_lb, n_blocks,
        sxa, sxc, sxl, sya, syc, syl, eps,
        HAS_W: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_L: tl.constexpr,
    ):
        p = tl.arange(0, BLOCK_P).to(tl.int64)[:, None]  # (BLOCK_P, 1) phasor index
        pmask = p < P
        if HAS_W:
            w = tl.load(W + p, mask=pmask, other=0.0).to(tl.float32)  # (BLOCK_P, 1)
        for t in range(tl.program_id(0).to(tl.int64), n_blocks, tl.num_programs(0)):
            a = tl.cast(t, tl.int64) // n_lb  # the loop index is not 64 bits everywhere (the interpreter)
            lv = (t - a * n_lb) * BLOCK_L + tl.arange(0, BLOCK_L)  # (BLOCK_L,) positions, 64 bits
            l = lv[None, :]
            mask = pmask & (l < L)
            xb = X + a * sxa + l * sxl
            xe = tl.load(xb + (2 * p) * sxc, mask=mask, other=0.0).to(tl.float32)
            xo = tl.load(xb + (2 * p + 1) * sxc, mask=mask, other=0.0).to(tl.float32)
            r = tl.where(mask, tl.sqrt(xe * xe + xo * xo + eps), 0.0)
            r_sum = tl.sum(r, axis=0)  # (BLOCK_L,) = P * S
            scale = (P / tl.where(lv < L, r_sum, 1.0))[None, :]
            if HAS_W:
                scale = scale * w
            yb = Y + a * sya + l * syl
            tl.store(yb + (2 * p) * syc, (xe * scale).to(Y.dtype.element_ty), mask=mask)
            tl.store(yb + (2 * p + 1) * syc, (xo * scale).to(Y.dtype.element_ty), mask=mask)
            tl.store(RS + a * L + lv, r_sum, mask=lv < L)

    @triton.jit
    def _cols_bwd(
        X, G, DX, W, RS, DWP, A, L, P, n_lb, n_blocks,
        sxa, sxc, sxl, sga, sgc, sgl, sda, sdc, sdl, eps,
        HAS_W: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_L: tl.constexpr,
    ):
        pid = tl.program_id(0)
        p = tl.arange(0, BLOCK_P).to(tl.int64)[:, None]
        pmask = p < P
        if HAS_W:
            w = tl.load(W + p, mask=pmask, other=0.0).to(tl.float32)  # (BLOCK_P, 1)
        else:
            w = tl.full((BLOCK_P, 1), 1.0, tl.float32)
        dw_acc = tl.zeros((BLOCK_P,), dtype=tl.float32)
        for t in range(pid.to(tl.int64), n_blocks, tl.num_programs(0)):
            a = tl.cast(t, tl.int64) // n_lb  # the loop index is not 64 bits everywhere (the interpreter)
            lv = (t - a * n_lb) * BLOCK_L + tl.arange(0, BLOCK_L)
            l = lv[None, :]
            mask = pmask & (l < L)
            xb = X + a * sxa + l * sxl
            gb = G + a * sga + l * sgl
            xe = tl.load(xb + (2 * p) * sxc, mask=mask, other=0.0).to(tl.float32)
            xo = tl.load(xb + (2 * p + 1) * sxc, mask=mask, other=0.0).to(tl.float32)
            ge = tl.load(gb + (2 * p) * sgc, mask=mask, other=0.0).to(tl.float32)
            go = tl.load(gb + (2 * p + 1) * sgc, mask=mask, other=0.0).to(tl.float32)
            rinv = 1.0 / tl.sqrt(xe * xe + xo * xo + eps)
            inv = (P / tl.load(RS + a * L + lv, mask=lv < L, other=1.0))[None, :]  # 1/S
            gwe = ge * w
            gwo = go * w
            k = tl.sum(gwe * xe + gwo * xo, axis=0)[None, :] * inv * inv / P
            db = DX + a * sda + l * sdl
            tl.store(db + (2 * p) * sdc, (gwe * inv - k * xe * rinv).to(DX.dtype.element_ty), mask=mask)
            tl.store(db + (2 * p + 1) * sdc, (gwo * inv - k * xo * rinv).to(DX.dtype.element_ty), mask=mask)
            if HAS_W:
                dw_acc += tl.sum((ge * xe + go * xo) * inv, axis=1)
        if HAS_W:
            pv = tl.arange(0, BLOCK_P)
            tl.store(DWP + pid.to(tl.int64) * P + pv, dw_acc, mask=pv < P)


def unavailable(key: DispatchKey, explicit: bool) -> Optional[str]:
    """Why the kernels do not run ``key``: they need the triton package, a CUDA tensor (or,
    asked for explicitly, ``TRITON_INTERPRET=1`` on the CPU, for tests), float32/16/bf16 (they
    compute in fp32) and one ``S`` per position."""
    if key.layout.spatial:
        return "the Triton kernels compute one S per position (spatial=False)"
    if key.dtype not in _DTYPES:
        return f"the Triton kernels cover float32/float16/bfloat16, not {key.dtype}"
    if triton is None:
        return "the triton package is not installed"
    interpret = explicit and key.device_type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    if not (interpret or (key.device_type == "cuda" and available())):
        return "the Triton kernels need a CUDA tensor"
    return None


def _rows(t: Tensor) -> Optional[Tensor]:
    """``t`` (``(A, L, C)``) as a ``(rows, C)`` view with unit channel stride, or ``None``."""
    if t.stride(2) != 1 and t.shape[2] > 1:
        return None
    if t.shape[1] == 1:
        return t[:, 0, :]
    if t.shape[0] == 1:
        return t[0]
    return t.flatten(0, 1) if t.stride(0) == t.shape[1] * t.stride(1) else None


def _too_wide(x3: Tensor, layout: Layout) -> bool:
    """A row wider than a program holds in registers (:data:`.triton_launch.MAX_CHANNELS`): it
    runs the ``torch`` backend's bodies instead (several kernels, the same saved tensors)."""
    return x3.shape[2 if layout.last else 1] > launch.MAX_CHANNELS


def _sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2  # the CPU interpreter: a few programs, so that each loops over several tiles


def forward(x3: Tensor, w: Optional[Tensor], eps: float, layout: Layout) -> tuple[Tensor, Tensor]:
    """``(y3, r_sum)`` for a canonical view with any strides (see :mod:`lightning_mrs.ops.layout`);
    ``w`` the per-phasor gain ``(P,)`` or ``None``; ``r_sum`` float32, one per position."""
    if triton is None:
        raise RuntimeError("lightning_mrs.ops.triton_kernels needs the triton package.")
    if _too_wide(x3, layout):
        return torch_kernels.forward(x3, w, eps, layout)
    if layout.last:
        y3 = torch.empty_like(x3)
        xr, yr = _rows(x3), _rows(y3)
        if xr is not None and yr is not None:
            a, l, _ = x3.shape
            r_sum = torch.empty((a, 1, l), device=x3.device, dtype=torch.float32)
            _rows_forward(xr, yr, w, r_sum, eps)
            return y3, r_sum
        y3, r_sum = _cols_forward(x3.transpose(1, 2), w, eps)  # (A, C, L) strided view
        return y3.transpose(1, 2), r_sum
    return _cols_forward(x3, w, eps)


def backward(x3: Tensor, w: Optional[Tensor], r_sum: Tensor, g3: Tensor, eps: float,
             layout: Layout) -> tuple[Tensor, Optional[Tensor]]:
    """``(dx3, dw)`` of :func:`forward` for the upstream gradient ``g3`` (``dw`` per phasor, float32)."""
    if triton is None:
        raise RuntimeError("lightning_mrs.ops.triton_kernels needs the triton package.")
    if _too_wide(x3, layout):  # r_sum is the torch bodies' own (their forward ran)
        dx3, dw = torch_kernels.backward(x3, w, r_sum, g3, eps, layout)
        return dx3, (None if dw is None else dw.float())
    if layout.last:
        dx3 = torch.empty_like(x3)
        xr, gr, dr = _rows(x3), _rows(g3), _rows(dx3)
        if xr is not None and gr is not None and dr is not None:
            return dx3, _rows_backward(xr, w, r_sum, gr, dr, eps)
        dx3, dw = _cols_backward(x3.transpose(1, 2), w, r_sum, g3.transpose(1, 2), eps)
        return dx3.transpose(1, 2), dw
    return _cols_backward(x3, w, r_sum, g3, eps)


def _rows_forward(x: Tensor, y: Tensor, w: Optional[Tensor], r_sum: Tensor, eps: float) -> None:
    n, c = x.shape
    cfg = launch.row_config(c)
    blocks = launch.cdiv(n, cfg.rows)
    _rows_fwd[launch.grid(blocks)](
        x, y, w if w is not None else r_sum, r_sum, n, c // 2, x.stride(0), y.stride(0), float(eps), blocks,
        HAS_W=w is not None, BLOCK_C=cfg.block_c, ROWS=cfg.rows, num_warps=cfg.warps,
    )


def _dw_parts(blocks: int, warps: int, x: Tensor, w: Optional[Tensor], r_sum: Tensor) -> tuple[int, Tensor]:
    """Programs of a backward and their ``(programs, P)`` rows of partial ``dw`` (persistent with a
    weight; without one, one program per tile and ``r_sum`` as a placeholder)."""
    if w is None:
        return launch.grid(blocks)[0], r_sum
    programs = launch.persistent_programs(blocks, _sms(x.device), warps)
    return programs, torch.empty((programs, w.shape[0]), device=x.device, dtype=torch.float32)


def _rows_backward(x: Tensor, w: Optional[Tensor], r_sum: Tensor, g: Tensor, dx: Tensor,
                   eps: float) -> Optional[Tensor]:
    n, c = x.shape
    cfg = launch.row_config(c)
    blocks = launch.cdiv(n, cfg.rows)
    programs, dw_part = _dw_parts(blocks, cfg.warps, x, w, r_sum)
    _rows_bwd[(programs,)](
        x, g, dx, w if w is not None else r_sum, r_sum, dw_part, n, c // 2,
        x.stride(0), g.stride(0), dx.stride(0), float(eps), blocks,
        HAS_W=w is not None, BLOCK_C=cfg.block_c, ROWS=cfg.rows, num_warps=cfg.warps,
    )
    return dw_part.sum(0) if w is not None else None


def _cols_forward(x3: Tensor, w: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor]:
    """``(y3, r_sum)`` for ``x3`` of shape ``(A, C, L)``; ``y3`` has the strides of ``x3``
    (``empty_like``), ``r_sum`` is float32 ``(A, 1, L)``."""
    a, c, l = x3.shape
    y3 = torch.empty_like(x3)
    r_sum = torch.empty((a, 1, l), device=x3.device, dtype=torch.float32)
    cfg = launch.column_config(c, l)
    n_lb = launch.cdiv(l, cfg.block_l)
    _cols_fwd[launch.grid(a * n_lb)](
        x3, y3, w if w is not None else r_sum, r_sum, a, l, c // 2, n_lb, a * n_lb,
        *x3.stride(), *y3.stride(), float(eps),
        HAS_W=w is not None, BLOCK_P=cfg.block_p, BLOCK_L=cfg.block_l, num_warps=cfg.warps,
    )
    return y3, r_sum


def _cols_backward(x3: Tensor, w: Optional[Tensor], r_sum: Tensor, g3: Tensor,
                   eps: float) -> tuple[Tensor, Optional[Tensor]]:
    """``(dx3, dw)`` of :func:`_cols_forward` for ``g3`` of shape ``(A, C, L)``."""
    a, c, l = x3.shape
    dx3 = torch.empty_like(x3)
    cfg = launch.column_config(c, l)
    n_lb = launch.cdiv(l, cfg.block_l)
    programs, dw_part = _dw_parts(a * n_lb, cfg.warps, x3, w, r_sum)
    _cols_bwd[(programs,)](
        x3, g3, dx3, w if w is not None else r_sum, r_sum, dw_part, a, l, c // 2, n_lb, a * n_lb,
        *x3.stride(), *g3.stride(), *dx3.stride(), float(eps),
        HAS_W=w is not None, BLOCK_P=cfg.block_p, BLOCK_L=cfg.block_l, num_warps=cfg.warps,
    )
    return dx3, (dw_part.sum(0) if w is not None else None)
