"""The suite's property-based tests draw the same examples on every run (tests/conftest.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

_drawn: list[list[float]] = []


@settings(max_examples=5)
@given(st.floats(-1e3, 1e3))
def _draw(value: float) -> None:
    _drawn[-1].append(value)


def test_hypothesis_examples_repeat_across_runs(request: pytest.FixtureRequest) -> None:
    if request.config.getoption("hypothesis_profile", None) not in (None, "reproducible"):
        pytest.skip("another Hypothesis profile was chosen on the command line")
    for _ in range(2):
        _drawn.append([])
        _draw()
    assert settings.default.derandomize and settings.default.database is None
    assert _drawn[0] == _drawn[1] and len(_drawn[0]) > 1  # the same examples, not a single fixed one
