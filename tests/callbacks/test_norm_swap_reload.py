"""Reloading a user's own module trained under NormSwap, as docs/swap.md and docs/recipes.md say:
``load_from_checkpoint`` alone fails loudly; ``NormSwap.restore`` and ``predict(ckpt_path=)`` give the trained outputs."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from helpers.lightning import TinyModule, fit, image_data
from lightning_mrs.callbacks import NormSwap


def test_own_module_reloads_through_normswap_not_load_from_checkpoint(tmp_path: Path) -> None:
    trainer, trained = fit(callbacks=[NormSwap("mrs")], steps=2)
    path = tmp_path / "m.ckpt"
    trainer.save_checkpoint(path)
    x = image_data()[:4][0]
    trained.eval()
    with torch.no_grad():
        reference = trained(x)
    with pytest.raises(RuntimeError, match=r"size mismatch for net\.1\.weight"):
        TinyModule.load_from_checkpoint(path)
    with torch.no_grad():
        restored = NormSwap.restore(TinyModule(), str(path)).eval()(x)
    torch.testing.assert_close(restored, reference, rtol=0, atol=0)
    predictor = pl.Trainer(callbacks=[NormSwap("mrs")], logger=False, enable_progress_bar=False,
                           enable_model_summary=False)
    predicted = predictor.predict(TinyModule(), torch.utils.data.DataLoader(x, batch_size=4), ckpt_path=path)[0]
    torch.testing.assert_close(predicted, reference, rtol=0, atol=0)
