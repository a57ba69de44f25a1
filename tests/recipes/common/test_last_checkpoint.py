"""``last.ckpt`` holds the latest validation's state, also when the monitored metric stops
improving (Lightning 2.6's ``save_last`` then leaves it at the last best step): the recipes' second
``ModelCheckpoint`` (``monitor=None``: Lightning's own "keep the latest") writes it."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning.pytorch.callbacks import ModelCheckpoint

from recipes.common.interrupt import last_checkpoint, resume_callbacks


class Worsening(pl.LightningModule):
    """A linear model whose logged ``val/score`` gets worse every epoch (best at epoch 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("val/score", -float(self.current_epoch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(tmp_path, callbacks: list[pl.Callback], **trainer_options) -> pl.Trainer:
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
    trainer = pl.Trainer(max_epochs=3, default_root_dir=tmp_path, callbacks=callbacks, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, **trainer_options)
    trainer.fit(Worsening(), data, data)
    return trainer


# Lightning saves at the end of the training epoch by default, at validation's end when validating mid-epoch
@pytest.mark.parametrize("val_check_interval", [1.0, 1], ids=["epoch-end", "every-step"])
def test_last_ckpt_is_the_latest_validation_not_the_best(tmp_path, val_check_interval):
    best = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val/score", mode="max")
    latest = resume_callbacks()[0]
    latest.dirpath = str(tmp_path / "ckpt")
    trainer = _fit(tmp_path, [best, latest], val_check_interval=val_check_interval)
    assert trainer.global_step == 6
    saved_best = torch.load(best.best_model_path, weights_only=False)
    assert saved_best["global_step"] == (2 if val_check_interval == 1.0 else 1)  # epoch 0: the best, never beaten
    last = tmp_path / "ckpt" / "last.ckpt"
    saved = torch.load(last, weights_only=False)
    assert saved["global_step"] == 6 and saved["epoch"] == 2
    weights = dict(trainer.lightning_module.state_dict())
    assert all(torch.equal(saved["state_dict"][k], v) for k, v in weights.items())
    assert last_checkpoint(trainer) == str(last)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == sorted([Path(best.best_model_path).name,
                                                                            "last.ckpt"])
    # Lightning's own save_last (what the recipes used before) leaves last.ckpt at the best step: the check can fail
    own = ModelCheckpoint(dirpath=tmp_path / "own", monitor="val/score", mode="max", save_last=True)
    _fit(tmp_path, [own], val_check_interval=val_check_interval)
    assert torch.load(tmp_path / "own" / "last.ckpt", weights_only=False)["global_step"] != 6
