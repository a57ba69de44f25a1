"""GradientHomogeneityMonitor logs at the steps Lightning logs ``self.log`` at (``train/loss``).

Manual optimization with two optimizers (``global_step`` advances by 2 per batch), gradient
accumulation, resuming, and runs too short for the interval.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import pytest
import torch

from helpers.lightning import ManualModule, TinyModule, conv_net, fit, image_data
from helpers.recording_logger import RecordingLogger
from lightning_mrs.callbacks import GradientHomogeneityMonitor


def assert_aligned(rec: RecordingLogger, expected: list[int]) -> None:
    """``train/loss`` (Lightning) and every phasor/* tag (the monitor) at exactly ``expected``."""
    assert sorted(rec.history["train/loss"]) == expected
    steps = rec.steps("phasor/")
    assert {"z-layers/phasor/net.1/grad_cv", "z-layers/phasor/net.5/grad_cv", "phasor/all/grad_cv"} <= steps.keys()
    assert all(s == expected for s in steps.values()), steps


@pytest.mark.parametrize("interval,batches", [(1, 5), (2, 6), (4, 9), (50, 100)])
def test_manual_optimization_two_optimizers(recording_logger: RecordingLogger,
                                            interval: int, batches: int) -> None:
    """Each batch steps two optimizers, yet Lightning counts it once (resume covers new epochs)."""
    fit(ManualModule(conv_net), steps=2 * batches, logger=recording_logger, log_every_n_steps=interval,
             callbacks=[GradientHomogeneityMonitor()], data=image_data(200, (4, 4)), batch_size=2)
    assert_aligned(recording_logger, list(range(interval - 1, batches, interval)))  # (n + 1) % interval == 0


@pytest.mark.parametrize("interval", [1, 3])
def test_gradient_accumulation(recording_logger: RecordingLogger, interval: int) -> None:
    # 5 batches per epoch, pairs accumulated: Lightning also steps on each epoch's last, odd batch
    fit(conv_net, steps=6, accumulate_grad_batches=2, logger=recording_logger, log_every_n_steps=interval,
             callbacks=[GradientHomogeneityMonitor()], data=image_data(40))
    assert_aligned(recording_logger, list(range(interval - 1, 6, interval)))


@pytest.mark.parametrize("with_state", [True, False])
def test_manual_optimization_resume(tmp_path, recording_logger: RecordingLogger,
                                    with_state: bool) -> None:
    kw: dict[str, Any] = dict(log_every_n_steps=2, data=image_data(12, (4, 4)), batch_size=4)  # 3 batches an epoch
    trainer, _ = fit(ManualModule(conv_net), steps=2 * 3, callbacks=[GradientHomogeneityMonitor()], **kw)
    ckpt = tmp_path / "first.ckpt"
    trainer.save_checkpoint(ckpt)
    if not with_state:  # a checkpoint written without the monitor
        state = torch.load(ckpt, weights_only=False)
        state["callbacks"] = {k: v for k, v in state["callbacks"].items() if "GradientHomogeneityMonitor" not in k}
        torch.save(state, ckpt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(ManualModule(conv_net), steps=2 * 7, logger=recording_logger, ckpt_path=str(ckpt),
                 callbacks=[GradientHomogeneityMonitor()], **kw)
    guessed = [w for w in caught if "without the monitor's batch count" in str(w.message)]
    assert len(guessed) == (0 if with_state else 1)
    assert_aligned(recording_logger, [3, 5])  # batches 3..6 of the run


@pytest.mark.parametrize("module_cls,interval,warns", [
    (TinyModule, 100, "the run has at most 4 steps (first logging step: 99)"),  # known before the run
    (TinyModule, 4, None),
    (ManualModule, 5, "ended after step 3"),  # max_steps=8 counts both optimizers: found at the end
    (ManualModule, 4, None),
])
def test_interval_longer_than_the_run_warns_once(recording_logger: RecordingLogger,
                                                 module_cls: type, interval: int, warns: Optional[str]) -> None:
    batches = 4
    steps = batches * (2 if module_cls is ManualModule else 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(module_cls(conv_net), steps=steps, logger=recording_logger,
                 callbacks=[GradientHomogeneityMonitor(log_every_n_steps=interval)])
    ours = [str(w.message) for w in caught if "no phasor/* figure is logged" in str(w.message)]
    if warns is None:
        assert not ours and recording_logger.steps("phasor/")["phasor/all/grad_cv"] == [3]
    else:
        assert len(ours) == 1 and warns in ours[0] and f"log_every_n_steps={interval}" in ours[0]
        assert not recording_logger.steps("phasor/")
