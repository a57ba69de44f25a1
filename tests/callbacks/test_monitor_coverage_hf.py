"""The monitors warn only about real norms they cannot watch, never about the swap's own wiring.

With ``NormSwap(qk_norm="mrs")`` the q/k projections stay the family's ``nn.Linear`` (the QK-norm
is hooked on their output): nothing named like a norm is added besides the norms themselves, and
every norm (``q_norm``/``k_norm`` included) is watched.
"""

from __future__ import annotations

import warnings

import pytest

from helpers.hf_attention import TinyLM, token_data
from helpers.lightning import fit
from helpers.recording_logger import RecordingLogger
from lightning_mrs.callbacks import GradientHomogeneityMonitor, NormSwap, OutlierMonitor

pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_no_coverage_warning_about_the_qk_wiring(family):
    logger = RecordingLogger()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(TinyLM(family), steps=2, logger=logger, data=token_data(8), batch_size=4,
            callbacks=[NormSwap("mrs", qk_norm="mrs"), OutlierMonitor(), GradientHomogeneityMonitor()])
    coverage = [str(w.message) for w in caught if "cannot watch" in str(w.message) or "not monitoring" in str(w.message)]
    assert coverage == []
    for monitor in ("outlier", "phasor"):
        for layer in (0, 1):
            for norm in ("q_norm", "k_norm", "input_layernorm"):
                assert any(f"{monitor}/model.model.layers.{layer}.self_attn.{norm}/" in tag or
                           f"{monitor}/model.model.layers.{layer}.{norm}/" in tag for tag in logger.history), (monitor, norm)
