"""The two stress sweeps the runner (``recipes/stress.py``) knows: what each varies, its grid and defaults.

* ``norm`` (the default, the paper's): the body norm of a ResNet (layer, rms, mrs, batch) x
  learning rate x batch size x seed; SGD with momentum; the GradientHomogeneityMonitor.
* ``qk`` (after Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer
  training instabilities", arXiv 2309.14322): the QK-norm of a small ViT (none, layer, rms,
  mrs), its LayerNorms kept, x learning rate x batch size x seed; AdamW; the AttentionMonitor
  records the attention logits and the softmax entropy.

Everything else (the cells, their records, resume, shards, ``--jobs``, the report and its
robustness summary) is shared. Needs no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ATTENTION_QUERIES", "NORM", "QK", "SWEEPS", "Sweep", "VIT_CIFAR", "VIT_DIGITS"]

_NARROW_RESNET = {"layers": [1, 1, 1, 1], "channels": [8, 16, 32, 64], "stem_width": 8}
_SYNTHETIC_RESNET = {"layers": [1, 1, 1, 1], "channels": [32, 48, 64, 96], "stem_width": 32}
#: the digits ViT (``recipes/configs/vit_digits.yaml``): 2x2 patches of the 8x8 scans (16 tokens
#: and a class token), width 64, 4 blocks of 4 heads of width 16 (8 phasors per head), MLP x2
VIT_DIGITS = {"img_size": 8, "patch_size": 2, "embed_dim": 64, "depth": 4, "num_heads": 4, "mlp_ratio": 2.0}
#: the CIFAR ViT (``recipes/configs/vit_cifar100.yaml``): ViT-Lite-7/4 of Hassani et al. 2021
#: (arXiv 2104.05704): 4x4 patches of 32x32 images (64 tokens), width 256, 7 blocks of 4 heads of
#: width 64, MLP x2 (3.7 M parameters)
VIT_CIFAR = {"img_size": 32, "patch_size": 4, "embed_dim": 256, "depth": 7, "num_heads": 4, "mlp_ratio": 2.0}
_VIT = "timm:vit_tiny_patch16_224"
#: queries per attention layer whose logits the ``qk`` sweep's AttentionMonitor recomputes on a logging step
ATTENTION_QUERIES = 256


@dataclass(frozen=True)
class Sweep:
    """One kind of stress sweep.

    Attributes:
        name: the ``--sweep`` value.
        arm: what the sweep varies: the record and ``results.csv`` column, and the cells' first axis.
        flag: the command-line option that lists the arms.
        arms: the valid values of ``arm``, in table order.
        grid: the default axes: ``arms``, ``lrs``, ``batch_sizes``, ``seeds``.
        quick: ``--quick``'s smaller axes, and its ``epochs`` per dataset.
        datasets: per dataset, the model, input and budget defaults (``epochs`` None: required).
        optimizer: ``sgd`` or ``adamw`` (``recipes/optim.py``).
        weight_decay: the default ``--weight-decay``.
        warmup_frac: the default ``--warmup-frac``.
        optimizer_text: the optimizer as ``results.md`` states it.
    """

    name: str
    arm: str
    flag: str
    arms: tuple[str, ...]
    grid: dict[str, list[Any]]
    quick: dict[str, Any]
    datasets: dict[str, dict[str, Any]]
    optimizer: str
    weight_decay: float
    warmup_frac: float
    optimizer_text: str

    def cell_name(self, arm: str, lr: float, batch_size: int, seed: int) -> str:
        """The cell's id: its TensorBoard run name and the stem of its record file."""
        prefix = "" if self.name == "norm" else f"{self.name}-"
        return f"{prefix}{arm}_lr{lr:g}_bs{batch_size}_seed{seed}"


NORM = Sweep(
    name="norm", arm="norm", flag="--norms", arms=("layer", "rms", "mrs", "batch"),
    # the paper's lrs (0.1, 0.3, 0.4) inside a log-spaced axis from 0.03 to 3
    grid={"arms": ["layer", "rms", "mrs", "batch"], "lrs": [0.03, 0.1, 0.3, 0.4, 1.0, 3.0],
          "batch_sizes": [32, 64, 128], "seeds": [0, 1, 2]},
    quick={"lrs": [0.1, 0.4, 3.0], "batch_sizes": [32, 128], "seeds": [0], "epochs": {"digits": 5}},
    datasets={
        # the 8x8 scans at their own size; a 4-block ResNet of 8-64 channels; no augmentation: 10
        # epochs bring every norm above 93 % at lr 0.1 and batch 128, and a cell costs seconds
        "digits": {"arch": "timm:resnet18", "arch_kwargs": _NARROW_RESNET, "cifar_stem": True, "image_size": 8,
                   "augment": False, "epochs": 10, "accelerator": "cpu"},
        "cifar100": {"arch": "resnet18", "arch_kwargs": None, "cifar_stem": True, "image_size": 32, "augment": True,
                     "epochs": None, "accelerator": "auto"},
        "synthetic": {"arch": "timm:resnet18", "arch_kwargs": _SYNTHETIC_RESNET, "cifar_stem": False,
                      "image_size": 32, "augment": True, "epochs": None, "accelerator": "auto"},
    },
    optimizer="sgd", weight_decay=5e-4, warmup_frac=0.0,
    optimizer_text="SGD momentum 0.9 nesterov, weight decay on every parameter",
)

QK = Sweep(
    name="qk", arm="qk_norm", flag="--qk-norms", arms=("none", "layer", "rms", "mrs"),
    # log-spaced, from the recipe's AdamW default (1e-3) to 300x it
    grid={"arms": ["none", "layer", "rms", "mrs"], "lrs": [0.001, 0.003, 0.01, 0.03, 0.1, 0.3],
          "batch_sizes": [64], "seeds": [0, 1, 2]},
    quick={"lrs": [0.003, 0.03, 0.3], "seeds": [0], "epochs": {"digits": 10}},
    datasets={
        # no augmentation: 1-pixel shifts of the 8x8 scans slow this ViT down several-fold
        "digits": {"arch": _VIT, "arch_kwargs": VIT_DIGITS, "cifar_stem": False, "image_size": 8,
                   "augment": False, "epochs": 20, "accelerator": "cpu"},
        "cifar100": {"arch": _VIT, "arch_kwargs": VIT_CIFAR, "cifar_stem": False, "image_size": 32,
                     "augment": True, "epochs": None, "accelerator": "auto"},
        "synthetic": {"arch": _VIT, "arch_kwargs": VIT_CIFAR, "cifar_stem": False, "image_size": 32,
                      "augment": True, "epochs": None, "accelerator": "auto"},
    },
    optimizer="adamw", weight_decay=0.05, warmup_frac=0.05,
    optimizer_text="AdamW betas (0.9, 0.999), decoupled weight decay on weight matrices only (not on norms, "
                   "biases, position embeddings, tokens)",
)

SWEEPS: dict[str, Sweep] = {s.name: s for s in (NORM, QK)}
