"""The "writing your own monitor" example of docs/monitors.md runs as written, and logs what a direct
float64 computation of its figures gives (per layer and pooled over layers)."""

from __future__ import annotations

import math
import re
import sys
import types
import warnings

import pytest
import torch
from torch import nn

from helpers import ROOT
from helpers.lightning import TinyModule, fit, image_data, per_sample_net
from helpers.recording_logger import RecordingLogger


def example() -> types.ModuleType:
    """The page's Python block under "Writing your own monitor", run as a module of its own."""
    page = (ROOT / "docs" / "monitors.md").read_text()
    section = page.split("## Writing your own monitor", 1)[1]
    (block,) = re.findall(r"^```python\n(.*?)^```", section, re.M | re.S)
    module = types.ModuleType("monitor_example")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(block, "docs/monitors.md: writing your own monitor", "exec"), module.__dict__)
    return module


def reference(data: torch.utils.data.TensorDataset, batch: int, micro: int) -> dict[str, tuple[float, float]]:
    """``(rms, max)`` of the row norms of each Linear's output in the first step's ``micro``
    forwards of ``batch // micro`` samples each (the initial weights: the first logging step's)."""
    net = TinyModule(per_sample_net).net
    outs: dict[str, list[torch.Tensor]] = {}
    for name, m in net.named_modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(lambda mod, args, out, name=name: outs.setdefault(name, []).append(out.double()))
    with torch.no_grad():
        for i in range(micro):
            net(data.tensors[0][i * batch // micro:(i + 1) * batch // micro])
    ref = {}
    for name, parts in outs.items():
        norms = torch.cat([p.norm(dim=-1) for p in parts])
        ref[f"net.{name}"] = (math.sqrt(norms.square().mean().item()), norms.max().item())
    return ref


@pytest.mark.parametrize("micro", [1, 2])
def test_activation_norm_monitor_matches_a_direct_computation(micro: int) -> None:
    monitor = example().ActivationNormMonitor(log_every_n_steps=1)
    rec, data = RecordingLogger(), image_data(16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(TinyModule(per_sample_net), steps=2, logger=rec, data=data, batch_size=8 // micro,
            accumulate_grad_batches=micro, callbacks=[monitor])
    ref = reference(data, 8, micro)
    assert set(ref) == {"net.8", "net.11"}
    for layer, (rms, peak) in ref.items():
        assert rec.history[f"z-layers/actnorm/{layer}/rms_norm"][0] == pytest.approx(rms, rel=1e-5)
        assert rec.history[f"z-layers/actnorm/{layer}/max_norm"][0] == pytest.approx(peak, rel=1e-5)
        assert sorted(rec.history[f"z-layers/actnorm/{layer}/rms_norm"]) == [0, 1]
    assert rec.history["actnorm/all/rms_norm"][0] == pytest.approx(sum(r for r, _ in ref.values()) / 2, rel=1e-5)
    assert rec.history["actnorm/all/max_norm"][0] == pytest.approx(max(p for _, p in ref.values()), rel=1e-5)
    assert monitor.state_dict() == {"n_logs": 2, "batches": 0}
