"""Safe loading (issue 48 §4): NormSwap reads checkpoints with ``torch.load(weights_only=True)``.

A file holding other Python objects is refused, naming it and the opt-in, before anything in it
runs; Lightning's own checkpoints (weights, loops, optimizer, scheduler and callback states,
``hyper_parameters``) and NormSwap's record are plain data and restore as before.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from helpers.lightning import TinyModule, assert_same_model, fit, image_data
from lightning_mrs.callbacks import NormSwap

X = image_data(4, seed=7).tensors[0]


class Payload:
    """Unpickling it creates ``marker``: what a malicious checkpoint would do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")  # unpickled: open(marker, "w") creates the file


def _checkpoint_with(tmp_path: Path, extra: object) -> tuple[Path, pl.LightningModule]:
    """A real NormSwap checkpoint, with ``extra`` added to its ``hyper_parameters``."""
    trainer, trained = fit(callbacks=[NormSwap()])
    trainer.save_checkpoint(path := tmp_path / "last.ckpt")
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["hyper_parameters"] = {"extra": extra}
    torch.save(checkpoint, path)
    return path, trained


def test_a_file_that_would_run_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "MARKER"
    path, _ = _checkpoint_with(tmp_path, Payload(marker))
    assert not marker.exists()
    with pytest.raises(ValueError) as info:
        NormSwap.restore(TinyModule(), path)
    assert not marker.exists()  # nothing in the file ran
    assert str(info.value) == (
        f"NormSwap.restore: {path} holds Python objects other than tensors and plain data (Unsupported global: "
        "GLOBAL io.open was not an allowed global by default), which a safe load (torch.load(weights_only=True)) "
        "refuses: unpickling them can run any code. Only if you trust the file's source, pass "
        "NormSwap.restore(model, path, weights_only=False), or allow those classes with "
        "torch.serialization.add_safe_globals([...])."
    )


def test_a_trusted_file_with_other_objects_restores_on_opt_in(tmp_path):
    path, trained = _checkpoint_with(tmp_path, argparse.Namespace(lr=0.1))
    with pytest.raises(ValueError, match=re.escape("(Unsupported global: GLOBAL argparse.Namespace was not")):
        NormSwap.restore(TinyModule(), path)
    restored = NormSwap.restore(TinyModule(), path, weights_only=False)  # the opt-in
    with torch.serialization.safe_globals([argparse.Namespace]):  # torch's allow-list, still weights_only=True
        assert_same_model(restored, path, trained, X)
        assert_same_model(NormSwap.restore(TinyModule(), path), path, trained, X)


def test_weights_only_must_be_a_bool(tmp_path):
    with pytest.raises(TypeError, match=re.escape("NormSwap.restore: weights_only='no' is not valid; choose True or "
                                                  "False.")):
        NormSwap.restore(TinyModule(), tmp_path / "w.ckpt", weights_only="no")


class HParamsModule(TinyModule):
    """Saves its hyperparameters and steps a scheduler: what a real Lightning checkpoint holds."""

    def __init__(self, lr: float = 0.05, milestones: tuple[int, ...] = (1,), name: str = "tiny") -> None:
        super().__init__(lr=lr)
        self.save_hyperparameters()

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        return [opt], [torch.optim.lr_scheduler.MultiStepLR(opt, list(self.hparams.milestones))]


def test_a_real_lightning_checkpoint_restores_with_weights_only(tmp_path):
    saver = ModelCheckpoint(dirpath=tmp_path, monitor="train/loss", save_last=True)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, log_every_n_steps=1,
                         callbacks=[NormSwap(), saver], enable_progress_bar=False, enable_model_summary=False)
    trained = HParamsModule()
    trainer.fit(trained, DataLoader(image_data(), batch_size=8))
    path = Path(saver.last_model_path)
    checkpoint = torch.load(path, weights_only=True)  # what the restore reads: every part plain
    assert {"hyper_parameters", "optimizer_states", "lr_schedulers", "loops", "callbacks"} <= checkpoint.keys()
    assert any(key.startswith("ModelCheckpoint") for key in checkpoint["callbacks"])
    assert_same_model(NormSwap.restore(HParamsModule(), path), path, trained, X)
