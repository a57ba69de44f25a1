"""Train an image classifier on CIFAR-100 with MRSNorm (or a baseline norm), via LightningCLI.

Run from the repository root (no subcommand: the script fits, validating every epoch):

    # offline demo on a CPU (scikit-learn's handwritten digits, a tiny timm ResNet, about a minute)
    python recipes/cifar100.py --config recipes/configs/demo_cpu.yaml
    # the real job: ResNet-18 with MRSNorm on CIFAR-100, 200 epochs, all GPUs of the box
    python recipes/cifar100.py --config recipes/configs/cifar100_resnet18.yaml --trainer.devices 4
    # a transformer: a small ViT with MRS QK-norms (phasor attention), AdamW; offline on a CPU / CIFAR-100
    python recipes/cifar100.py --config recipes/configs/vit_digits.yaml
    python recipes/cifar100.py --config recipes/configs/vit_cifar100.yaml --model.qk_norm layer
    # any flag: --model.arch/norm/lr, --data.dataset (cifar100, digits, folder, synthetic)/root/batch_size ...
    python recipes/cifar100.py --help

Multi-node: launch one process per GPU with ``torchrun --nnodes N --nproc-per-node G
recipes/cifar100.py --trainer.num_nodes N --trainer.devices G ...`` or under SLURM with
``srun`` (``--ntasks-per-node G``); Lightning picks the environment up and runs DDP.

Defaults: SGD (momentum 0.9, Nesterov, weight decay 5e-4) or, with ``--model.optimizer adamw``,
AdamW (betas 0.9/0.999, lr 1e-3, weight decay 0.05 on weights only: :mod:`recipes.optim`),
linear warm-up then cosine decay stepped every optimizer step, precision ``bf16-mixed`` on GPUs that support it
(``16-mixed`` otherwise) and ``32-true`` on the CPU unless ``--trainer.precision`` is given,
DDP when more than one device, TensorBoard logs under ``--trainer.default_root_dir``
(``tensorboard --logdir <dir>``), checkpoints ``last.ckpt`` and the best ``val/top1``,
``GradientHomogeneityMonitor`` (``--monitor.*``) and, for models with attention layers,
``AttentionMonitor`` (``--attention.*``).
``val/top1``, ``val/top5`` and ``train/top1`` are plain (micro) accuracies: the share of
samples whose label is among the top k logits, as papers report them. The data
(:mod:`recipes.data`: cifar100, digits, folder, synthetic) sets ``--model.num_classes``.

A user mistake (an unknown ``--model.arch``, a bad option value, a malformed image folder,
CIFAR-100 missing offline, ...) is one ``error: ...`` line on stderr and exit status 2.
"""

from __future__ import annotations

if __name__ == "__main__":  # `python recipes/cifar100.py`: run this file as the module recipes.cifar100
    import os as _os
    import sys as _sys

    _sys.path[0] = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))  # the repository root
    from recipes.cifar100 import run

    _sys.exit(run())

import logging
import os
from typing import Any, Literal, NoReturn, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities import rank_zero_info
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

from lightning_mrs import MRSNorm, MRSNorm2d, swap_norms
from lightning_mrs.callbacks import AttentionMonitor, GradientHomogeneityMonitor
from lightning_mrs.ops import BACKENDS
from lightning_mrs.swap import iter_attention_layers
from recipes.data import ImageDataModule
from recipes.errors import UsageError, report
from recipes.models import build_model, check_input_size, check_qk_norms
from recipes.optim import build_optimizer, optimizer_options, warmup_cosine

__all__ = ["CifarClassifier", "ImageDataModule", "ValidateAtEnd", "build_cli", "build_model", "main", "run"]

NORMS = ("mrs", "rms", "layer", "batch")
QK_NORMS = ("none", "mrs", "rms", "layer")


class CifarClassifier(pl.LightningModule):
    """An image classifier whose norm layers are swapped to MRSNorm (or a baseline) at build.

    The swap happens in ``__init__``, so ``CifarClassifier.load_from_checkpoint(path)`` rebuilds
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
            embeddings and tokens; see :mod:`recipes.optim`).
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
        >>> model = CifarClassifier(arch="timm:test_resnet", norm="mrs")  # doctest: +SKIP
        >>> model(torch.randn(2, 3, 32, 32)).shape  # doctest: +SKIP
        torch.Size([2, 100])
        >>> vit = CifarClassifier(arch="timm:vit_tiny_patch16_224", norm="batch", qk_norm="mrs",
        ...                       optimizer="adamw", arch_kwargs={"img_size": 32, "patch_size": 4})  # doctest: +SKIP
    """

    def __init__(
        self,
        arch: str = "resnet18",
        norm: Literal["mrs", "rms", "layer", "batch"] = "mrs",
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
        if norm not in NORMS:
            raise UsageError(f"--model.norm {norm!r} is not valid; choose one of {list(NORMS)}.")
        if qk_norm not in QK_NORMS:
            raise UsageError(f"--model.qk_norm {qk_norm!r} is not valid; choose one of {list(QK_NORMS)}.")
        if schedule not in ("cosine", "constant"):
            raise UsageError(f"--model.schedule {schedule!r} is not valid; choose one of ['cosine', 'constant'].")
        if not 0.0 <= warmup_frac < 1.0:
            raise UsageError(f"--model.warmup_frac must lie in [0, 1), got {warmup_frac}.")
        if mrs_backend not in BACKENDS:
            raise UsageError(f"--model.mrs_backend {mrs_backend!r} is not valid; choose one of {list(BACKENDS)}.")
        chosen = optimizer_options(optimizer, lr=lr, weight_decay=weight_decay, momentum=momentum,
                                    nesterov=nesterov, betas=betas)
        self.save_hyperparameters()
        self.hparams.update(chosen)  # the optimizer's defaults, resolved: checkpoints and logs state them
        self.model = build_model(arch, num_classes, cifar_stem, arch_kwargs)
        self.swap_report = None
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
        self.val_top5 = MulticlassAccuracy(num_classes, top_k=min(5, num_classes), average="micro")

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
        rank_zero_info(
            f"global batch {global_batch} = {per_device} per device x {world} processes x {accumulate} accumulation"
        )
        for logger in self.trainer.loggers:
            logger.log_metrics({"data/global_batch_size": float(global_batch)}, step=0)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch  # (N, 3, H, W), (N,)
        logits = self(x)  # (N, K)
        loss = F.cross_entropy(logits.float(), y, label_smoothing=self.hparams.label_smoothing)
        self.train_top1(logits, y)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/top1", self.train_top1, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch  # (N, 3, H, W), (N,)
        logits = self(x)  # (N, K)
        loss = F.cross_entropy(logits.float(), y)
        self.val_top1(logits, y)
        self.val_top5(logits, y)
        # torchmetrics objects sync their state across ranks; the loss needs sync_dist
        self.log("val/loss", loss, sync_dist=True)
        self.log("val/top1", self.val_top1, prog_bar=True)
        self.log("val/top5", self.val_top5)

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        optimizer = build_optimizer(hp.optimizer, self.model, self.parameters(), lr=hp.lr,
                                    weight_decay=hp.weight_decay, momentum=hp.momentum, nesterov=hp.nesterov,
                                    betas=hp.betas)
        total = max(1, int(self.trainer.estimated_stepping_batches))
        factor = warmup_cosine(total, int(round(hp.warmup_frac * total)), cosine=hp.schedule == "cosine")
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class ValidateAtEnd(Callback):
    """Stop (and so validate and checkpoint) on the last step when ``max_steps`` ends a run mid-epoch.

    Without it a run cut short by ``--trainer.max_steps`` inside the first epoch never validates,
    so it has no top-1 and no best checkpoint. Lightning validates when ``should_stop`` is set.
    """

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.max_steps is not None and 0 < trainer.max_steps <= trainer.global_step:
            trainer.should_stop = True


def default_precision(accelerator: Any) -> str:
    """``bf16-mixed`` on a GPU with bf16, ``16-mixed`` on other GPUs, ``32-true`` elsewhere."""
    name = accelerator if isinstance(accelerator, str) else type(accelerator).__name__.lower()
    if name in ("auto", "gpu", "cuda") or "cuda" in name:
        if torch.cuda.is_available():
            return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    return "32-true"


class OneLineParser(LightningArgumentParser):
    """The recipe's parser: a parsing mistake is one ``error: ...`` line and exit 2, not the usage."""

    @override
    def error(self, message: str, ex: Optional[Exception] = None) -> NoReturn:
        if not self.exit_on_error:  # jsonargparse's nested parsers report to their parent
            super().error(message, ex)
        raise UsageError(f"{message} (options: --help)")


class CifarCLI(LightningCLI):
    """LightningCLI with the recipe's callbacks, checkpointing and precision defaults.

    Mistakes in the options, ``--ckpt_path``, a malformed image folder and a missing CIFAR-100
    (checked, or downloaded, before the trainer is built) are one line, without the trainer's
    start-up messages.
    """

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults({
            "checkpoint.monitor": "val/top1",
            "checkpoint.mode": "max",
            "checkpoint.save_last": True,
            "checkpoint.filename": "best-epoch{epoch:03d}-step{step:06d}-top1_{val/top1:.4f}",
            "checkpoint.auto_insert_metric_name": False,
        })
        # the head matches the data: 100 (cifar100, synthetic), 10 (digits), the folder's classes
        parser.link_arguments("data.num_classes", "model.num_classes", apply_on="instantiate")
        parser.add_lightning_class_args(GradientHomogeneityMonitor, "monitor")
        parser.add_lightning_class_args(AttentionMonitor, "attention")  # dropped for models without attention
        parser.add_argument("--ckpt_path", type=Optional[str], default=None,
                            help="resume training from this checkpoint (e.g. <run>/checkpoints/last.ckpt)")

    @override
    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        if config.trainer.precision is None:
            config.trainer.precision = default_precision(config.trainer.accelerator)
        ckpt_path = config.get("ckpt_path")
        if ckpt_path and not os.path.isfile(ckpt_path):
            raise UsageError(f"--ckpt_path {ckpt_path!r}: no such file; give an existing checkpoint "
                             "(e.g. <run>/lightning_logs/version_0/checkpoints/last.ckpt) or leave it out.")

    @override
    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        # Check (download) the data once the options are known good (the model is built) but
        # before the trainer talks and DDP workers start, so that a missing dataset is one
        # message from one process; other local ranks (torchrun/SLURM start them all) rely on
        # local rank 0, as Lightning's prepare_data does.
        check_input_size(self.model.model, self.datamodule.image_size)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            self.datamodule.prepare_data()
        try:
            trainer = super().instantiate_trainer(**kwargs)
        except (MisconfigurationException, ImportError, ValueError) as err:  # e.g. a bad accelerator
            raise UsageError(f"a --trainer option: {err}") from None
        if next(iter_attention_layers(self.model), None) is None:  # a CNN: no "no attention layers" warning
            trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, AttentionMonitor)]
        return trainer


def build_cli(args: Optional[list[str]] = None) -> CifarCLI:
    """Parse the command line, build the model, data and trainer, and check the data; nothing trains."""
    seed_log = logging.getLogger("lightning.fabric.utilities.seed")
    level = seed_log.level
    seed_log.setLevel(logging.WARNING)  # "Seed set to" only once the configuration is valid
    try:
        cli = CifarCLI(
            CifarClassifier,
            ImageDataModule,
            run=False,
            args=args,
            parser_class=OneLineParser,
            seed_everything_default=0,
            trainer_defaults={
                "max_epochs": 200,
                "callbacks": [LearningRateMonitor(logging_interval="step"), ValidateAtEnd()],
            },
            save_config_kwargs={"overwrite": True},
        )
    finally:
        seed_log.setLevel(level)
    rank_zero_info(f"Seed set to {cli.config.seed_everything}")
    return cli


def main(args: Optional[list[str]] = None) -> None:
    """Parse the command line, check the data, and fit."""
    cli = build_cli(args)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=cli.config.get("ckpt_path"))


def run(args: Optional[list[str]] = None) -> int:
    """:func:`main` with user errors (:class:`recipes.errors.UsageError`) as one stderr line, exit 2."""
    try:
        main(args)
    except (UsageError, MisconfigurationException) as err:  # Lightning's: a bad --trainer.* value
        return report(err)
    return 0
