"""One cell of a stress sweep: train ``CifarClassifier`` once and return its record.

The ``norm`` sweep's arm is the body norm (SGD); the ``qk`` sweep's is the QK-norm of a ViT whose
own norms stay (AdamW), and its record adds the AttentionMonitor's extremes over training.

Imported by ``stress.py`` only when there are cells to run (torch and Lightning load here).
A cell whose training loss turns non-finite stops there and counts as chance accuracy from that
step on: its final top-1 is ``1 / num_classes`` and its best top-1 the best validation before
the divergence (at least chance).
"""

from __future__ import annotations

import argparse
import logging
import math
import shutil
import sys
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger, TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from lightning_mrs.callbacks import GradientHomogeneityMonitor
from recipes.cifar100 import CifarClassifier, ValidateAtEnd, default_precision
from recipes.data import ImageDataModule
from recipes.errors import UsageError, report
from recipes.stress_sweeps import ATTENTION_QUERIES

__all__ = ["DivergenceStop", "MemoryLogger", "check_data", "counted_top1", "run_cell"]

_MAX_CURVE_POINTS = 400


class MemoryLogger(Logger):
    """Keeps every logged metric in memory (``history[name] = [(step, value), ...]``).

    Sits next to the TensorBoard logger so the sweep reads exactly what was logged, including
    what callbacks such as ``GradientHomogeneityMonitor`` send to ``trainer.loggers``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.history: dict[str, list[tuple[int, float]]] = defaultdict(list)

    @property
    @override
    def name(self) -> str:
        return "memory"

    @property
    @override
    def version(self) -> int:
        return 0

    @override
    @rank_zero_only
    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None) -> None:
        for key, value in metrics.items():
            self.history[key].append((int(step or 0), float(value)))

    @override
    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class DivergenceStop(Callback):
    """Record every training loss; on the first non-finite one, note the step and stop the run.

    ``divergence_step`` is the 1-based optimizer step whose loss was NaN/Inf (``None`` if none).
    Stopping lets Lightning validate once more (the collapsed model's top-1) and end cleanly.
    """

    def __init__(self) -> None:
        self.divergence_step: Optional[int] = None
        self.losses: list[tuple[int, float]] = []

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else math.nan
        self.losses.append((trainer.global_step, value))
        bad = trainer.strategy.reduce_boolean_decision(not math.isfinite(value), all=False)
        if bad and self.divergence_step is None:
            self.divergence_step = trainer.global_step
            trainer.should_stop = True


def _datamodule(args: argparse.Namespace, batch_size: int) -> ImageDataModule:
    from recipes.stress import SPLIT_SEED, VAL_FRACTION

    return ImageDataModule(
        dataset=args.dataset, root=args.root, batch_size=batch_size, image_size=args.image_size,
        val_fraction=VAL_FRACTION, split_seed=SPLIT_SEED,
        augment=args.augment, num_workers=args.num_workers, synthetic_train_size=args.synthetic_train_size,
        synthetic_val_size=args.synthetic_val_size,
    )


def check_data(args: argparse.Namespace) -> None:
    """Check (download) the dataset once before the grid; a user mistake exits 2 with one line."""
    try:
        _datamodule(args, 1).prepare_data()
    except UsageError as err:
        sys.exit(report(err))


def counted_top1(val: list[tuple[int, float]], divergence_step: Optional[int],
                 chance: float) -> list[tuple[int, float]]:
    """The validation top-1 curve as the sweep counts it: chance from the divergence step on.

    Validations at or after ``divergence_step`` (of the collapsed model) are replaced by one
    point ``(divergence_step, chance)``; without a divergence ``val`` is returned as it is.

    Example:
        >>> counted_top1([(10, 0.5), (20, 0.7), (30, 0.3)], 25, 0.1)
        [(10, 0.5), (20, 0.7), (25, 0.1)]
    """
    if divergence_step is None:
        return list(val)
    return [(s, v) for s, v in val if s < divergence_step] + [(divergence_step, chance)]


def _thin(points: list[tuple[int, float]], limit: int = _MAX_CURVE_POINTS) -> list[list[float]]:
    stride = max(1, math.ceil(len(points) / limit))
    kept = points[::stride]
    if points and kept[-1] != points[-1]:
        kept.append(points[-1])  # keep the last point: where the run ended (or diverged)
    return [[s, v] for s, v in kept]


def _finite_mean(points: list[tuple[int, float]]) -> Optional[float]:
    values = [v for _, v in points if math.isfinite(v)]
    return sum(values) / len(values) if values else None


def _extreme(points: list[tuple[int, float]], pick: Any) -> Optional[float]:
    values = [v for _, v in points if math.isfinite(v)]
    return pick(values) if values else None


def _model(args: argparse.Namespace, arm: str, lr: float, num_classes: int) -> CifarClassifier:
    sweep = args.sweep
    arms = {"norm": arm} if sweep.arm == "norm" else {"norm": "batch", sweep.arm: arm}  # batch: the model's own
    return CifarClassifier(arch=args.arch, lr=lr, weight_decay=args.weight_decay, optimizer=sweep.optimizer,
                           warmup_frac=args.warmup_frac, schedule=args.schedule, num_classes=num_classes,
                           mrs_backend=args.mrs_backend, arch_kwargs=args.arch_kwargs, cifar_stem=args.cifar_stem,
                           **arms)


def _monitors(args: argparse.Namespace) -> list[Callback]:
    monitors: list[Callback] = [GradientHomogeneityMonitor(log_every_n_steps=args.log_every, on_nonfinite="ignore")]
    if args.sweep.arm == "qk_norm":
        from lightning_mrs.callbacks import AttentionMonitor

        monitors.append(AttentionMonitor(log_every_n_steps=args.log_every, max_queries=ATTENTION_QUERIES))
    return monitors


def _attention(history: dict[str, list[tuple[int, float]]]) -> dict[str, Any]:
    """The AttentionMonitor's extremes over the logged training steps (finite values: before any divergence)."""
    return {
        "max_logit": _extreme(history.get("attention/all/logit_max", []), max),
        "min_entropy": _extreme(history.get("attention/all/entropy_min", []), min),
        "max_collapsed_frac": _extreme(history.get("attention/all/collapsed_frac", []), max),
    }


def run_cell(args: argparse.Namespace, out: Path, name: str, *, arm: str, lr: float, batch_size: int,
             seed: int) -> dict[str, Any]:
    """Train one cell of ``args.sweep`` and return its record (the row of ``results.csv`` plus curves)."""
    for noisy in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(noisy).setLevel(logging.WARNING)  # one line per cell, not a page
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    pl.seed_everything(seed, workers=True, verbose=False)

    dm = _datamodule(args, batch_size)
    model = _model(args, arm, lr, dm.num_classes)
    tb_dir = out / "tb" / name
    if tb_dir.exists():  # a cell interrupted earlier: start its run afresh
        shutil.rmtree(tb_dir)
    tb = TensorBoardLogger(save_dir=str(out / "tb"), name=name, version="", default_hp_metric=False)
    memory = MemoryLogger()
    divergence = DivergenceStop()
    limit_val = args.limit_val_batches
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=1,
        precision=args.precision or default_precision(args.accelerator),
        max_epochs=args.epochs if args.epochs is not None else -1,
        max_steps=args.max_steps if args.max_steps is not None else -1,
        logger=[tb, memory],
        callbacks=[*_monitors(args), divergence, ValidateAtEnd()],
        log_every_n_steps=args.log_every,
        val_check_interval=args.val_every,
        check_val_every_n_epoch=None if args.val_every else 1,
        limit_val_batches=int(limit_val) if limit_val > 1 else limit_val,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=args.progress,
        default_root_dir=str(out),
    )
    trainer.fit(model, datamodule=dm)

    diverged_at = divergence.divergence_step
    val = counted_top1(memory.history.get("val/top1", []), diverged_at, 1.0 / dm.num_classes)
    tops = [v for _, v in val if math.isfinite(v)]
    losses = divergence.losses
    history = memory.history
    record = {
        "cell": name, args.sweep.arm: arm, "lr": lr, "batch_size": batch_size, "seed": seed,
        "arch": args.arch, "dataset": args.dataset, "num_classes": dm.num_classes,
        "steps": trainer.global_step,
        "planned_steps": int(trainer.estimated_stepping_batches),
        "best_top1": max(tops, default=math.nan),
        "final_top1": val[-1][1] if val else math.nan,
        "final_val_loss": (memory.history.get("val/loss") or [(0, math.nan)])[-1][1],
        "final_train_loss": losses[-1][1] if losses else math.nan,
        "diverged": diverged_at is not None,
        "divergence_step": diverged_at,
        "mean_grad_cv": _finite_mean(memory.history.get("phasor/all/grad_cv", [])),
        "mean_starved_frac": _finite_mean(memory.history.get("phasor/all/starved_frac", [])),
        "tb_run": str(Path("tb") / name),
        "curves": {"train_loss": _thin(losses), "val_top1": [[s, v] for s, v in val]},
    }
    if args.sweep.arm == "qk_norm":
        record.update(_attention(history))
        record["curves"]["logit_max"] = _thin(history.get("attention/all/logit_max", []))
    return record
