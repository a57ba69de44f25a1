"""A monitor with an interval of 1 on a compiled model: every step is a logging step, run eagerly by
design (its hooks must fire), so the model never runs compiled. Said once, at run time."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from helpers.lightning import TinyModule, fit
from lightning_mrs.callbacks import GradientHomogeneityMonitor, OutlierMonitor


class CompiledModule(TinyModule):
    """The backbone compiled in ``__init__`` (``"init"``) or in the first training step (``"lazy"``)."""

    def __init__(self, when: str) -> None:
        super().__init__()
        self.when = when
        if when == "init":
            self.net = torch.compile(self.net, backend="eager")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.when == "lazy" and not hasattr(self.net, "_orig_mod"):
            self.net = torch.compile(self.net, backend="eager")
        return super().training_step(batch, batch_idx)


def _messages(module: TinyModule, monitor: Any, *, compiled_graphs: int, **trainer_kw: Any) -> list[str]:
    """The run's warnings about it; checks the claim: how many graphs dynamo compiled."""
    torch._dynamo.reset()
    counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(module, steps=3, callbacks=[monitor], **trainer_kw)
    assert counters["stats"]["unique_graphs"] == compiled_graphs
    return [str(w.message) for w in caught if "never runs compiled" in str(w.message)]


@pytest.mark.parametrize("when", ["init", "lazy"])
def test_an_interval_of_one_on_a_compiled_model_is_said_once(when):
    (message,) = _messages(CompiledModule(when), GradientHomogeneityMonitor(log_every_n_steps=1), compiled_graphs=0)
    assert message == (
        "GradientHomogeneityMonitor: with GradientHomogeneityMonitor(log_every_n_steps=1) every training step is a "
        "logging step, and a logging step runs the model eagerly (torch.compiler.set_stance('force_eager'), so that "
        "the monitor's hooks fire): the torch.compile'd model never runs compiled in this run. Pass "
        "GradientHomogeneityMonitor(log_every_n_steps=N) with N > 1 (e.g. 50): the other steps then run compiled."
    )


def test_the_trainers_interval_is_named_when_the_monitor_takes_it():
    (message,) = _messages(CompiledModule("init"), OutlierMonitor(), compiled_graphs=0, log_every_n_steps=1)
    assert message.startswith("OutlierMonitor: with Trainer(log_every_n_steps=1) every training step")


@pytest.mark.parametrize("module,interval,graphs", [(lambda: CompiledModule("init"), 2, 1), (TinyModule, 1, 0)],
                         ids=["compiled-interval-2", "eager-interval-1"])
def test_no_warning_when_some_steps_run_compiled_or_nothing_is_compiled(module, interval, graphs):
    assert _messages(module(), GradientHomogeneityMonitor(log_every_n_steps=interval), compiled_graphs=graphs) == []
