"""The ``triton`` backend: MRSNorm kernels for CUDA (one ``S`` per position; Liger-Kernel's RMSNorm pattern).

The input is an ``(A, C, L)`` view with any strides (tokens ``(M, C, 1)``, NCHW, NHWC): one
program normalises a tile of ``BLOCK_L`` positions of one ``a``, all ``P = C/2`` phasors at
once, with the even and odd channels as two strided loads. The forward stores ``y`` and the
per-group ``r_sum = P * S``; the backward recomputes ``r`` from ``x`` and, like Liger's
RMSNorm, loops each program over many tiles to accumulate its partial ``dw`` in registers
(one ``(programs, P)`` buffer summed at the end instead of one row per tile).

Imports without triton (:func:`unavailable` then says so); tested on the CPU under
``TRITON_INTERPRET=1`` (``tests/ops/test_triton_interpret.py``).
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
from torch import Tensor

from lightning_mrs.ops.layout import DispatchKey, Layout
from lightning_mrs.ops.torch_kernels import per_channel

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional
    triton = None

__all__ = ["NAME", "available", "backward", "forward", "unavailable"]

NAME = "triton"
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_MAX_TILE = 4096  # elements of a (BLOCK_P, BLOCK_L) tile: registers per program


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Triton is importable and a CUDA device is present."""
    return triton is not None and torch.cuda.is_available()


def _blocks(c: int, l: int) -> tuple[int, int, int]:
    block_p = triton.next_power_of_2(max(c // 2, 1))
    block_l = max(1, min(triton.next_power_of_2(l), _MAX_TILE // block_p))
    warps = 1 if block_p * block_l <= 256 else 4 if block_p * block_l <= 2048 else 8
    return block_p, block_l, warps


if triton is not None:

    @triton.jit
    def _fwd_kernel(
        X, Y, W2, RS,
        L, P,
        sxa, sxc, sxl, sya, syc, syl,
        eps,
        HAS_W: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_L: tl.constexpr,
    ):
        a = tl.program_id(0)
        lb = tl.program_id(1)
        p = tl.arange(0, BLOCK_P)[:, None]  # (BLOCK_P, 1) phasor index
        l = lb * BLOCK_L + tl.arange(0, BLOCK_L)[None, :]  # (1, BLOCK_L) position
        mask = (p < P) & (l < L)
        xb = X + a * sxa + l * sxl
        xe = tl.load(xb + (2 * p) * sxc, mask=mask, other=0.0).to(tl.float32)
        xo = tl.load(xb + (2 * p + 1) * sxc, mask=mask, other=0.0).to(tl.float32)
        r = tl.where(mask, tl.sqrt(xe * xe + xo * xo + eps), 0.0)
        r_sum = tl.sum(r, axis=0)  # (BLOCK_L,) = P * S
        lv = lb * BLOCK_L + tl.arange(0, BLOCK_L)
        scale = (P / tl.where(lv < L, r_sum, 1.0))[None, :]  # padded lanes stay finite
        if HAS_W:
            scale = scale * tl.load(W2 + 2 * p, mask=p < P, other=0.0).to(tl.float32)
        yb = Y + a * sya + l * syl
        tl.store(yb + (2 * p) * syc, (xe * scale).to(Y.dtype.element_ty), mask=mask)
        tl.store(yb + (2 * p + 1) * syc, (xo * scale).to(Y.dtype.element_ty), mask=mask)
        tl.store(RS + a * L + lv, r_sum, mask=lv < L)

    @triton.jit
    def _bwd_kernel(
        X, G, DX, W2, RS, DWP,
        A, L, P, n_lb, n_prog,
        sxa, sxc, sxl, sga, sgc, sgl, sda, sdc, sdl,
        eps,
        HAS_W: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_L: tl.constexpr,
    ):
        pid = tl.program_id(0)
        p = tl.arange(0, BLOCK_P)[:, None]
        pmask = p < P
        if HAS_W:
            w = tl.load(W2 + 2 * p, mask=pmask, other=0.0).to(tl.float32)  # (BLOCK_P, 1)
        else:
            w = tl.full((BLOCK_P, 1), 1.0, tl.float32)
        dw_acc = tl.zeros((BLOCK_P,), dtype=tl.float32)
        for t in range(pid, A * n_lb, n_prog):  # tiles (a, lb), strided over the programs
            a = t // n_lb
            lb = t % n_lb
            lv = lb * BLOCK_L + tl.arange(0, BLOCK_L)
            l = lv[None, :]
            mask = pmask & (l < L)
            xb = X + a * sxa + l * sxl
            gb = G + a * sga + l * sgl
            xe = tl.load(xb + (2 * p) * sxc, mask=mask, other=0.0).to(tl.float32)
            xo = tl.load(xb + (2 * p + 1) * sxc, mask=mask, other=0.0).to(tl.float32)
            ge = tl.load(gb + (2 * p) * sgc, mask=mask, other=0.0).to(tl.float32)
            go = tl.load(gb + (2 * p + 1) * sgc, mask=mask, other=0.0).to(tl.float32)
            rinv = 1.0 / tl.sqrt(xe * xe + xo * xo + eps)  # r recomputed, not saved
            r_sum = tl.load(RS + a * L + lv, mask=lv < L, other=1.0)  # (BLOCK_L,)
            inv = (P / r_sum)[None, :]  # 1/S
            gwe = ge * w
            gwo = go * w
            c = tl.sum(gwe * xe + gwo * xo, axis=0)[None, :]  # sum_k w g x per position
            k = c * inv * inv / P
            db = DX + a * sda + l * sdl
            tl.store(db + (2 * p) * sdc, (gwe * inv - k * xe * rinv).to(DX.dtype.element_ty), mask=mask)
            tl.store(db + (2 * p + 1) * sdc, (gwo * inv - k * xo * rinv).to(DX.dtype.element_ty), mask=mask)
            dw_acc += tl.sum((ge * xe + go * xo) * inv, axis=1)
        pv = tl.arange(0, BLOCK_P)
        tl.store(DWP + pid * P + pv, dw_acc, mask=pv < P)


def _check(x3: Tensor) -> None:
    if triton is None:
        raise RuntimeError("lightning_mrs.ops.triton_kernels needs the triton package.")
    if x3.ndim != 3 or x3.shape[1] % 2:
        raise ValueError(f"expected an (A, C, L) view with C even, got {tuple(x3.shape)}")


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


def forward(x3: Tensor, w: Optional[Tensor], eps: float, layout: Layout) -> tuple[Tensor, Tensor]:
    """``(y3, r_sum)`` for a canonical view with any strides (see :mod:`lightning_mrs.ops.layout`)."""
    w2 = per_channel(w)  # (C,)
    if layout.last:
        y3, r_sum = _forward(x3.transpose(1, 2), w2, eps)  # (A, C, L) strided view
        return y3.transpose(1, 2), r_sum
    return _forward(x3, w2, eps)


def backward(x3: Tensor, w: Optional[Tensor], r_sum: Tensor, g3: Tensor, eps: float,
             layout: Layout) -> tuple[Tensor, Optional[Tensor]]:
    """``(dx3, dw)`` of :func:`forward` for the upstream gradient ``g3`` (``dw`` per phasor)."""
    w2 = per_channel(w)  # (C,)
    if layout.last:
        dx3, dw = _backward(x3.transpose(1, 2), w2, r_sum, g3.transpose(1, 2), eps)
        return dx3.transpose(1, 2), dw
    return _backward(x3, w2, r_sum, g3, eps)


def _forward(x3: Tensor, w2: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor]:
    """``(y3, r_sum)`` for ``x3`` of shape ``(A, C, L)``; ``w2`` the per-channel gain ``(C,)``.

    ``y3`` has the strides of ``x3`` (``empty_like``), ``r_sum`` is float32 ``(A, 1, L)``.
    """
    _check(x3)
    a, c, l = x3.shape
    y3 = torch.empty_like(x3)
    r_sum = torch.empty((a, 1, l), device=x3.device, dtype=torch.float32)
    block_p, block_l, warps = _blocks(c, l)
    grid = (a, triton.cdiv(l, block_l))
    w_arg = w2 if w2 is not None else r_sum  # a dummy pointer when there is no weight
    _fwd_kernel[grid](
        x3, y3, w_arg, r_sum, l, c // 2,
        *x3.stride(), *y3.stride(), float(eps),
        HAS_W=w2 is not None, BLOCK_P=block_p, BLOCK_L=block_l, num_warps=warps,
    )
    return y3, r_sum


def _n_programs(device: torch.device, tiles: int) -> int:
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(tiles, 4 * sms))
    return max(1, min(tiles, 4))  # the CPU interpreter: a few programs, each loops tiles


def _backward(
    x3: Tensor, w2: Optional[Tensor], r_sum: Tensor, g3: Tensor, eps: float
) -> tuple[Tensor, Optional[Tensor]]:
    """``(dx3, dw)`` of :func:`_forward` for ``g3`` of shape ``(A, C, L)``."""
    _check(x3)
    a, c, l = x3.shape
    dx3 = torch.empty_like(x3)
    block_p, block_l, warps = _blocks(c, l)
    n_lb = triton.cdiv(l, block_l)
    n_prog = _n_programs(x3.device, a * n_lb)
    dw_part = torch.empty((n_prog, c // 2), device=x3.device, dtype=torch.float32)
    w_arg = w2 if w2 is not None else r_sum
    _bwd_kernel[(n_prog,)](
        x3, g3, dx3, w_arg, r_sum, dw_part,
        a, l, c // 2, n_lb, n_prog,
        *x3.stride(), *g3.stride(), *dx3.stride(), float(eps),
        HAS_W=w2 is not None, BLOCK_P=block_p, BLOCK_L=block_l, num_warps=warps,
    )
    dw = dw_part.sum(0) if w2 is not None else None  # (P,)
    return dx3, dw
