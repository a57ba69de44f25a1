"""NormSwap in a real Trainer: optimizer ownership, training, resume, restore, refusals.

The model is ``helpers.lightning.TinyModule`` (``conv_net``: ``net.1`` a BatchNorm2d(8),
``net.5`` a LayerNorm(8)); the multi-process launchers are in ``test_norm_swap_ddp.py``.
"""

from __future__ import annotations

import logging
import pickle
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import nn

from helpers.lightning import TinyModule, assert_same_model, fit, image_data, normswap_record
from lightning_mrs import MRSNorm, MRSNorm2d, NormAct, SwapOptions, swap_norms
from lightning_mrs.callbacks import NormSwap

BN = "mrs(channels-first, per sample, eps=1e-05)"  # what net.1 (BatchNorm2d) becomes by default
X = image_data(4, seed=7).tensors[0]  # (4, 3, 7, 5): inputs to compare outputs on


def _save(trainer: pl.Trainer, path: Path) -> Path:
    trainer.save_checkpoint(path)
    return path


def _owned(trainer: pl.Trainer) -> set[int]:
    return {id(p) for opt in trainer.optimizers for g in opt.param_groups for p in g["params"]}


# ---------------------------------------------------------------------------------- fit
@pytest.mark.parametrize("build", ["init", "configure_model"])
def test_fit_swaps_before_the_optimizer_and_the_mrs_weights_train(build, caplog):
    swap = NormSwap()
    with caplog.at_level(logging.INFO):
        trainer, model = fit(TinyModule(build=build), steps=3, callbacks=[swap])
    bn, ln = model.net[1], model.net[5]
    assert isinstance(bn, MRSNorm2d) and bn.spatial and isinstance(ln, MRSNorm)
    assert {id(bn.weight), id(ln.weight)} <= _owned(trainer)
    assert not torch.allclose(bn.weight, torch.ones_like(bn.weight))  # inherited ones, then trained
    assert swap.report.converted == ["net.1", "net.5"]
    assert "BatchNorm2d -> MRSNorm2d(spatial=True)" in caplog.text
    assert not {"setup", "configure_model", "on_load_checkpoint"} & set(vars(model))  # nothing rebound
    assert not model._load_state_dict_pre_hooks  # the checkpoint check is removed once training starts
    pickle.dumps(model)  # nothing local left on the module


def test_a_model_built_in_lightningmodule_setup_is_refused_before_training():
    # Lightning runs LightningModule.setup after the callbacks' setup: too late to swap
    model = TinyModule(build="setup")
    with pytest.raises(MisconfigurationException, match=r"\['net.1', 'net.5'\] appeared after the swap.*configure_mod"):
        fit(model, callbacks=[NormSwap()])
    assert not model._load_state_dict_pre_hooks  # removed on the exception too
    assert model.net[1].weight.grad is None  # no training step ran


def test_options_reach_the_swap():
    swap = NormSwap("layer", exclude="net.5", spatial=False)
    _, model = fit(callbacks=[swap], steps=1)
    assert type(model.net[1]).__name__ == "LayerNorm2d" and type(model.net[5]) is nn.LayerNorm
    assert "net.5" in swap.report.skipped


def test_a_swap_options_object_is_accepted():
    options = SwapOptions("rms", spatial=False)
    assert NormSwap(options).options == options
    assert NormSwap(options, eps=1e-3).options == SwapOptions("rms", spatial=False, eps=1e-3)


def test_arguments_are_validated_in_init():
    with pytest.raises(ValueError, match=r"target='batch' is not valid; choose one of \['mrs', 'rms', 'layer', 'rms-half', 'mrs-half', 'rms-half-safe', 'mrs-half-safe', 'dyt', 'derf'\]"):
        NormSwap("batch")
    with pytest.raises(ValueError, match="init='random' is not valid; choose one of"):
        NormSwap(init="random")
    with pytest.raises(ValueError, match="init='calibrate' needs calibration data, which a callback does not have"):
        NormSwap(init="calibrate")
    with pytest.raises(TypeError, match="pattern"):
        NormSwap(exclude=[1.5])
    with pytest.raises(TypeError, match=re.escape(
            "NormSwap: unknown option(s) ['exlude'] (did you mean 'exclude'?); valid options: ['target', 'spatial', "
            "'include', 'exclude', 'init', 'eps', 'strict', 'qk_norm', 'alpha0', 'shift0'].")):
        NormSwap(exlude="fc")


@pytest.mark.parametrize("kwargs,message", [
    (dict(exclude=3), "SwapOptions: exclude=3 (int) is not valid; pass a dotted-name pattern (e.g. 'head.*'), a module "
                      "type (e.g. nn.BatchNorm2d), or a list of them."),
    (dict(strict="yes"), "SwapOptions: strict='yes' is not valid; choose True or False."),
    (dict(verbose="no"), "NormSwap: verbose='no' is not valid; choose True or False."),
])
def test_arguments_of_the_wrong_type_are_refused_in_init(kwargs, message):
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        NormSwap(**kwargs)


class StaleOptimizerModule(TinyModule):
    """Captures its parameter list in __init__, before the swap: the new weights are orphans."""

    def __init__(self) -> None:
        super().__init__()
        self.stale = list(self.parameters())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.stale, lr=0.1)


def test_weights_outside_the_optimizer_are_warned_about():
    with pytest.warns(UserWarning, match=r"swapped layers \['net.1', 'net.5'\].*no optimizer holds"):
        fit(StaleOptimizerModule(), steps=1, callbacks=[NormSwap()])


# --------------------------------------------------------------------- refused strategies
def test_sharded_strategies_are_refused():
    from lightning.pytorch.strategies import FSDPStrategy

    fake = SimpleNamespace(strategy=FSDPStrategy())
    model = TinyModule()
    with pytest.raises(MisconfigurationException, match="FSDPStrategy.*ModelParallelStrategy"):
        NormSwap().setup(fake, model, "fit")
    assert isinstance(model.net[1], nn.BatchNorm2d)


def test_model_parallel_swaps_before_configure_model_and_refuses_a_model_built_there():
    """Under ModelParallelStrategy configure_model parallelises: NormSwap must not call it, so a
    model built there appears after the swap and is refused with the FSDP2 advice."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    fake = SimpleNamespace(strategy=ModelParallelStrategy())
    model = TinyModule(build="configure_model")
    swap = NormSwap(verbose=False)
    swap.setup(fake, model, "fit")
    assert model.net is None  # not built by NormSwap: that call would shard
    model.configure_model()  # Lightning's call
    with pytest.raises(MisconfigurationException, match="must be built in __init__ and only sharded in configure_model"):
        swap.on_validation_start(fake, model)
    built = TinyModule()
    swap.setup(fake, built, "fit")
    assert isinstance(built.net[1], MRSNorm2d) and swap.state_dict()["before_configure_model"] is True


@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp_fork", "ddp_notebook"])
def test_multiprocessing_launchers_are_refused_in_setup(strategy):
    # what the workers run first (the real launches are in test_norm_swap_ddp.py)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    model = TinyModule()
    with pytest.raises(MisconfigurationException, match="support strategy='ddp_spawn', 'ddp_fork' or 'ddp_notebook'"):
        NormSwap().setup(trainer, model, "fit")
    assert isinstance(model.net[1], nn.BatchNorm2d)


# ------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("build", ["init", "configure_model"])
def test_checkpoint_resume_and_restore(tmp_path, build):
    trainer, trained = fit(TinyModule(build=build), callbacks=[NormSwap()])
    path = _save(trainer, tmp_path / "last.ckpt")
    state = normswap_record(path)
    assert state["version"] == 2 and state["target"] == "mrs" and list(state["layers"]) == ["net.1", "net.5"]
    assert state["layers"]["net.1"] == {"kind": "mrs", "channel_dim": 1, "spatial": True, "eps": 1e-5}
    assert state["layers"]["net.5"] == {"kind": "mrs", "channel_dim": -1, "spatial": None, "eps": 1e-5}

    # resume: the fresh model is swapped in setup, then the weights load; training continues
    resumed, model = fit(TinyModule(build=build), steps=4, callbacks=[NormSwap()], ckpt_path=path)
    assert resumed.global_step == 4 and isinstance(model.net[1], MRSNorm2d)

    # restore: one line, exact weights and outputs
    assert_same_model(NormSwap.restore(TinyModule(build=build), path), path, trained, X)


def test_a_second_fit_records_the_swapped_model(tmp_path):
    # defect: the second fit converted nothing and recorded nothing, so neither restore nor resume worked
    _, model = fit(callbacks=[NormSwap()])
    trainer, model = fit(model, callbacks=[NormSwap()])
    path = _save(trainer, tmp_path / "second.ckpt")
    assert_same_model(NormSwap.restore(TinyModule(), path), path, model, X)
    resumed, fresh = fit(TinyModule(), steps=4, callbacks=[NormSwap()], ckpt_path=path)
    assert resumed.global_step == 4 and isinstance(fresh.net[1], MRSNorm2d)
    assert list(normswap_record(path)["layers"]) == ["net.1", "net.5"]


def test_resume_accepts_other_options_that_build_the_same_layers(tmp_path):
    # spatial="auto" turns a BatchNorm into the per-sample MRSNorm2d that spatial=True asks for
    trainer, _ = fit(callbacks=[NormSwap(spatial="auto")])
    path = _save(trainer, tmp_path / "auto.ckpt")
    resumed, model = fit(TinyModule(), steps=3, callbacks=[NormSwap(spatial=True)], ckpt_path=path)
    assert resumed.global_step == 3 and model.net[1].spatial


@pytest.mark.parametrize(
    "options,lines",
    [
        (dict(spatial=False), [f"net.1: checkpoint {BN}, this run mrs(channels-first, per position, eps=1e-05)"]),
        (dict(eps=1e-3), [f"net.1: checkpoint {BN}, this run mrs(channels-first, per sample, eps=0.001)",
                          "net.5: checkpoint mrs(channels-last, eps=1e-05), this run mrs(channels-last, eps=0.001)"]),
        # other weights: refused before Lightning loads them (no bare size mismatch)
        (dict(target="rms"), [f"net.1: checkpoint {BN} [weight (4,)], this run rms2d(channels-first, per sample, "
                              "eps=1e-05) [weight (8,)] (RMSNorm2d)"]),
        (dict(exclude="net.5"), ["net.5: checkpoint mrs(channels-last, eps=1e-05) [weight (4,)], this run not swapped "
                                 "[bias (8,), weight (8,)] (LayerNorm)"]),
    ],
    ids=["spatial", "eps", "target", "exclude"],
)
def test_resume_refuses_other_layers_naming_both(tmp_path, options, lines):
    trainer, _ = fit(callbacks=[NormSwap()])
    path = _save(trainer, tmp_path / "last.ckpt")
    with pytest.raises(MisconfigurationException) as info:
        fit(TinyModule(), steps=3, callbacks=[NormSwap(**options)], ckpt_path=path)
    message = str(info.value)
    assert message.startswith(f"NormSwap({SwapOptions(**options).describe()}): the checkpoint's norm layers differ")
    for line in lines:
        assert f"\n  {line}" in message
    assert "written with NormSwap(target='mrs'): resume with those options" in message
    assert "NormSwap.restore(model, path)" in message


def test_resume_of_a_checkpoint_trained_without_normswap_explains(tmp_path):
    trainer, _ = fit()
    path = _save(trainer, tmp_path / "plain.ckpt")
    with pytest.raises(MisconfigurationException) as info:
        fit(TinyModule(), callbacks=[NormSwap()], ckpt_path=path)
    message = str(info.value)
    assert (f"\n  net.1: checkpoint [bias (8,), num_batches_tracked (), running_mean (8,), running_var (8,), "
            f"weight (8,)], this run {BN} [weight (4,)] (MRSNorm2d)\n") in message
    assert "no NormSwap record: it was trained without NormSwap" in message and "NormSwap.restore" not in message


def test_restore_without_record_explains(tmp_path):
    trainer, _ = fit(steps=1)  # without NormSwap (a weights-only file of 0.2: test_norm_swap_checkpoints.py)
    path = _save(trainer, tmp_path / "plain.ckpt")
    with pytest.raises(ValueError, match=f"^{re.escape(f'NormSwap.restore: {path} holds no NormSwap record: it was')}"):
        NormSwap.restore(TinyModule(), path)


def _holding(data: bytes):
    def make(path: Path) -> Path:
        path.write_bytes(data)
        return path
    return make


def _truncated(path: Path) -> Path:
    torch.save({"state_dict": TinyModule().state_dict()}, path)
    return _holding(path.read_bytes()[:300])(path)  # a zip archive cut short: no central directory


def _tensor(path: Path) -> Path:
    torch.save(torch.ones(2), path)
    return path


@pytest.mark.parametrize("make,error,what", [
    (lambda p: p, FileNotFoundError, "no checkpoint at {} (no such file)."),
    (_holding(b""), ValueError, "{} is empty (0 bytes); save or copy it again."),
    (_holding(b"garbage\n"), ValueError, "{} is not a torch checkpoint file (UnpicklingError: Unsupported operand "
                                         "103); pass the .ckpt file that Lightning wrote."),
    (_truncated, ValueError, "{} is truncated or corrupted (RuntimeError: PytorchStreamReader failed reading zip "
                             "archive: failed finding central directory); save or copy it again."),
    (_tensor, ValueError, "{} holds a Tensor, not a Lightning checkpoint (a dict "
                                                              "with 'state_dict' and 'callbacks'): save it with "
                                                              "trainer.save_checkpoint."),
    (lambda p: p.parent, ValueError, "{} is a directory; pass the .ckpt file (or the directory of shards that "
                                     "ModelParallelStrategy writes, with its meta.pt)."),
], ids=["missing", "empty", "garbage", "truncated", "tensor", "directory"])
def test_restore_of_an_unreadable_file_names_it_and_what_is_wrong(tmp_path, make, error, what):
    path = make(tmp_path / "bad.ckpt")
    with pytest.raises(error, match=f"^{re.escape('NormSwap.restore: ' + what.format(path))}$"):
        NormSwap.restore(TinyModule(), path)


@pytest.mark.parametrize("model,strict,message", [
    ("resnet18", True, "NormSwap.restore: model must be a torch.nn.Module, got str ('resnet18'); build the model "
                       "first and pass it, e.g. timm.create_model('resnet18')."),
    (None, "yes", "NormSwap.restore: strict='yes' is not valid; choose True or False."),
])
def test_restore_refuses_arguments_of_the_wrong_type(tmp_path, model, strict, message):
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        NormSwap.restore(TinyModule() if model is None else model, tmp_path / "w.ckpt", strict=strict)


def _fused_net() -> nn.Sequential:
    from timm.layers import BatchNormAct2d

    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), BatchNormAct2d(8, act_layer=nn.ReLU),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5),
    )


def test_timm_fused_norm_act_restores_exactly(tmp_path):
    pytest.importorskip("timm")
    trainer, trained = fit(TinyModule(_fused_net), callbacks=[NormSwap()])
    path = _save(trainer, tmp_path / "fused.ckpt")
    assert list(normswap_record(path)["layers"]) == ["net.1.norm"]  # while a fresh model has the fused layer at net.1
    restored = NormSwap.restore(TinyModule(_fused_net), path)
    layer = restored.net[1]
    assert isinstance(layer, NormAct) and isinstance(layer.norm, MRSNorm2d) and isinstance(layer.act, nn.ReLU)
    assert_same_model(restored, path, trained, X)


# ------------------------------------------------------- checkpoints of lightning-mrs 0.1
def _v1_record(spatial: Any) -> dict[str, Any]:
    return {"version": 1, "lightning_mrs": "0.1.0", "target": "mrs", "spatial": spatial, "eps": None,
            "converted": ["net.1", "net.5"]}


@pytest.mark.parametrize("spatial", ["auto", False])
def test_version_1_checkpoints_restore(tmp_path, spatial):
    trained = TinyModule()
    swap_norms(trained, "mrs", spatial=spatial)
    with torch.no_grad():
        for p in trained.parameters():
            p.uniform_(0.5, 1.5)  # trained weights: restore must load them
    path = tmp_path / "v1.ckpt"
    torch.save({"state_dict": trained.state_dict(), "callbacks": {"NormSwap": _v1_record(spatial)}}, path)
    restored = NormSwap.restore(TinyModule(), path)
    assert isinstance(restored.net[1], MRSNorm2d) and restored.net[1].spatial is (spatial == "auto")
    assert_same_model(restored, path, trained, X)


def test_version_1_checkpoints_resume_with_their_options(tmp_path):
    trainer, _ = fit(callbacks=[NormSwap()])
    checkpoint = torch.load(_save(trainer, tmp_path / "v2.ckpt"), weights_only=True)
    checkpoint["callbacks"] = {"NormSwap": _v1_record("auto")}
    del checkpoint["state_dict"]._metadata[""]["lightning_mrs.NormSwap"]  # 0.1 kept no record in the weights
    torch.save(checkpoint, tmp_path / "v1.ckpt")
    resumed, _ = fit(TinyModule(), steps=3, callbacks=[NormSwap()], ckpt_path=tmp_path / "v1.ckpt")
    assert resumed.global_step == 3
    with pytest.raises(MisconfigurationException, match=r"checkpoint NormSwap\(target='mrs', spatial='auto', "
                       r"eps=None\), this run NormSwap\(target='mrs', spatial=False\)"):
        fit(TinyModule(), steps=3, callbacks=[NormSwap(spatial=False)], ckpt_path=tmp_path / "v1.ckpt")
