"""Checks the monitor tests share: what TensorBoard stored of a run (scalar steps, the last
custom-scalars layout) and a monitor's ``state_dict`` round trip."""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["assert_state_round_trip", "tensorboard_run"]


def tensorboard_run(log_dir: str) -> tuple[Callable[[str], list[int]], dict[str, list[str]]]:
    """``(steps_of, layout)`` of a TensorBoard run: ``steps_of(tag)`` the steps a scalar was
    logged at, ``layout`` the custom-scalars category title -> its multiline tag regexes, as
    the *last* layout written (the one TensorBoard shows)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    last = acc.Tensors("custom_scalars__config__")[-1]
    layout = layout_pb2.Layout.FromString(last.tensor_proto.string_val[0])
    categories = {c.title: [t for chart in c.chart for t in chart.multiline.tag] for c in layout.category}
    return (lambda tag: [e.step for e in acc.Scalars(tag)]), categories


def assert_state_round_trip(monitor: Any, fresh: Any, expected: dict[str, Any]) -> None:
    """``monitor`` (after a fit) has the state ``expected``, and ``fresh`` takes it over."""
    state = monitor.state_dict()
    assert state == expected
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state and fresh.n_logs == expected["n_logs"]
