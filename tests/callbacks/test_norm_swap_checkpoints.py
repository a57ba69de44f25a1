"""NormSwap checkpoints at the edges (issue 45 §6): weights-only files, ``predict(ckpt_path=)``,
``load_from_checkpoint``, and checkpoints of a compiled submodule.

Every restore side is a fresh ``TinyModule`` (``conv_net``: ``net.1`` a BatchNorm2d(8), ``net.5`` a
LayerNorm(8)), compared with the trained model's outputs.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from helpers.lightning import TinyModule, assert_same_model, conv_net, fit, image_data
from lightning_mrs import MRSNorm2d, swap_norms
from lightning_mrs.callbacks import NormSwap, NormSwapMixin

BN = "mrs(channels-first, per sample, eps=1e-05)"
PER_POSITION = "mrs(channels-first, per position, eps=1e-05)"
X = image_data(4, seed=7).tensors[0]
RECORD_KEY = "lightning_mrs.NormSwap"  # where the weights' metadata keeps the record


def _trainer(callbacks: list, **kw) -> pl.Trainer:
    kw.setdefault("enable_checkpointing", False)
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=callbacks, enable_progress_bar=False,
                      enable_model_summary=False, **kw)


def _weights_only_fit(tmp_path: Path, swap: NormSwap) -> tuple[Path, pl.LightningModule]:
    """Two steps with ``ModelCheckpoint(save_weights_only=True)``: its file and the trained module."""
    saver = ModelCheckpoint(dirpath=tmp_path, save_weights_only=True, every_n_train_steps=2)
    trainer = _trainer([swap, saver], max_steps=2, enable_checkpointing=True)
    model = TinyModule()
    trainer.fit(model, DataLoader(image_data(), batch_size=8))
    return Path(saver.best_model_path), model


def _predict(model: pl.LightningModule, path: Path, callbacks: list) -> torch.Tensor:
    (out,) = _trainer(callbacks).predict(model, DataLoader(X, batch_size=len(X)), ckpt_path=path)
    return out


# ------------------------------------------------------------ weights-only checkpoints
def test_a_weights_only_checkpoint_carries_the_record_and_predicts_exactly(tmp_path):
    path, trained = _weights_only_fit(tmp_path, NormSwap())
    checkpoint = torch.load(path, weights_only=True)
    assert "callbacks" not in checkpoint  # Lightning keeps no callback state in it
    record = checkpoint["state_dict"]._metadata[""][RECORD_KEY]
    assert record["layers"]["net.1"] == {"kind": "mrs", "channel_dim": 1, "spatial": True, "eps": 1e-5}
    expected = trained.eval()(X)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing unchecked: no warning
        warnings.filterwarnings("ignore", ".*(does not have many workers|LeafSpec).*")
        torch.testing.assert_close(_predict(TinyModule(), path, [NormSwap()]), expected, atol=0, rtol=0)
    assert_same_model(NormSwap.restore(TinyModule(), path), path, trained, X)


@pytest.mark.parametrize("weights_only", [True, False], ids=["weights-only", "full"])
def test_predict_under_another_spatial_is_refused_as_a_load(tmp_path, weights_only):
    # defect: the weights-only file loaded with no warning (same shapes) and the outputs differed by 0.096;
    # the full one said "so training cannot resume" in predict
    if weights_only:
        path, _ = _weights_only_fit(tmp_path, NormSwap())
    else:
        trainer, _ = fit(callbacks=[NormSwap()])
        trainer.save_checkpoint(path := tmp_path / "full.ckpt")
    with pytest.raises(MisconfigurationException) as info:
        _predict(TinyModule(), path, [NormSwap(spatial=False)])
    message = str(info.value)
    assert message.startswith("NormSwap(target='mrs', spatial=False): the checkpoint's norm layers differ from the "
                              "ones this run built, so its weights cannot be loaded:\n")
    assert f"\n  net.1: checkpoint {BN}, this run {PER_POSITION}\n" in message
    assert "written with NormSwap(target='mrs'): pass NormSwap with those options to this Trainer" in message
    assert "training cannot resume" not in message


def test_resume_from_a_weights_only_checkpoint_under_another_spatial_is_refused(tmp_path):
    path, _ = _weights_only_fit(tmp_path, NormSwap())
    with pytest.raises(MisconfigurationException, match=re.escape(f"net.1: checkpoint {BN}, this run {PER_POSITION}")):
        fit(TinyModule(), steps=3, callbacks=[NormSwap(spatial=False)], ckpt_path=path)


def _without_record(path: Path) -> Path:
    """The file as a weights-only checkpoint of lightning-mrs 0.2 was: no record anywhere."""
    checkpoint = torch.load(path, weights_only=True)
    del checkpoint["state_dict"]._metadata[""][RECORD_KEY]
    torch.save(checkpoint, path)
    return path


def test_a_checkpoint_without_record_warns_naming_what_was_not_checked(tmp_path):
    path, trained = _weights_only_fit(tmp_path, NormSwap())
    _without_record(path)
    with pytest.warns(UserWarning) as record:
        out = _predict(TinyModule(), path, [NormSwap()])
    (message,) = [str(w.message) for w in record if "NormSwap record" in str(w.message)]
    assert message.startswith(f"NormSwap(target='mrs'): the checkpoint {path} has no NormSwap record")
    assert "only its weights' names and shapes could be checked, not the swapped layers' kind, layout (per sample " \
           "or per position) or eps" in message
    torch.testing.assert_close(out, trained.eval()(X), atol=0, rtol=0)  # here the options were the same
    with pytest.raises(ValueError, match="holds no NormSwap record: it was trained without the NormSwap callback, "
                                         "or saved with weights_only=True by lightning-mrs 0.2 or older"):
        NormSwap.restore(TinyModule(), path)


# ------------------------------------------------------------ load_from_checkpoint
class MixedModule(NormSwapMixin, TinyModule):
    """A user's LightningModule with the mixin in its bases."""


@pytest.mark.parametrize("weights_only", [False, True], ids=["full", "weights-only"])
def test_load_from_checkpoint_with_the_mixin_rebuilds_the_swap(tmp_path, weights_only):
    trainer, trained = fit(MixedModule(), callbacks=[NormSwap()])
    trainer.save_checkpoint(path := tmp_path / "last.ckpt", weights_only=weights_only)
    loaded = MixedModule.load_from_checkpoint(path)
    assert isinstance(loaded.net[1], MRSNorm2d) and loaded.net[1].spatial
    assert_same_model(loaded, path, trained, X)


def test_without_the_mixin_load_from_checkpoint_fails_in_torch(tmp_path):
    # the limit the mixin is for (docs/limits.md): nothing of lightning-mrs runs in this call
    trainer, _ = fit(callbacks=[NormSwap()])
    trainer.save_checkpoint(path := tmp_path / "last.ckpt")
    with pytest.raises(RuntimeError, match="Missing key"):
        TinyModule.load_from_checkpoint(path)


def test_the_mixin_predicts_without_normswap_and_defers_to_it(tmp_path):
    trainer, trained = fit(MixedModule(), callbacks=[NormSwap()])
    trainer.save_checkpoint(path := tmp_path / "last.ckpt")
    torch.testing.assert_close(_predict(MixedModule(), path, []), trained.eval()(X), atol=0, rtol=0)
    with pytest.raises(MisconfigurationException, match=re.escape(f"this run {PER_POSITION}")):
        _predict(MixedModule(), path, [NormSwap(spatial=False)])  # NormSwap swapped and checks: no rebuild


def _other_net() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                               torch.nn.Flatten(), torch.nn.Linear(8, 5))


class OtherModule(NormSwapMixin, TinyModule):
    def __init__(self) -> None:
        super().__init__(_other_net)


def test_the_mixin_refuses_another_architecture_naming_the_layers(tmp_path):
    trainer, _ = fit(MixedModule(), callbacks=[NormSwap()])
    trainer.save_checkpoint(path := tmp_path / "last.ckpt")
    with pytest.raises(ValueError, match=r"(?s)^OtherModule.load_from_checkpoint \(NormSwapMixin\): the model "
                                         r"does not match.*\n  net\.1: recorded "):
        OtherModule.load_from_checkpoint(path)


# ------------------------------------------------------------ compiled submodules
class CompiledModule(TinyModule):
    """``TinyModule`` whose backbone is compiled in ``__init__``: its weights are ``net._orig_mod.*``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.compile(self.net, backend="eager")


def test_a_compiled_checkpoint_restores_into_the_uncompiled_model_and_back(tmp_path):
    torch._dynamo.reset()
    trainer, trained = fit(CompiledModule(), callbacks=[NormSwap()])
    trainer.save_checkpoint(path := tmp_path / "compiled.ckpt")
    assert "net._orig_mod.1.weight" in torch.load(path, weights_only=True)["state_dict"]
    restored = NormSwap.restore(TinyModule(), path)  # defect: "net._orig_mod.1: ..., this model not swapped"
    assert isinstance(restored.net[1], MRSNorm2d)
    for key, value in trained.state_dict().items():
        assert torch.equal(restored.state_dict()[key.replace("_orig_mod.", "")], value), key
    torch.testing.assert_close(restored.eval()(X), trained.eval()(X), atol=0, rtol=0)

    plain, eager = fit(callbacks=[NormSwap()])
    plain.save_checkpoint(path := tmp_path / "plain.ckpt")
    compiled = NormSwap.restore(CompiledModule(), path)
    torch.testing.assert_close(compiled.eval()(X), eager.eval()(X), atol=0, rtol=0)


def test_resume_across_compilation(tmp_path):
    torch._dynamo.reset()
    trainer, _ = fit(CompiledModule(), callbacks=[NormSwap()])
    trainer.save_checkpoint(path := tmp_path / "compiled.ckpt")
    resumed, model = fit(TinyModule(), steps=3, callbacks=[NormSwap()], ckpt_path=path)
    assert resumed.global_step == 3 and isinstance(model.net[1], MRSNorm2d)


def test_a_model_swapped_without_normswap_records_nothing_to_check(tmp_path):
    # swapped in __init__ and trained without the callback, then predicted with it: the shapes
    # match, nothing records the layout, so NormSwap warns
    def swapped() -> torch.nn.Module:
        net = conv_net()
        swap_norms(net, "mrs", spatial=False)
        return net

    trainer, _ = fit(TinyModule(swapped))
    trainer.save_checkpoint(path := tmp_path / "plain.ckpt")
    with pytest.warns(UserWarning, match="has no NormSwap record"):
        _predict(TinyModule(), path, [NormSwap(spatial=False)])
