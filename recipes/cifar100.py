"""Train an image classifier (CIFAR-100, the digits, your image folder) with MRSNorm or a baseline norm, via LightningCLI.

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

Several machines: one process per GPU, on node R of N ``torchrun --nnodes N --node_rank R --nproc_per_node G
--master_addr HOST --master_port PORT recipes/cifar100.py --trainer.num_nodes N --trainer.devices G ...``, or
under SLURM ``srun python recipes/cifar100.py --trainer.num_nodes N --trainer.devices G ...``
(``--ntasks-per-node G``); Lightning picks the environment up and runs DDP (docs/recipes.md#several-machines).

Defaults: SGD (momentum 0.9, Nesterov, weight decay 5e-4) or, with ``--model.optimizer adamw``,
AdamW (betas 0.9/0.999, lr 1e-3, weight decay 0.05 on weights only: :mod:`recipes.common.optim`),
linear warm-up then cosine decay stepped every optimizer step, precision ``bf16-mixed`` on GPUs that support it
(``16-mixed`` otherwise) and ``32-true`` on the CPU unless ``--trainer.precision`` is given
(``16-mixed`` on the CPU: float16 autocast with a GradScaler, not Lightning's bfloat16),
DDP when more than one device, TensorBoard logs under ``--trainer.default_root_dir``
(``tensorboard --logdir <dir>``), checkpoints ``last.ckpt`` and the best ``val/top1``,
``GradientHomogeneityMonitor`` (``--monitor.*``) and, for models with attention layers,
``AttentionMonitor`` (``--attention.*``), and the run's settings and final metrics in TensorBoard's
HParams dashboard (:class:`recipes.common.hparams.HParamsSummary`); ``--ckpt_path`` is checked first.
``val/top1``, ``val/top5`` and ``train/top1`` are plain (micro) accuracies: the share of
samples whose label is among the top k logits, as papers report them. The data
(:mod:`recipes.vision.data`: cifar100, digits, folder, synthetic) sets ``--model.num_classes``.

The model is :class:`recipes.vision.classifier.ImageClassifier` (``--model.*``), the data
:class:`recipes.vision.data.ImageDataModule` (``--data.*``); this script is their command line.

A user mistake (an unknown ``--model.arch``, a bad option value, a malformed image folder,
CIFAR-100 missing offline, ...) is one ``error: ...`` line on stderr and exit status 2.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Optional

if not __package__:  # run as a script (`python recipes/cifar100.py`): import the recipes from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import lightning.pytorch as pl
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_mrs.callbacks import AttentionMonitor, GradientHomogeneityMonitor
from lightning_mrs.swap import iter_attention_layers
from recipes.common.checkpoints import OptionsRecord, check_checkpoint
from recipes.vision.classifier import ImageClassifier
from recipes.vision.data import ImageDataModule
from recipes.common.errors import UsageError
from recipes.common.hparams import CLASSIFIER_SUMMARY, HParamsSummary, RunLogger
from recipes.common.interrupt import resume_callbacks, run_resumable
from recipes.vision.models import check_input_size
from recipes.vision.resume import EpochPosition, StepSeed
from recipes.common.training import (ValidateAtEnd, build_quietly, check_nodes, cpu_fp16, default_precision,
                                     note_processes)

__all__ = ["CifarCLI", "ImageClassifier", "ImageDataModule", "build_cli", "main", "run"]

SCRIPT = "recipes/cifar100.py"

class CifarCLI(LightningCLI):
    """LightningCLI with the recipe's callbacks, checkpointing and precision defaults.

    Mistakes in the options, ``--ckpt_path``, a malformed image folder and a missing CIFAR-100
    (checked, or downloaded, before the trainer is built) are one line, without the trainer's
    start-up messages.
    """

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")  # the best; last.ckpt: resume_callbacks()
        parser.set_defaults({
            "checkpoint.monitor": "val/top1",
            "checkpoint.mode": "max",
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
        check_nodes(config.trainer.num_nodes, config.trainer.plugins)
        ckpt_path = config.get("ckpt_path")
        if ckpt_path and not os.path.isfile(ckpt_path):
            raise UsageError(f"--ckpt_path {ckpt_path!r}: no such file; give an existing checkpoint "
                             "(e.g. <run>/lightning_logs/version_0/checkpoints/last.ckpt) or leave it out.")

    def options(self) -> dict[str, Any]:
        """This run's value of each option a resume may change (:data:`MAY_CHANGE`): a changed one is named in
        one notice line (the LM recipe's :data:`recipes.lm.RESUME` does the same for its options)."""
        values = {"--data.batch_size": self.datamodule.batch_size}
        for key in ("precision", "devices", "num_nodes", "accumulate_grad_batches", "max_epochs", "max_steps"):
            values[f"--trainer.{key}"] = self.config_init.get(f"trainer.{key}")
        values["--trainer.precision"] = str(values["--trainer.precision"])  # as asked (16-mixed may become a plugin)
        return values

    @override
    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        # Check (download) the data once the options are known good (the model is built) but
        # before the trainer talks and DDP workers start, so that a missing dataset is one
        # message from one process; other local ranks (torchrun/SLURM start them all) rely on
        # local rank 0, as Lightning's prepare_data does.
        check_input_size(self.model.model, self.datamodule.image_size)
        ckpt_path = self.config.get("ckpt_path")
        options = self.options()
        notice = check_checkpoint(ckpt_path, self.model, self.model.hparams, options) if ckpt_path else None
        if notice and "--data.batch_size" in notice:
            # the sampler's position is in images: the epoch goes on from the image it reached (EpochPosition)
            notice += (f" (the epoch goes on from the image it reached, in batches of {self.datamodule.batch_size}; "
                       "the steps of an epoch, and so the length of a schedule over epochs without "
                       "--trainer.max_steps, follow the new size)")
        if notice:
            rank_zero_info(notice)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            self.datamodule.prepare_data()
        note_processes(self.config_init.get("trainer") or {})
        plugin = cpu_fp16(self.config_init.get("trainer.precision"), self.config_init.get("trainer.accelerator"))
        if plugin is not None:  # Lightning would run bfloat16 here
            kwargs["precision"], kwargs["plugins"] = None, [*(self.config_init.get("trainer.plugins") or []), plugin]
            rank_zero_info("precision 16-mixed on the CPU: float16 autocast with a GradScaler (torch.amp), as on a GPU")
        if self.config_init.get("trainer.logger") in (None, True):  # Lightning's default, without hp_metric
            root = self.config_init.get("trainer.default_root_dir") or os.getcwd()
            kwargs["logger"] = RunLogger(root, version=SLURMEnvironment.job_id())
        try:
            trainer = super().instantiate_trainer(**kwargs)
        except (MisconfigurationException, ImportError, ValueError) as err:  # e.g. a bad accelerator
            raise UsageError(f"a --trainer option: {err}") from None
        trainer.callbacks.append(OptionsRecord(options))  # what a resume of this run compares (check_checkpoint)
        if next(iter_attention_layers(self.model), None) is None:  # a CNN: no "no attention layers" warning
            trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, AttentionMonitor)]
        return trainer


def build_cli(args: Optional[list[str]] = None) -> CifarCLI:
    """Parse the command line, build the model, data and trainer, and check the data; nothing trains."""
    return build_quietly(
        CifarCLI,
        ImageClassifier,
        ImageDataModule,
        args=args,
        seed_everything_default=0,
        trainer_defaults={
            "max_epochs": 200,
            "callbacks": [LearningRateMonitor(logging_interval="step"), ValidateAtEnd(),
                          HParamsSummary(CLASSIFIER_SUMMARY), *resume_callbacks(), StepSeed(), EpochPosition()],
        },
        save_config_kwargs={"overwrite": True},
    )


def main(args: Optional[list[str]] = None) -> None:
    """Parse the command line, check the data, and fit."""
    cli = build_cli(args)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=cli.config.get("ckpt_path"))


def run(args: Optional[list[str]] = None) -> int:
    """:func:`main` with user errors as one stderr line (exit 2), and Ctrl-C as a resumable interruption:
    the step running finishes, a checkpoint is saved and the command that resumes printed (exit 130;
    :func:`recipes.common.interrupt.run_resumable`)."""
    return run_resumable(build_cli, SCRIPT, args)


if __name__ == "__main__":
    sys.exit(run())
