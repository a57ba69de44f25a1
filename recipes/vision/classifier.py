"""The recipes' LightningModule: an image classifier whose norm layers are swapped at build.

:class:`ImageClassifier` trains any torchvision or timm classifier (:mod:`recipes.vision.models`) on any
of :mod:`recipes.vision.data`'s datasets (CIFAR-100, the digits, an image folder, synthetic), ResNets and
ViTs alike, with MRSNorm or a baseline norm in the body and optionally a QK-norm in every
attention layer; SGD or AdamW (:mod:`recipes.common.optim`) with a warm-up and cosine schedule stepped
per optimizer step. Its command line is ``recipes/cifar100.py``; the stress sweeps
(``recipes/stress.py``) train it cell by cell.

Example:
    >>> model = ImageClassifier(arch="timm:test_resnet", norm="mrs", num_classes=10)  # doctest: +SKIP
    >>> model(torch.randn(2, 3, 32, 32)).shape  # doctest: +SKIP
    torch.Size([2, 10])
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

from lightning_mrs import MRSNorm, MRSNorm2d, swap_norms
from recipes.vision.models import build_model
from recipes.common.optim import build_optimizer, optimizer_options, run_schedule
from recipes.common.training import QK_NORM_CHOICES, check_model_options, check_qk_norms

__all__ = ["NORMS", "QK_NORM_CHOICES", "RESULT", "ImageClassifier"]

NORMS = ("mrs", "rms", "layer", "batch", "dyt", "derf")
#: the result's tag group, ``accuracy/train`` and ``accuracy/val`` (the values of ``train/top1`` and ``val/top1``):
#: TensorBoard orders its groups by name, so this one comes first (before attention/, phasor/, train/, val/)
RESULT = "accuracy"


class ImageClassifier(pl.LightningModule):
    """An image classifier whose norm layers are swapped to MRSNorm (or a baseline) at build.

    The swap happens in ``__init__``, so ``ImageClassifier.load_from_checkpoint(path)`` rebuilds
    the same architecture from the saved hyperparameters and loads the weights.

    Args:
        arch: torchvision or timm model name (see :func:`build_model`); a ViT is sized by
            ``arch_kwargs`` (``img_size`` must equal ``--data.image_size``).
        norm: ``mrs`` (MRSNorm), ``rms`` (RMSNorm), ``layer`` (LayerNorm / GroupNorm(1, C))
            replace every norm layer; ``batch`` keeps the model's own norms (a ResNet's
            BatchNorm, a ViT's LayerNorm: for a ViT ``layer`` keeps them too, they already are).
        lr: peak learning rate (reached at the end of the warm-up); ``None``: 0.1 (sgd), 1e-3 (adamw).
        momentum: SGD momentum (``None``: 0.9); sgd only.
        nesterov: Nesterov momentum (``None``: True); sgd only.
        weight_decay: ``None``: 5e-4 (sgd, on every parameter, as in the usual CIFAR recipe) or
            0.05 (adamw, decoupled, on weight matrices only: not on norms, biases, position
            embeddings and tokens; see :mod:`recipes.common.optim`).
        warmup_frac: fraction of all optimizer steps spent in linear warm-up from ~0 to ``lr``.
        schedule: ``cosine`` (decay to 0 after the warm-up) or ``constant``; stepped per step.
        num_classes: classifier outputs (the recipe sets it from ``--data.dataset``: ``data.num_classes``).
        cifar_stem: the CIFAR stem for ResNets (3x3 stride-1 conv, no max-pool).
        label_smoothing: cross-entropy label smoothing.
        arch_kwargs: extra keyword arguments of the model builder (see :func:`build_model`).
        mrs_backend: implementation of the MRSNorm layers (``norm=mrs``): ``auto`` (fused
            kernels where available), ``eager`` (the plain torch formula), or one of
            :data:`lightning_mrs.ops.BACKENDS`. Same maths; a speed/debugging knob.
        qk_norm: ``none``: no QK-norm is added (one the model has follows ``norm``);
            ``mrs`` (phasor attention), ``rms``, ``layer``: a per-head norm of that kind on
            the queries and keys of every attention layer (``swap_norms(qk_norm=...)``),
            whatever ``norm`` does to the body. Every attention layer must get one (an odd
            head width cannot take MRSNorm, a CNN has none): otherwise a usage error.
        optimizer: ``sgd`` (the ResNet recipe) or ``adamw`` (the transformer recipe).
        betas: AdamW's betas (``None``: (0.9, 0.999)); adamw only.

    Example:
        >>> model = ImageClassifier(arch="timm:test_resnet", norm="mrs")  # doctest: +SKIP
        >>> model(torch.randn(2, 3, 32, 32)).shape  # doctest: +SKIP
        torch.Size([2, 100])
        >>> vit = ImageClassifier(arch="timm:vit_tiny_patch16_224", norm="batch", qk_norm="mrs",
        ...                       optimizer="adamw", arch_kwargs={"img_size": 32, "patch_size": 4})  # doctest: +SKIP
    """

    def __init__(
        self,
        arch: str = "resnet18",
        norm: Literal["mrs", "rms", "layer", "batch", "dyt", "derf"] = "mrs",
        lr: Optional[float] = None,
        momentum: Optional[float] = None,
        nesterov: Optional[bool] = None,
        weight_decay: Optional[float] = None,
        warmup_frac: float = 0.05,
        schedule: Literal["cosine", "constant"] = "cosine",
        num_classes: int = 100,
        cifar_stem: bool = True,
        label_smoothing: float = 0.0,
        mrs_backend: str = "auto",
        arch_kwargs: Optional[dict[str, Any]] = None,
        qk_norm: Literal["none", "mrs", "rms", "layer"] = "none",
        optimizer: Literal["sgd", "adamw"] = "sgd",
        betas: Optional[tuple[float, float]] = None,
    ) -> None:
        super().__init__()
        check_model_options(norm=norm, norms=NORMS, qk_norm=qk_norm, schedule=schedule, warmup_frac=warmup_frac,
                            mrs_backend=mrs_backend)
        chosen = optimizer_options(optimizer, lr=lr, weight_decay=weight_decay, momentum=momentum,
                                    nesterov=nesterov, betas=betas)
        self.save_hyperparameters()
        self.hparams.update(chosen)  # the optimizer's defaults, resolved: checkpoints and logs state them
        self.model = build_model(arch, num_classes, cifar_stem, arch_kwargs)
        self.swap_report = None
        self._schedule: Optional[Callable[[int], float]] = None  # the lr factor per step, set in on_train_start
        target = None if norm == "batch" else norm  # batch: the model's own norms stay
        if target is not None or qk_norm != "none":
            self.swap_report = swap_norms(self.model, target=target,  # printed when fitting starts
                                          qk_norm=None if qk_norm == "none" else qk_norm)
        if qk_norm != "none":
            check_qk_norms(self.model, qk_norm, self.swap_report, arch)
        for module in self.model.modules():
            if isinstance(module, (MRSNorm, MRSNorm2d)):
                module.backend = mrs_backend
        # micro: the plain share of correct samples that papers report (torchmetrics' default
        # "macro" averages per-class accuracies, and counts classes absent from the batch as 0)
        self.train_top1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.val_top1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        # top-5 of 5 classes or fewer is always 100 %: logged only when it can say something
        self.val_top5 = MulticlassAccuracy(num_classes, top_k=5, average="micro") if num_classes > 5 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)  # (N, 3, H, W) -> (N, num_classes)

    @override
    def on_fit_start(self) -> None:
        if self.swap_report is not None:
            rank_zero_info(str(self.swap_report))
        dm = getattr(self.trainer, "datamodule", None)
        per_device = getattr(dm, "batch_size", None)
        if per_device is None:
            return
        world, accumulate = self.trainer.world_size, self.trainer.accumulate_grad_batches
        global_batch = per_device * world * accumulate
        rank_zero_info(  # and an HParams column (recipes.common.hparams.HParamsSummary)
            f"global batch {global_batch} = {per_device} per device x {world} processes x {accumulate} accumulation"
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch  # (N, 3, H, W), (N,)
        logits = self(x)  # (N, K)
        loss = F.cross_entropy(logits.float(), y, label_smoothing=self.hparams.label_smoothing)
        self.train_top1(logits, y)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/top1", self.train_top1, on_step=True, on_epoch=False)
        self.log(f"{RESULT}/train", self.train_top1, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch  # (N, 3, H, W), (N,)
        logits = self(x)  # (N, K)
        loss = F.cross_entropy(logits.float(), y)
        self.val_top1(logits, y)
        # torchmetrics objects sync their state across ranks; the loss needs sync_dist
        self.log("val/loss", loss, sync_dist=True)
        self.log("val/top1", self.val_top1, prog_bar=True)
        self.log(f"{RESULT}/val", self.val_top1)
        if self.val_top5 is not None:
            self.val_top5(logits, y)
            self.log("val/top5", self.val_top5)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # a checkpoint of the recipe before its loader was torchdata's StatefulDataLoader holds the epoch's position
        # as {"epoch", "samples"}, which that loader cannot read (an AssertionError): the epoch's order restarts
        loop = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
        states = loop.get("combined_loader") or []
        if any(set(state) == {"epoch", "samples"} for state in states):
            del loop["combined_loader"]
            rank_zero_warn("this checkpoint was written before the image recipe's training loader saved its own state: "
                           "the resumed epoch's order starts anew (the rest of the run is not the uninterrupted "
                           "run's batches); resume with the release that wrote it for that.")

    def _factor(self, step: int) -> float:
        """The lr factor of ``step`` on the run's schedule (1 until :meth:`on_train_start` knows its length)."""
        return self._schedule(step) if self._schedule is not None else 1.0

    @override
    def on_train_start(self) -> None:
        hp = self.hparams
        self._schedule = run_schedule(self.trainer, hp.warmup_frac, hp.schedule)  # the loader exists: no early build
        scheduler = self.trainer.lr_scheduler_configs[0].scheduler
        for group, base in zip(self.trainer.optimizers[0].param_groups, scheduler.base_lrs):
            group["lr"] = base * self._factor(scheduler.last_epoch)  # LambdaLR's own formula, now on the schedule

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        optimizer = build_optimizer(hp.optimizer, self.model, self.parameters(), lr=hp.lr,
                                    weight_decay=hp.weight_decay, momentum=hp.momentum, nesterov=hp.nesterov,
                                    betas=hp.betas)
        # the schedule's length is set in on_train_start: asking Lightning for it here builds the training loader
        # before a checkpoint is restored, and Lightning then never gives that loader its saved position
        # (Lightning issue #20550: a resume in the middle of an epoch would restart the epoch's order)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self._factor)
        # "name": LearningRateMonitor's tag, train/lr (train/lr/<group> for AdamW's two groups), beside train/*
        schedule = {"scheduler": scheduler, "interval": "step", "name": "train/lr"}
        return {"optimizer": optimizer, "lr_scheduler": schedule}
