"""A real ``tensorboard`` server on 127.0.0.1 for the tests, its HTTP API, and Time Series' card order."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from helpers.ddp import free_port

__all__ = ["START_TIMEOUT_S", "compare_tags", "event_scalars", "get_json", "post_json", "session_start",
           "tensorboard_server", "time_series_groups"]

START_TIMEOUT_S = 90


def event_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of a run directory's event files: ``tag -> [(step, value), ...]``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def session_start(run_dir: Path) -> dict[str, Any]:
    """The hyperparameters of a run's HParams session (``name -> google.protobuf.Value``)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    content = acc.PluginTagToContent(metadata.PLUGIN_NAME)[metadata.SESSION_START_INFO_TAG]
    return dict(metadata.parse_session_start_info_plugin_data(content).hparams)


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - localhost only
        return json.loads(response.read().decode())


def post_json(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 - localhost only
        return json.loads(response.read().decode())


@contextlib.contextmanager
def tensorboard_server(logdir: Path, ready: Callable[[str], bool]) -> Iterator[str]:
    """``tensorboard --logdir logdir`` until ``ready(base)`` holds (``base``: ``http://127.0.0.1:<port>``);
    yields ``base``, stops the server after."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1",
         "--port", str(port), "--reload_interval", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert server.poll() is None, f"tensorboard exited: {server.stderr.read().decode()[-2000:]}"
            try:
                if ready(base):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"tensorboard was not ready within {START_TIMEOUT_S} s")
            time.sleep(0.5)
        yield base
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=15)


def _number_end(s: str, i: int) -> int:
    while i < len(s) and (s[i].isdigit() or s[i] == "."):
        i += 1
    return i


def compare_tags(a: str, b: str) -> int:
    """TensorBoard's Time Series tag order (``compareTagNames`` in ``tensorboard/webapp/metrics/utils.ts``):
    digit runs compare as numbers, and ``/`` or a digit sorts before any other character."""
    i = j = 0
    while True:
        if i == len(a):
            return 0 if j == len(b) else -1
        if j == len(b):
            return 1
        if a[i].isdigit() and b[j].isdigit():
            ei, ej = _number_end(a, i + 1), _number_end(b, j + 1)
            na, nb = float(a[i:ei].rstrip(".") or 0), float(b[j:ej].rstrip(".") or 0)
            if na != nb:
                return -1 if na < nb else 1
            i, j = ei, ej
            continue
        brk_a, brk_b = a[i] == "/" or a[i].isdigit(), b[j] == "/" or b[j].isdigit()
        if brk_a and not brk_b:
            return -1
        if brk_b and not brk_a:
            return 1
        if not brk_a and a[i] != b[j]:
            return -1 if a[i] < b[j] else 1
        i, j = i + 1, j + 1


def time_series_groups(tags: Any) -> list[tuple[str, list[str]]]:
    """The Time Series' card groups, in display order: the tags sorted by :func:`compare_tags`, grouped by
    their first component (``groupCardIdWithMetdata``)."""
    import functools

    groups: dict[str, list[str]] = {}
    for tag in sorted(set(tags), key=functools.cmp_to_key(compare_tags)):
        groups.setdefault(tag.split("/", 1)[0], []).append(tag)
    return list(groups.items())
