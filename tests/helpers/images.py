"""Tiny image folders for the recipe tests (ImageFolder layouts)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["write_images"]


def write_images(folder: Path, n: int, size: tuple[int, int] = (20, 12), colour: int = 0) -> None:
    """``n`` small PNGs ``img<i>.png`` in ``folder`` (made), each a different plain colour."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        Image.new("RGB", size, (colour, 10 * i, 255 - colour)).save(folder / f"img{i}.png")
