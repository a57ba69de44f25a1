"""Shared test helpers (importable as ``helpers``: ``tests/`` is on pytest's ``pythonpath``)."""

from pathlib import Path

#: The repository root (where ``python recipes/...`` runs from).
ROOT = Path(__file__).resolve().parents[2]
