"""Tiny torchvision transformers (32x32 inputs, widths 16-32, one block per stage) for the
attention and QK-norm tests."""

from __future__ import annotations

import torchvision
from torch import nn
from torchvision.models import maxvit, swin_transformer as swin

__all__ = ["tv_maxvit", "tv_swin", "tv_vit"]


def tv_vit(num_classes: int = 3) -> nn.Module:
    """A ViT of 8x8 patches, 1 block of 2 heads of width 8."""
    return torchvision.models.VisionTransformer(32, 8, 1, 2, 16, 32, num_classes=num_classes)


def tv_swin(v2: bool = False) -> nn.Module:
    """A Swin (``v2``: Swin V2) of 4x4 patches and windows, 2 stages of 1 block, 2 heads."""
    blocks = dict(block=swin.SwinTransformerBlockV2, downsample_layer=swin.PatchMergingV2) if v2 else {}
    return swin.SwinTransformer([4, 4], 16, [1, 1], [2, 2], [4, 4], num_classes=3, **blocks)


def tv_maxvit() -> nn.Module:
    """A MaxViT of one stage of one block, head width 8."""
    return maxvit.MaxVit((32, 32), 8, 2, [16], [1], 8, 0.0, num_classes=3)
