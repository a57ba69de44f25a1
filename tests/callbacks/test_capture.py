"""The helpers every monitor's capture shares: the host copy, layer names under compile, the stance."""

from __future__ import annotations

import pytest
import torch

from lightning_mrs.callbacks import capture
from lightning_mrs.callbacks.capture import display_name, eager_while_capturing, to_host


def test_to_host_copies_first_and_casts_on_the_host(monkeypatch):
    """MPS has no float64: the flat vector leaves the device in its own float dtype, then is cast."""
    seen = []
    real = capture.apply_flat

    def spy(named, fn, dtype=None):
        def traced(flat):
            seen.append(flat.dtype)
            return fn(flat)
        return real(named, traced, dtype)

    monkeypatch.setattr(capture, "apply_flat", spy)
    monkeypatch.setattr(capture, "sums_dtype", lambda device: torch.float32)  # what an MPS device gets
    out = to_host({"count": torch.tensor(3), "sums": torch.tensor([0.5, 2.0])}, torch.float64)
    assert seen == [torch.float32]
    assert out["sums"].dtype == torch.float64 and out["sums"].tolist() == [0.5, 2.0] and out["count"].item() == 3


@pytest.mark.parametrize("name, shown", [("model._orig_mod.model.norm", "model.model.norm"),
                                         ("_orig_mod.layers.0", "layers.0"), ("net.orig_mod", "net.orig_mod")])
def test_display_name_drops_compiles_wrapper(name, shown):
    assert display_name(name) == shown


def test_the_eager_stance_is_held_while_any_capture_is_open():
    from torch._dynamo import eval_frame

    assert eval_frame._stance.stance == "default"
    eager_while_capturing.enter()
    eager_while_capturing.enter()
    assert eval_frame._stance.stance == "force_eager"
    eager_while_capturing.exit()
    assert eval_frame._stance.stance == "force_eager"  # one capture still open
    eager_while_capturing.exit()
    eager_while_capturing.exit()  # an extra close is harmless
    assert eval_frame._stance.stance == "default"
