"""The gradient-homogeneity monitor sees the norms of an unswapped transformers model (the
baseline arm of a language-model comparison): the probe makes its *RMSNorm layers norm layers."""

from __future__ import annotations

import math

from helpers.hf import lit_causal_lm, token_data
from helpers.lightning import fit
from helpers.recording_logger import RecordingLogger
from lightning_mrs import iter_norm_layers
from lightning_mrs.callbacks import GradientHomogeneityMonitor


def test_an_unswapped_llama_is_monitored_layer_by_layer():
    logger = RecordingLogger()
    module = lit_causal_lm("llama")
    names = [name for name, _, _ in iter_norm_layers(module)]
    assert len(names) == 5
    fit(module, callbacks=[GradientHomogeneityMonitor(log_every_n_steps=1)], data=token_data(), batch_size=4,
        logger=logger)
    for name in names:
        values = logger.history[f"phasor/{name}/grad_cv"]
        assert len(values) == 2 and all(math.isfinite(v) and v > 0 for v in values.values()), name
