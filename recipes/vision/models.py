"""The recipe's model builder: any torchvision or timm classifier, randomly initialised.

Mistakes in ``--model.arch``/``--model.arch_kwargs`` raise :class:`recipes.common.errors.UsageError`
(one line naming the option and the fix).

Vision transformers take the input size and their shape from ``arch_kwargs``, e.g. a small
timm ViT for 32x32 CIFAR: ``build_model("timm:vit_tiny_patch16_224", 100, arch_kwargs={"img_size":
32, "patch_size": 4, "depth": 6})``. :func:`check_input_size` compares a model's fixed input
size with the data's before anything trains.

Example:
    >>> import torch
    >>> build_model("timm:test_resnet", num_classes=10)(torch.randn(2, 3, 32, 32)).shape
    torch.Size([2, 10])
"""

from __future__ import annotations

import difflib
from typing import Any, Optional

from torch import nn

from recipes.common.errors import UsageError

__all__ = ["build_model", "check_input_size", "input_size"]


def build_model(
    arch: str,
    num_classes: int = 100,
    cifar_stem: bool = True,
    arch_kwargs: Optional[dict[str, Any]] = None,
) -> nn.Module:
    """Build a randomly initialised torchvision or timm classifier.

    Args:
        arch: a torchvision model name (``torchvision.models.list_models()``) or a timm one
            (``timm.list_models()``); force the source with ``tv:NAME`` or ``timm:NAME``.
            A name known to both is taken from torchvision.
        num_classes: size of the classifier head.
        cifar_stem: give ResNets (torchvision or timm, any depth) the usual CIFAR stem: a 3x3
            stride-1 first convolution and no max-pool, so 32x32 inputs keep their resolution.
        arch_kwargs: extra keyword arguments of the model builder (``timm.create_model`` or
            ``torchvision.models.get_model``), e.g. ``{"layers": [1, 1, 1, 1]}`` for a
            shallower timm ResNet.

    Returns:
        The model (``pretrained=False``/``weights=None``: nothing is downloaded).

    Example:
        >>> model = build_model("resnet18", num_classes=100)
        >>> model.conv1.kernel_size, type(model.maxpool).__name__
        ((3, 3), 'Identity')
    """
    import timm
    import torchvision

    kwargs = dict(arch_kwargs or {})
    source, _, name = arch.rpartition(":")
    if source not in ("", "tv", "timm"):
        raise UsageError(f"--model.arch {arch!r}: the prefix must be 'tv:' or 'timm:', got {source!r}.")
    tv_names = set(torchvision.models.list_models(module=torchvision.models))
    if source == "tv" or (source == "" and name in tv_names):
        if name not in tv_names:
            raise UsageError(f"--model.arch {arch!r}: not a torchvision classification model"
                             f"{_suggest(name, tv_names)} (see torchvision.models.list_models()).")
        build, builder = torchvision.models.get_model, "torchvision.models.get_model"
        kwargs.update(weights=None, num_classes=num_classes)
    else:
        if not timm.is_model(name):
            known = tv_names | set(timm.list_models()) if source == "" else set(timm.list_models())
            raise UsageError(
                f"--model.arch {arch!r}: {'neither a torchvision classification model nor ' if not source else 'not '}"
                f"a timm model{_suggest(name, known)} (see {'' if source else 'torchvision.models.list_models() and '}"
                "timm.list_models())."
            )
        build, builder = timm.create_model, "timm.create_model"
        kwargs.update(pretrained=False, num_classes=num_classes)
    try:
        model = build(name, **kwargs)
    except (TypeError, ValueError, AssertionError, KeyError) as err:  # the builder rejected arch_kwargs
        raise UsageError(f"--model.arch_kwargs {arch_kwargs!r} do not fit {builder}({name!r}): "
                         f"{type(err).__name__}: {err}") from None
    if cifar_stem:
        _cifar_stem(model)
    return model


def _suggest(name: str, known: set[str]) -> str:
    close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.75)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def _cifar_stem(model: nn.Module) -> None:
    """Turn an ImageNet ResNet stem (stride-2 7x7 conv + max-pool) into the CIFAR one."""
    conv1, maxpool = getattr(model, "conv1", None), getattr(model, "maxpool", None)
    if conv1 is None or not isinstance(maxpool, nn.MaxPool2d):
        return  # not a ResNet-style stem (ViT, ConvNeXt, ...): leave the model as it is
    if isinstance(conv1, nn.Conv2d):
        model.conv1 = nn.Conv2d(conv1.in_channels, conv1.out_channels, 3, 1, 1, bias=conv1.bias is not None)
    else:  # timm's deep stems (resnet*d, *t): keep the convs, drop the first stride
        for m in conv1.modules():
            if isinstance(m, nn.Conv2d) and m.stride != (1, 1):
                m.stride = (1, 1)
                break
    model.maxpool = nn.Identity()




def input_size(model: nn.Module) -> Optional[tuple[int, int]]:
    """The (height, width) a model only accepts (timm ViTs, torchvision ViT), ``None`` when any size goes."""
    patch_embed = getattr(model, "patch_embed", None)
    if patch_embed is not None and getattr(patch_embed, "strict_img_size", False):
        size = getattr(patch_embed, "img_size", None)
        if size is not None:
            return tuple(size)  # type: ignore[return-value]
    size = getattr(model, "image_size", None)  # torchvision's VisionTransformer
    if isinstance(size, int) and hasattr(model, "conv_proj"):
        return size, size
    return None


def check_input_size(model: nn.Module, image_size: int, option: str = "--data.image_size") -> None:
    """Raise a usage error when ``model`` only takes another input size than ``image_size``.

    Example:
        >>> vit = build_model("timm:vit_tiny_patch16_224", 10, arch_kwargs={"img_size": 32, "depth": 1})
        >>> check_input_size(vit, 16)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        recipes.common.errors.UsageError: --data.image_size 16 does not fit the model, which takes 32x32 images: ...
    """
    size = input_size(model)
    if size is not None and tuple(size) != (image_size, image_size):
        key = "img_size" if hasattr(model, "patch_embed") else "image_size"
        raise UsageError(f"{option} {image_size} does not fit the model, which takes {size[0]}x{size[1]} images: "
                         f"give the model \"{key}\": {image_size} in --model.arch_kwargs, or {option} {size[0]}.")
