"""NormSwap + GradientHomogeneityMonitor together in a Trainer, as a user runs them."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins import MixedPrecision
from torch import nn

from helpers.lightning import fit, image_data
from lightning_mrs.callbacks import GradientHomogeneityMonitor, NormSwap
from lightning_mrs.callbacks.tb_layout import HOMOGENEITY
from lightning_mrs.swap.registry import iter_norm_layers

KEY_STATS = ("grad_mean", "grad_cv", "starved_frac", "nonfinite")


def small_net() -> nn.Module:
    """BatchNorm2d with in-place ReLUs (a ResNet's pattern) and a LayerNorm head."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 12), nn.LayerNorm(12), nn.GELU(), nn.Linear(12, 5),
    )


def resnet18_cifar() -> nn.Module:
    import torchvision

    model = torchvision.models.resnet18(num_classes=5)
    model.conv1 = nn.Conv2d(3, 64, 3, padding=1, bias=False)  # CIFAR stem
    model.maxpool = nn.Identity()
    return model


def timm_convnext() -> nn.Module:
    import timm

    return timm.create_model("convnext_atto", pretrained=False, num_classes=5)  # timm LayerNorm2d


def timm_vit() -> nn.Module:
    import timm

    # channels-last tokens (timm LayerNorm); 64 tokens of 192 channels at 32x32
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4, num_classes=5)


def run(tmp_path: Path, net_fn: Callable[[], nn.Module], swap: bool, size: int = 12, **kw: Any):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path, name="swap" if swap else "plain")
    _, module = fit(net_fn, steps=4, logger=logger, data=image_data(32, (size, size)),
                    callbacks=[*([NormSwap()] if swap else []), GradientHomogeneityMonitor()], **kw)
    acc = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return module, acc


def check_run(module: pl.LightningModule, acc: Any, kinds: set[str]) -> list[str]:
    layers = [(name, spec.kind) for name, _, spec in iter_norm_layers(module)]
    assert layers and {kind for _, kind in layers} == kinds
    tags = set(acc.Tags()["scalars"])
    for layer in [name for name, _ in layers] + ["all"]:
        for stat in KEY_STATS:
            events = acc.Scalars(HOMOGENEITY.tag(layer, stat))
            assert [e.step for e in events] == [0, 1, 2, 3], (layer, stat)
            assert all(math.isfinite(e.value) for e in events), (layer, stat)
    assert {HOMOGENEITY.tag(name, "grad_p50") for name, _ in layers} <= tags
    assert acc.Tags()["tensors"] == ["custom_scalars__config__"]
    return [name for name, _ in layers]


def test_normswap_then_monitor(tmp_path: Path) -> None:
    module, acc = run(tmp_path, small_net, swap=True)
    names = check_run(module, acc, {"mrs"})
    assert names == ["net.1", "net.4", "net.9"]
    for name in ("net.1", "net.4", "net.9"):  # MRS layers also report their weight gradient
        assert all(math.isfinite(e.value) for e in acc.Scalars(HOMOGENEITY.tag(name, "wgrad_cv")))


def test_monitor_without_swap_watches_batchnorm_and_layernorm(tmp_path: Path) -> None:
    module, acc = run(tmp_path, small_net, swap=False)
    check_run(module, acc, {"batch", "layer"})
    assert not any(tag.endswith("wgrad_cv") for tag in acc.Tags()["scalars"])


def test_normswap_fp16_gradscaler_grad_mean_matches_fp32(tmp_path: Path) -> None:
    _, fp32 = run(tmp_path / "fp32", small_net, swap=True)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    _, fp16 = run(tmp_path / "fp16", small_net, swap=True, plugins=[plugin])
    for layer in ("net.1", "net.4", "net.9", "all"):
        ref = [e.value for e in fp32.Scalars(HOMOGENEITY.tag(layer, "grad_mean"))]
        got = [e.value for e in fp16.Scalars(HOMOGENEITY.tag(layer, "grad_mean"))]
        assert got == pytest.approx(ref, rel=0.05), layer


@pytest.mark.slow
@pytest.mark.parametrize("net_fn,swap,kinds", [
    (resnet18_cifar, True, {"mrs"}), (resnet18_cifar, False, {"batch"}),
    (timm_convnext, True, {"mrs"}), (timm_convnext, False, {"layer2d"}),
    (timm_vit, True, {"mrs"}), (timm_vit, False, {"layer"}),
])
def test_real_models(tmp_path: Path, net_fn: Callable[[], nn.Module], swap: bool, kinds: set[str]) -> None:
    module, acc = run(tmp_path, net_fn, swap=swap, size=32)
    assert len(check_run(module, acc, kinds)) >= 10
