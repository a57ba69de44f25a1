"""A deterministic, learnable stand-in for CIFAR-100 that needs no download.

Each of the 100 classes owns a smooth colour "prototype": a few low-frequency colour blobs
plus an oriented colour grating, both drawn once from ``seed``. A sample is its class's
prototype, randomly shifted, with random contrast and brightness, blended with a faint
prototype of another class (a distractor) and covered in pixel noise. The class is therefore
recoverable from the image (a small CNN beats the 1 % chance level by a wide margin within a
few hundred SGD steps) but not trivially so, which is what the recipes, the tests and the
offline demo need.

Everything is generated lazily from ``(seed, split, index)``: the dataset takes no memory
beyond the 100 prototypes, needs no files, and returns the same image for the same index on
every machine, process and DataLoader worker. Images are ``uint8`` tensors of shape
``(3, 32, 32)`` like torchvision's CIFAR-100 after ``PILToTensor``, so the same transform
pipeline (random crop, flip, AutoAugment, normalisation) serves both.

Needs only torch.

Example:
    >>> ds = SyntheticCIFAR100(train=True, size=1000)
    >>> image, label = ds[7]
    >>> image.shape, image.dtype, label
    (torch.Size([3, 32, 32]), torch.uint8, 7)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

__all__ = ["SyntheticCIFAR100"]

# torch's CPU generator keeps only the low 32 bits of a seed: per-sample seeds live in
# [0, 2**32), the split in the top bit, so every (split, index < 2**31) pair has its own stream.
_SPLIT_BIT = {True: 0, False: 1 << 31}
_SEED_MIX = 0x9E3779B1  # odd: seeds shift the streams by a multiplicative-hash offset


class SyntheticCIFAR100(Dataset):
    """Deterministic, learnable ``num_classes``-class RGB images (CIFAR-100 shaped by default).

    Args:
        train: the training split (``True``) or the validation split (``False``). Both share
            the class prototypes and differ in their per-sample randomness.
        size: number of samples; ``None`` gives CIFAR-100's sizes (50 000 train, 10 000 val).
            Labels are ``index % num_classes``, so the classes are balanced.
        num_classes: number of classes (>= 2).
        image_size: height and width of the square images (>= 8).
        seed: seed of the prototypes and of every sample.
        noise: standard deviation of the per-pixel Gaussian noise, on a 0..1 intensity scale.
        max_shift: largest random shift of the prototype, in pixels, along each axis.
        distractor: largest weight of the other class's prototype blended into a sample.

    Example:
        >>> ds = SyntheticCIFAR100(train=False, size=200)
        >>> len(ds), ds[3][1], bool((ds[3][0] == ds[3][0]).all())
        (200, 3, True)
    """

    def __init__(
        self,
        train: bool = True,
        size: int | None = None,
        num_classes: int = 100,
        image_size: int = 32,
        seed: int = 0,
        noise: float = 0.2,
        max_shift: int = 4,
        distractor: float = 0.7,
    ) -> None:
        if size is None:
            size = 50_000 if train else 10_000
        if not 1 <= size <= 1 << 31:
            raise ValueError(f"SyntheticCIFAR100: size must be in [1, 2**31], got {size}.")
        if num_classes < 2:
            raise ValueError(f"SyntheticCIFAR100: num_classes must be >= 2, got {num_classes}.")
        if image_size < 8:
            raise ValueError(f"SyntheticCIFAR100: image_size must be >= 8, got {image_size}.")
        if noise < 0 or max_shift < 0 or not 0 <= distractor < 1:
            raise ValueError(
                "SyntheticCIFAR100: need noise >= 0, max_shift >= 0 and 0 <= distractor < 1, got "
                f"noise={noise}, max_shift={max_shift}, distractor={distractor}."
            )
        self.train = train
        self.size = size
        self.num_classes = num_classes
        self.image_size = image_size
        self.seed = seed
        self.noise = noise
        self.max_shift = max_shift
        self.distractor = distractor
        self.classes = [f"class_{i:03d}" for i in range(num_classes)]
        self.prototypes = make_prototypes(num_classes, image_size, seed)  # (K, 3, H, W), unit std

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not -self.size <= index < self.size:
            raise IndexError(f"SyntheticCIFAR100: index {index} out of range for size {self.size}.")
        index %= self.size
        label = index % self.num_classes
        g = torch.Generator().manual_seed((self.seed * _SEED_MIX + _SPLIT_BIT[self.train] + index) % (1 << 32))
        u = torch.rand(8, generator=g)  # the per-sample scalar draws, in [0, 1)

        s = self.max_shift
        dy, dx = (int(v) for v in ((u[:2] * (2 * s + 1)).floor() - s))
        image = torch.roll(self.prototypes[label], shifts=(dy, dx), dims=(1, 2))  # (3, H, W)

        # A faint prototype of another class: the model must find the dominant pattern.
        other = (label + 1 + int(u[2] * (self.num_classes - 1))) % self.num_classes
        image = image + self.distractor * float(u[3]) * self.prototypes[other]

        contrast = 0.06 + 0.06 * float(u[4])  # intensity std of the pattern, 0..1 scale
        brightness = 0.5 + 0.2 * (torch.rand(3, 1, 1, generator=g) - 0.5)  # (3, 1, 1) per channel
        noise = self.noise * torch.randn(image.shape, generator=g)  # (3, H, W)
        image = brightness + contrast * image + noise
        return (image.clamp(0, 1) * 255 + 0.5).to(torch.uint8), label  # +0.5 then truncate: rounds


def make_prototypes(num_classes: int, image_size: int, seed: int) -> torch.Tensor:
    """The class prototypes: smooth colour blobs plus an oriented colour grating per class.

    Args:
        num_classes: number of prototypes K.
        image_size: side H = W of the prototypes.
        seed: seed of the draw.

    Returns:
        A float32 tensor of shape ``(K, 3, H, W)``, each prototype with zero mean and unit
        standard deviation.

    Example:
        >>> make_prototypes(4, 16, seed=0).shape
        torch.Size([4, 3, 16, 16])
    """
    g = torch.Generator().manual_seed(seed)
    k, n = num_classes, image_size
    # Low-frequency blobs: a 4x4 random colour field upsampled (smooth, shift-tolerant).
    coarse = torch.randn(k, 3, 4, 4, generator=g)  # (K, 3, 4, 4)
    blobs = F.interpolate(coarse, size=(n, n), mode="bicubic", align_corners=False)  # (K, 3, H, W)

    # An oriented grating with 1..3 cycles per image, wrapping around the image edges so that
    # the circular shifts of the samples leave it intact.
    angle = torch.rand(k, generator=g) * math.pi  # (K,)
    cycles = 1 + torch.randint(0, 3, (k,), generator=g).float()  # (K,)
    phase = torch.rand(k, generator=g) * 2 * math.pi  # (K,)
    colour = torch.randn(k, 3, generator=g)  # (K, 3)
    pos = torch.arange(n, dtype=torch.float32) / n  # (H,)
    fy = torch.round(cycles * torch.sin(angle))  # (K,) integer cycles: periodic in the image
    fx = torch.round(cycles * torch.cos(angle))  # (K,)
    fx = torch.where((fx == 0) & (fy == 0), torch.ones_like(fx), fx)
    arg = 2 * math.pi * (fy[:, None, None] * pos[None, :, None] + fx[:, None, None] * pos[None, None, :])
    wave = torch.sin(arg + phase[:, None, None])  # (K, H, W)
    grating = colour[:, :, None, None] * wave[:, None]  # (K, 3, H, W)

    proto = blobs + grating
    proto = proto - proto.mean(dim=(1, 2, 3), keepdim=True)
    return proto / proto.std(dim=(1, 2, 3), keepdim=True).clamp_min(1e-6)
