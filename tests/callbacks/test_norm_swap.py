"""NormSwap in a real Trainer: optimizer ownership, training, resume, restore, refusals."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mrs.callbacks import NormSwap
from lightning_mrs import MRSNorm, MRSNorm2d


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 3, 8, 8, generator=g), torch.randint(0, 4, (32,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8)


def _backbone() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.LayerNorm(8), nn.Linear(8, 4),
    )


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = _backbone()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class LateNet(Net):
    """Builds its backbone in configure_model (idempotently, as Lightning asks)."""

    def __init__(self) -> None:
        pl.LightningModule.__init__(self)
        self.net = None

    def configure_model(self) -> None:
        if self.net is None:
            self.net = _backbone()


class SetupNet(LateNet):
    """Builds its backbone in LightningModule.setup (which runs after the callbacks' setup)."""

    def configure_model(self) -> None:  # not used here
        pass

    def setup(self, stage: str) -> None:
        if self.net is None:
            self.net = _backbone()


def _trainer(tmp_path, max_steps: int, *callbacks) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, callbacks=list(callbacks),
    )


def _owned(trainer: pl.Trainer) -> set[int]:
    return {id(p) for opt in trainer.optimizers for g in opt.param_groups for p in g["params"]}


@pytest.mark.parametrize("net_cls", [Net, LateNet])
def test_fit_swaps_before_the_optimizer_and_the_mrs_weights_train(tmp_path, net_cls, caplog):
    model = net_cls()
    swap = NormSwap()
    trainer = _trainer(tmp_path, 3, swap)
    with caplog.at_level(logging.INFO):
        trainer.fit(model, _data())
    bn, ln = model.net[1], model.net[5]
    assert isinstance(bn, MRSNorm2d) and bn.spatial and isinstance(ln, MRSNorm)
    assert {id(bn.weight), id(ln.weight)} <= _owned(trainer)
    assert not torch.allclose(bn.weight, torch.ones_like(bn.weight))  # inherited ones, then trained
    assert swap.report.converted == ["net.1", "net.5"]
    assert "BatchNorm2d -> MRSNorm2d(spatial=True)" in caplog.text
    assert not {"setup", "configure_model", "on_load_checkpoint"} & set(vars(model))  # nothing rebound
    assert not model._load_state_dict_pre_hooks  # the checkpoint check is removed once training starts
    import pickle

    pickle.dumps(model)  # nothing local left on the module


def test_a_model_built_in_lightningmodule_setup_is_refused_before_training(tmp_path):
    # Lightning runs LightningModule.setup after the callbacks' setup: too late to swap
    with pytest.raises(MisconfigurationException, match=r"\['net.1', 'net.5'\] appeared after the swap.*configure_model"):
        _trainer(tmp_path, 3, NormSwap()).fit(SetupNet(), _data())


def test_checkpoint_resume_and_restore(tmp_path):
    ckpt_cb = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    _trainer(tmp_path, 2, NormSwap(), ckpt_cb).fit(Net(), _data())
    path = tmp_path / "last.ckpt"
    checkpoint = torch.load(path, weights_only=False)
    (state,) = [v for k, v in checkpoint["callbacks"].items() if k.startswith("NormSwap")]
    assert state["target"] == "mrs" and list(state["layers"]) == ["net.1", "net.5"]
    assert state["layers"]["net.1"] == {"kind": "mrs", "channel_dim": 1, "spatial": True, "eps": 1e-5}

    # resume: the fresh model is swapped in setup, then the weights load; training continues
    resumed = _trainer(tmp_path, 4, NormSwap())
    model = Net()
    resumed.fit(model, _data(), ckpt_path=path)
    assert resumed.global_step == 4 and isinstance(model.net[1], MRSNorm2d)

    # restore: one line, exact weights
    restored = NormSwap.restore(Net(), path)
    got = restored.state_dict()
    assert list(got) == list(checkpoint["state_dict"])
    for key, value in checkpoint["state_dict"].items():
        assert torch.equal(got[key], value), key
    x = torch.randn(2, 3, 8, 8)
    assert torch.isfinite(restored.eval().net(x)).all()


def test_resume_with_other_options_is_refused_clearly(tmp_path):
    _trainer(tmp_path, 1, NormSwap(), ModelCheckpoint(dirpath=tmp_path, save_last=True)).fit(Net(), _data())
    model = Net()
    with pytest.raises(MisconfigurationException, match=r"(?s)NormSwap\(target='rms'\).*net.1: the checkpoint holds \[weight \(4,\)\], this run built RMSNorm2d with \[weight \(8,\)\]"):
        _trainer(tmp_path, 2, NormSwap("rms")).fit(model, _data(), ckpt_path=tmp_path / "last.ckpt")


def test_restore_without_record_explains(tmp_path):
    trainer = _trainer(tmp_path, 1, NormSwap())
    trainer.fit(Net(), _data())
    trainer.save_checkpoint(tmp_path / "w.ckpt", weights_only=True)
    with pytest.raises(ValueError, match="no NormSwap record"):
        NormSwap.restore(Net(), tmp_path / "w.ckpt")


def test_sharded_strategies_are_refused():
    from lightning.pytorch.strategies import FSDPStrategy

    fake = SimpleNamespace(strategy=FSDPStrategy(), ckpt_path=None)
    model = Net()
    with pytest.raises(MisconfigurationException, match="FSDPStrategy.*swap_norms"):
        NormSwap().setup(fake, model, "fit")
    assert isinstance(model.net[1], nn.BatchNorm2d)


def test_arguments_are_validated_in_init():
    with pytest.raises(ValueError, match="mrs"):
        NormSwap("batch")
    with pytest.raises(ValueError, match="inherit"):
        NormSwap(init="random")
    with pytest.raises(TypeError, match="pattern"):
        NormSwap(exclude=[1.5])


def test_options_reach_the_swap(tmp_path):
    model = Net()
    swap = NormSwap("layer", exclude="net.5", spatial=False)
    _trainer(tmp_path, 1, swap).fit(model, _data())
    assert type(model.net[1]).__name__ == "LayerNorm2d" and type(model.net[5]) is nn.LayerNorm
    assert "net.5" in swap.report.skipped


class StaleOptimizerNet(Net):
    """Captures its parameter list in __init__, before the swap: the new weights are orphans."""

    def __init__(self) -> None:
        super().__init__()
        self.stale = list(self.parameters())

    def configure_optimizers(self):
        return torch.optim.SGD(self.stale, lr=0.1)


def test_weights_outside_the_optimizer_are_warned_about(tmp_path):
    with pytest.warns(UserWarning, match=r"swapped layers \['net.1', 'net.5'\].*no optimizer holds"):
        _trainer(tmp_path, 1, NormSwap()).fit(StaleOptimizerNet(), _data())


def test_restore_builds_configure_model_models(tmp_path):
    _trainer(tmp_path, 1, NormSwap(), ModelCheckpoint(dirpath=tmp_path, save_last=True)).fit(LateNet(), _data())
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)
    restored = NormSwap.restore(LateNet(), tmp_path / "last.ckpt")
    assert isinstance(restored.net[1], MRSNorm2d)
    assert all(torch.equal(restored.state_dict()[k], v) for k, v in checkpoint["state_dict"].items())
