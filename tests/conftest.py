"""Shared fixtures. Helpers that test modules also import directly live in ``tests/helpers``."""

from __future__ import annotations

import pytest
import torch

from helpers.recording_logger import RecordingLogger


@pytest.fixture
def recording_logger() -> RecordingLogger:
    """A fresh logger that keeps every logged value (``history[tag][step]``)."""
    return RecordingLogger()


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Every test starts from the same global seed."""
    torch.random.default_generator.manual_seed(0)  # CPU only: torch.manual_seed also queues device seeds
