"""The launch arithmetic of the Triton kernels: tiles, warps and grids, as pure functions (free of
triton, so every choice is tested alone, for shapes no test could allocate).

**Tiles.** A program holds whole rows (the next power of two of ``C``) in registers, several where
rows are short, so that every program moves about :data:`TILE` elements (Liger's RMSNorm: 16
rows at ``C <= 256``). **Warps.** :func:`warps_for`: 16 float32 values of a tile per thread (4 warps
for 2,048 elements, 32 from 16,384: the backward holds ``x``, ``g`` and their product, so more
warps where registers would spill). **Grids.** One dimension, folded: at most ``2^31 - 1``
programs, each looping over ``range(pid, blocks, programs)``; the backward is persistent, a few
programs per SM (:func:`persistent_programs`), each summing its part of ``dw`` in registers.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

__all__ = [
    "MAX_CHANNELS", "MAX_GRID0", "TILE", "ColumnConfig", "RowConfig", "column_config", "grid",
    "next_power_of_2", "persistent_programs", "row_config", "warps_for",
]

#: Elements of one program's tile (several rows of a narrow row; one row of a wide one).
TILE = 2048
#: CUDA's limit on grid dim 0 (dims 1 and 2: 65,535; the kernels use dim 0 only).
MAX_GRID0 = 2**31 - 1
#: The widest row a program holds in registers (Liger's ``MAX_FUSED_SIZE``).
MAX_CHANNELS = 65536
#: Warps an SM keeps resident for the persistent backward (half of an H100's 64).
_WARPS_PER_SM = 32


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``), as ``triton.next_power_of_2``."""
    return 1 << max(0, int(n) - 1).bit_length()


def warps_for(elements: int) -> int:
    """Warps of a program whose tile has ``elements`` values: 16 per thread, 1 to 32 warps."""
    return min(32, max(1, elements // 512))


class RowConfig(NamedTuple):
    """The launch of the row kernels (channels contiguous)."""

    block_c: int  # channels of a row in registers (a power of two >= C)
    rows: int  # rows per program
    warps: int


class ColumnConfig(NamedTuple):
    """The launch of the column kernels (``(A, C, L)``: channels strided, positions inner)."""

    block_p: int  # phasors in registers (a power of two >= C / 2)
    block_l: int  # positions per tile
    warps: int


def _check_width(c: int) -> None:
    if c > MAX_CHANNELS:
        raise ValueError(
            f"the Triton kernels hold at most {MAX_CHANNELS} channels of a row in registers, not {c} "
            "(triton_kernels runs wider rows with the torch backend's bodies; backend='inductor' compiles them)."
        )


def row_config(c: int) -> RowConfig:
    """Tile and warps for rows of ``c`` channels: several rows per program while a row is
    shorter than :data:`TILE`, one row (up to :data:`MAX_CHANNELS`) otherwise.

    Example:
        >>> row_config(128)  # a QK-norm of head_dim 128: 16 rows per program, 4 warps
        RowConfig(block_c=128, rows=16, warps=4)
        >>> row_config(16384)
        RowConfig(block_c=16384, rows=1, warps=32)
    """
    _check_width(c)
    block_c = next_power_of_2(max(c, 2))
    rows = max(1, TILE // block_c)
    return RowConfig(block_c, rows, warps_for(block_c * rows))


def column_config(c: int, l: int) -> ColumnConfig:
    """Tile and warps for an ``(A, C, L)`` view: every phasor, and as many of the ``L``
    positions as fill :data:`TILE` elements (at least one).

    Example:
        >>> column_config(64, 35)  # NCHW, 64 channels, 5 x 7 positions
        ColumnConfig(block_p=32, block_l=32, warps=4)
    """
    _check_width(c)
    block_p = next_power_of_2(max(c // 2, 1))
    block_l = max(1, min(next_power_of_2(l), TILE // (2 * block_p)))
    return ColumnConfig(block_p, block_l, warps_for(2 * block_p * block_l))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def grid(blocks: int, cap: Optional[int] = None) -> tuple[int]:
    """The 1-d grid of ``blocks`` tiles: at most ``cap`` programs (CUDA's dim-0 limit), each
    looping over ``range(pid, blocks, programs)``; at least one program (an empty input)."""
    return (max(1, min(blocks, cap or MAX_GRID0)),)


def persistent_programs(blocks: int, sms: int, warps: int, cap: Optional[int] = None) -> int:
    """Programs of a persistent backward: enough to keep :data:`_WARPS_PER_SM` warps on
    each of ``sms`` SMs (``32 // warps`` programs per SM, at least one), never more than
    ``blocks`` tiles or ``cap``. Each writes one ``(P,)`` row of partial ``dw``."""
    return max(1, min(blocks, cap or MAX_GRID0, sms * max(1, _WARPS_PER_SM // warps)))

