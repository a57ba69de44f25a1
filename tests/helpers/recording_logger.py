"""A Lightning logger for tests that keeps every logged value: ``history[tag][step] = value``."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional

from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only

from lightning_mrs.callbacks.tb_layout import LAYERS


def monitor_tag(tag: str, prefix: str) -> bool:
    """Whether ``tag`` starts with ``prefix`` or is a per-layer tag of that monitor (``z-layers/<prefix>``)."""
    return tag.startswith(prefix) or tag.startswith(f"{LAYERS}/{prefix}")


class RecordingLogger(Logger):
    """Keeps every logged value: ``history[tag][step] = value``."""

    def __init__(self) -> None:
        super().__init__()
        self.history: dict[str, dict[Optional[int], float]] = defaultdict(dict)

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def steps(self, prefix: str) -> dict[str, list[int]]:
        """The steps each tag under ``prefix`` (a monitor's ``phasor/``: its summary and per-layer tags,
        :func:`monitor_tag`) was logged at, ascending."""
        return {tag: sorted(series) for tag, series in self.history.items() if monitor_tag(tag, prefix)}

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        for key, value in metrics.items():
            self.history[key][None if step is None else int(step)] = float(value)

    @rank_zero_only
    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass
