"""recipes/cifar100.py with a vision transformer: QK-norms, AdamW and its parameter groups, the ViT configs."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch
import yaml
from torch import nn

from helpers import ROOT
from lightning_mrs import MRSNorm
from recipes.cifar100 import build_cli, run
from recipes.vision.classifier import ImageClassifier
from recipes.common.errors import UsageError
from recipes.sweeps.kinds.qk import VIT_CIFAR, VIT_DIGITS

VIT = "timm:vit_tiny_patch16_224"
SMALL = {**VIT_DIGITS, "depth": 2}  # the digits ViT with 2 blocks: 8x8 inputs, 4 heads of width 16
CONFIGS = ROOT / "recipes" / "configs"
QK_TYPES = {"mrs": MRSNorm, "rms": nn.RMSNorm, "layer": nn.LayerNorm}


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Train on one thread: on a shared 2-core machine, OpenMP's second thread waits more than it works."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _vit(**kwargs: object) -> ImageClassifier:
    return ImageClassifier(arch=VIT, arch_kwargs=SMALL, num_classes=10, **kwargs)  # type: ignore[arg-type]


def _attention(model: nn.Module) -> list[nn.Module]:
    return [m for n, m in model.named_modules() if n.endswith(".attn")]


def _body_norms(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if n == "norm" or n.split(".")[-1] in ("norm1", "norm2")}


@pytest.mark.parametrize("qk", ["mrs", "rms", "layer"])
def test_qk_norm_on_every_attention_layer_body_norms_kept(qk: str) -> None:
    fresh = _vit(norm="batch")  # batch: the model's own norms, nothing swapped
    model = _vit(norm="batch", qk_norm=qk)
    layers = _attention(model.model)
    assert len(layers) == SMALL["depth"]
    head_dim = SMALL["embed_dim"] // SMALL["num_heads"]
    for attn in layers:
        for norm in (attn.q_norm, attn.k_norm):
            assert type(norm) is QK_TYPES[qk], norm  # exactly that class: timm's LayerNorm is a subclass
            width = norm.num_channels if qk == "mrs" else norm.normalized_shape[0]
            assert width == head_dim
        assert attn.q_norm is not attn.k_norm
    # the body keeps the ViT's LayerNorms: same classes, same places as in the model without QK-norms
    kept, before = _body_norms(model.model), _body_norms(fresh.model)
    assert {n: type(m) for n, m in kept.items()} == {n: type(m) for n, m in before.items()}
    assert all(isinstance(m, nn.LayerNorm) for m in kept.values()) and len(kept) == 2 * SMALL["depth"] + 1
    # without a QK-norm the attention layers keep nn.Identity
    assert all(isinstance(a.q_norm, nn.Identity) for a in _attention(fresh.model))


def test_body_and_qk_norms_chosen_apart() -> None:
    model = _vit(norm="mrs", qk_norm="layer")
    assert all(type(m) is MRSNorm for m in _body_norms(model.model).values())
    assert all(type(a.q_norm) is nn.LayerNorm and type(a.k_norm) is nn.LayerNorm for a in _attention(model.model))
    y = model(torch.randn(3, 3, 8, 8))  # (N, classes)
    assert y.shape == (3, 10) and torch.isfinite(y).all()


def test_optimizer_defaults_resolved_into_hparams() -> None:
    sgd = ImageClassifier(arch="timm:test_resnet", norm="batch")
    assert (sgd.hparams.lr, sgd.hparams.weight_decay, sgd.hparams.momentum, sgd.hparams.nesterov, sgd.hparams.betas) \
        == (0.1, 5e-4, 0.9, True, None)
    adamw = _vit(norm="batch", optimizer="adamw")
    assert (adamw.hparams.lr, adamw.hparams.weight_decay, adamw.hparams.betas, adamw.hparams.momentum) == (
        1e-3, 0.05, (0.9, 0.999), None)
    assert _vit(optimizer="adamw", lr=3e-3, betas=(0.9, 0.95)).hparams.betas == (0.9, 0.95)
    # what a checkpoint stores rebuilds the same model (load_from_checkpoint calls __init__ with it)
    for model in (sgd, _vit(norm="batch", qk_norm="mrs", optimizer="adamw")):
        again = ImageClassifier(**model.hparams)
        again.load_state_dict(model.state_dict())  # strict: the same parameters, QK-norms included
        assert dict(again.hparams) == dict(model.hparams)


def test_adamw_decays_weight_matrices_only(one_thread: None) -> None:
    """The optimizer the recipe builds: no decay on norm layers (body and QK), biases, position embedding, tokens."""
    import lightning.pytorch as pl

    model = _vit(norm="batch", qk_norm="mrs", optimizer="adamw", lr=1e-3, weight_decay=0.07)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 3, 8, 8), torch.arange(4)),
                                       batch_size=2)
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, data)
    (optimizer,) = trainer.optimizers
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["betas"] == (0.9, 0.999)
    groups = {g["name"]: g for g in optimizer.param_groups}
    assert groups["decay"]["weight_decay"] == 0.07 and groups["no_decay"]["weight_decay"] == 0.0

    # the reference, from the module list: every parameter of a norm layer, every bias, the embeddings
    names = {id(p): n for n, p in model.model.named_parameters()}
    expected_no_decay = {names[id(p)] for m in model.model.modules() if isinstance(m, (nn.LayerNorm, MRSNorm))
                         for p in m.parameters()}
    expected_no_decay |= {n for n, _ in model.model.named_parameters() if n.endswith(".bias")}
    expected_no_decay |= {"pos_embed", "cls_token"}
    got = {kind: {names[id(p)] for p in groups[kind]["params"]} for kind in groups}
    assert got["no_decay"] == expected_no_decay
    assert got["decay"] == set(names.values()) - expected_no_decay
    assert "blocks.0.attn.q_norm.weight" in got["no_decay"] and "blocks.0.attn.qkv.weight" in got["decay"]
    assert all(p.ndim == 2 or p.ndim == 4 for p in groups["decay"]["params"])  # linear and patch-conv weights


def test_sgd_decays_every_parameter() -> None:
    from recipes.common.optim import build_optimizer

    model = ImageClassifier(arch="timm:test_resnet", norm="batch")
    opt = build_optimizer("sgd", model.model, model.parameters(), lr=0.1, weight_decay=5e-4, momentum=0.9,
                          nesterov=True)
    (group,) = opt.param_groups
    assert group["weight_decay"] == 5e-4 and len(group["params"]) == len(list(model.parameters()))


@pytest.mark.parametrize("kwargs,match", [
    ({"optimizer": "adamw", "momentum": 0.8}, "--model.momentum is an option of --model.optimizer sgd"),
    ({"betas": (0.9, 0.99)}, "--model.betas is an option of --model.optimizer adamw"),
    ({"optimizer": "adamw", "betas": (0.9, 1.5)}, "--model.betas must be"),
    ({"optimizer": "adam"}, "--model.optimizer"),
    ({"qk_norm": "l2"}, "--model.qk_norm"),
    ({"optimizer": "adamw", "weight_decay": -1.0}, "--model.weight_decay"),
])
def test_bad_vit_options_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        _vit(**kwargs)


def test_qk_norm_needs_attention_that_can_take_it() -> None:
    with pytest.raises(UsageError, match="has no attention layer"):
        ImageClassifier(arch="timm:test_resnet", norm="batch", qk_norm="mrs")
    odd = {**SMALL, "embed_dim": 60}  # 4 heads of width 15: MRSNorm pairs channels
    with pytest.raises(UsageError, match=r"no mrs QK-norm in 2 of 2 attention layers .*odd head_dim 15"):
        ImageClassifier(arch=VIT, arch_kwargs=odd, norm="batch", qk_norm="mrs")
    ImageClassifier(arch=VIT, arch_kwargs=odd, norm="batch", qk_norm="rms")  # RMSNorm takes any width


def _config(name: str) -> dict:
    return yaml.safe_load((CONFIGS / name).read_text())


def test_configs_use_the_sweeps_vits() -> None:
    digits, cifar = _config("vit_digits.yaml"), _config("vit_cifar100.yaml")
    assert digits["model"]["arch_kwargs"] == VIT_DIGITS and cifar["model"]["arch_kwargs"] == VIT_CIFAR
    for config in (digits, cifar):
        assert config["model"]["arch_kwargs"]["img_size"] == config["data"]["image_size"]
        assert (config["model"]["optimizer"], config["model"]["qk_norm"], config["model"]["norm"]) == (
            "adamw", "mrs", "batch")


def test_vit_digits_config_trains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_thread: None) -> None:
    """The config as shipped, a few steps: trains, validates, logs the attention figures."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setattr(sys, "argv", ["cifar100.py"])
    assert run(["--config", str(CONFIGS / "vit_digits.yaml"), "--trainer.max_steps", "4",
                "--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar", "false",
                "--trainer.log_every_n_steps", "2", "--attention.log_every_n_steps", "2",
                "--monitor.log_every_n_steps", "2"]) == 0
    acc = EventAccumulator(str(next(tmp_path.glob("lightning_logs/version_0"))))
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert [s for s, _ in scalars["attention/all/logit_max"]] == [1, 3]
    assert all(0 < v < 1e3 for _, v in scalars["attention/all/logit_max"])
    entropy_bound = math.log(VIT_DIGITS["img_size"] ** 2 // VIT_DIGITS["patch_size"] ** 2 + 1)  # uniform over keys
    assert all(0 <= v <= entropy_bound + 1e-4 for _, v in scalars["attention/all/entropy_min"])
    assert "z-layers/attention/model.blocks.3.attn/q_norm_mean" in scalars  # MRS QK-norms in all 4 blocks
    assert {"train/lr/decay", "train/lr/no_decay", "val/top1"} <= set(scalars)
    # the HParams session's attention-logit maximum is the largest logged
    assert scalars["z-final/max_logit"] == [(4, max(v for _, v in scalars["attention/all/logit_max"]))]


def test_attention_monitor_only_for_models_with_attention(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_mrs.callbacks import AttentionMonitor, GradientHomogeneityMonitor

    monkeypatch.setattr(sys, "argv", ["cifar100.py"])
    common = ["--trainer.default_root_dir", str(tmp_path), "--data.dataset", "digits", "--trainer.accelerator", "cpu"]
    vit = build_cli(["--config", str(CONFIGS / "vit_digits.yaml"), "--attention.max_queries", "32", *common])
    monitors = [c for c in vit.trainer.callbacks if isinstance(c, AttentionMonitor)]
    assert len(monitors) == 1 and monitors[0].max_queries == 32
    cnn = build_cli(["--model.arch", "timm:test_resnet", "--data.image_size", "8", *common])
    assert not any(isinstance(c, AttentionMonitor) for c in cnn.trainer.callbacks)
    assert any(isinstance(c, GradientHomogeneityMonitor) for c in cnn.trainer.callbacks)


@pytest.mark.parametrize("args,message", [
    (["--data.image_size", "16"], "--data.image_size 16 does not fit the model, which takes 8x8 images"),
    (["--model.qk_norm", "l2"], "\"model.qk_norm\": Expected a typing.Literal['none', 'mrs', 'rms', 'layer']"),
    (["--model.momentum", "0.9"], "--model.momentum is an option of --model.optimizer sgd"),
    (["--model.optimizer", "lamb"], "\"model.optimizer\": Expected a typing.Literal['sgd', 'adamw']"),
])
def test_vit_mistakes_are_one_line(args: list[str], message: str, tmp_path: Path,
                                   recipe_error: Callable[[list[str]], str]) -> None:
    line = recipe_error(["--config", str(CONFIGS / "vit_digits.yaml"), "--trainer.default_root_dir",
                         str(tmp_path), *args])
    assert message in line
