"""Fixtures of the recipe tests: the "one line, exit 2, no traceback" contract of user mistakes."""

from __future__ import annotations

import logging
import signal
import sys
from typing import Callable, Iterator

import pytest


@pytest.fixture
def error_line() -> Callable[[int, str], str]:
    """Check an exit status and stderr for one ``error: ...`` line and status 2; return the line."""

    def check(status: int, stderr: str) -> str:
        assert status == 2, stderr[-3000:]
        assert "Traceback" not in stderr
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), stderr  # no warnings, no usage text
        return lines[0]

    return check


@pytest.fixture
def recipe_error(error_line: Callable[[int, str], str], capfd: pytest.CaptureFixture,
                 monkeypatch: pytest.MonkeyPatch) -> Callable[[list[str]], str]:
    """Run ``recipes/cifar100.py``'s :func:`run` in-process (no ~6 s of imports per case) on a mistake.

    Returns the single error line; fails unless it returns 2 with exactly that line on stderr.
    """
    from recipes.cifar100 import run

    monkeypatch.setattr(sys, "argv", ["cifar100.py"])  # pytest's own arguments are not the CLI's

    def check(args: list[str]) -> str:
        status = run(args)
        return error_line(status, capfd.readouterr().err)  # fd level: Lightning logs to the real stderr

    return check


def _terminal_lines(caplog: pytest.LogCaptureFixture) -> str:
    """What the logging would have printed on a terminal's stderr: Lightning's INFO lines (``rank_zero_info``:
    its handler holds a stream pytest replaced) and every library's warnings (transformers' among them)."""
    records = [r for r in caplog.records if r.levelno >= logging.WARNING
               or (r.levelno >= logging.INFO and r.name.startswith("lightning"))]
    return "".join(f"{r.getMessage()}\n" for r in records)


@pytest.fixture
def lm_error(error_line: Callable[[int, str], str], capfd: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture,
             monkeypatch: pytest.MonkeyPatch) -> Callable[[list[str]], str]:
    """:func:`recipe_error` for ``recipes/lm.py``: run it in-process on a mistake, return the error line; the
    lines its loggers printed count too (a line of Lightning's before the error is a second line)."""
    from recipes.lm import run

    monkeypatch.setattr(sys, "argv", ["lm.py"])

    def check(args: list[str]) -> str:
        caplog.set_level(logging.INFO, logger="lightning.pytorch")
        caplog.clear()
        status = run(args)
        return error_line(status, _terminal_lines(caplog) + capfd.readouterr().err)

    return check


@pytest.fixture
def lm(capfd: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch):
    """``recipes/lm.py`` run in-process as a user's command: ``lm(args) -> (exit status, output)``
    (:class:`helpers.lm.LMRun`)."""
    from helpers.lm import LMRun

    monkeypatch.setattr(sys, "argv", ["lm.py"])
    return LMRun(capfd, caplog)


@pytest.fixture
def python_sigint() -> Iterator[None]:
    """Python's own SIGINT handler, also under a background pytest (which starts with SIGINT ignored)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)
