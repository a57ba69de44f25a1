"""One cell of a stress sweep: train ``ImageClassifier`` once and return its record.

The sweep kind (``args.sweep``) says what the arm sets in the model, which monitors the cell needs
and what it measures from their logs. Imported only when there are cells to run (torch and
Lightning load here). A cell whose training loss turns non-finite stops there and counts as chance
accuracy from that step on: its final top-1 is ``1 / num_classes`` and its best top-1 the best
validation before the divergence (at least chance).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import shutil
import signal
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from recipes.vision.classifier import ImageClassifier
from recipes.common.training import ValidateAtEnd, default_precision
from recipes.vision.data import ImageDataModule
from recipes.common.errors import UsageError
from recipes.common.hparams import FINAL, RunLogger, log_hparams
from recipes.vision.models import build_model as build_network, input_size
from recipes.sweeps.series import thin
from recipes.sweeps.settings import SPLIT_SEED, VAL_FRACTION

__all__ = ["DivergenceStop", "MemoryLogger", "arch_kwargs", "build_model", "counted_top1", "datamodule", "fit", "run_cell"]


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


def datamodule(args: argparse.Namespace, batch_size: int) -> ImageDataModule:
    """The cell's data: the sweep's dataset, split and size at ``batch_size``."""
    return ImageDataModule(
        dataset=args.dataset, root=args.root, batch_size=batch_size, image_size=args.image_size,
        val_fraction=VAL_FRACTION, split_seed=SPLIT_SEED,
        augment=args.augment, num_workers=args.num_workers, synthetic_train_size=args.synthetic_train_size,
        synthetic_val_size=args.synthetic_val_size,
    )


@functools.lru_cache(maxsize=8)
def _sized(arch: str, kwargs_json: str, cifar_stem: bool, image_size: int) -> str:
    # the models built here are thrown away: they must not draw from the cell's seeded random stream, else a
    # cell's weights would depend on whether its process built them before (the first cell of a worker or not)
    with torch.random.fork_rng(devices=[]):
        return _fit_size(arch, kwargs_json, cifar_stem, image_size)


def _fit_size(arch: str, kwargs_json: str, cifar_stem: bool, image_size: int) -> str:
    kwargs = json.loads(kwargs_json)
    if kwargs is not None and ("img_size" in kwargs or "image_size" in kwargs):
        return kwargs_json  # the user's size: check_cells compares it with --image-size
    first = build_network(arch, 10, cifar_stem, kwargs)
    size = input_size(first)
    if size is None or tuple(size) == (image_size, image_size):
        return kwargs_json
    key = "img_size" if hasattr(first, "patch_embed") else "image_size"  # timm's name, torchvision's
    sized = {**(kwargs or {}), key: image_size}
    try:
        model = build_network(arch, 10, cifar_stem, sized)
    except UsageError as err:
        raise UsageError(f"--arch {arch!r} takes {size[0]}x{size[1]} images and cannot be built for --image-size "
                         f"{image_size} ({err}): pass --arch-kwargs with a fitting size (and patch size) or another "
                         "--image-size.") from None
    patch = getattr(getattr(model, "patch_embed", None), "patch_size", None)
    if patch is not None and max(patch) > image_size:
        raise UsageError(f"--arch {arch!r} cuts {patch[0]}x{patch[1]} patches, larger than --image-size {image_size}: "
                         f"pass --arch-kwargs '{{\"patch_size\": {max(1, image_size // 4)}}}' or a larger --image-size.")
    return json.dumps(sized)


def arch_kwargs(args: argparse.Namespace) -> Optional[dict[str, Any]]:
    """``--arch-kwargs``, with the input size set from ``--image-size`` for a model that takes one fixed size
    (a ViT) when none is given."""
    return json.loads(_sized(args.arch, json.dumps(args.arch_kwargs), args.cifar_stem, args.image_size))


def build_model(args: argparse.Namespace, arm: str, lr: float, num_classes: int) -> ImageClassifier:
    """The classifier of one arm (the kind says which arguments the arm sets)."""
    sweep = args.sweep
    common = dict(arch=args.arch, lr=lr, weight_decay=args.weight_decay, optimizer=sweep.optimizer,
                  warmup_frac=args.warmup_frac, schedule=args.schedule, num_classes=num_classes,
                  mrs_backend=args.mrs_backend, arch_kwargs=arch_kwargs(args), cifar_stem=args.cifar_stem)
    return ImageClassifier(**{**common, **sweep.model_arms(arm)})  # the arm's setting wins


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


def fit(trainer: pl.Trainer, model: pl.LightningModule, dm: pl.LightningDataModule) -> None:
    """``trainer.fit``, with Ctrl-C raised as ``KeyboardInterrupt`` (Lightning turns it into ``exit(1)``)."""
    handler = signal.getsignal(signal.SIGINT)
    try:
        trainer.fit(model, datamodule=dm)
    except SystemExit:
        if trainer.interrupted:
            raise KeyboardInterrupt from None
        raise
    finally:
        if signal.getsignal(signal.SIGINT) is not handler:  # Lightning ignores further Ctrl-C during its shutdown
            signal.signal(signal.SIGINT, handler)


def run_cell(args: argparse.Namespace, out: Path, name: str, *, arm: str, lr: float, batch_size: int,
             seed: int) -> dict[str, Any]:
    """Train one cell of ``args.sweep`` and return its record (the row of ``results.csv`` plus curves)."""
    for noisy in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(noisy).setLevel(logging.WARNING)  # one line per cell, not a page
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    pl.seed_everything(seed, workers=True, verbose=False)

    dm = datamodule(args, batch_size)
    model = build_model(args, arm, lr, dm.num_classes)
    tb_dir = out / "tb" / name
    if tb_dir.exists():  # a cell interrupted earlier: start its run afresh
        shutil.rmtree(tb_dir)
    tb = RunLogger(save_dir=str(out / "tb"), name=name, version="")
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
        callbacks=[*args.sweep.monitors(args), divergence, ValidateAtEnd()],
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
    fit(trainer, model, dm)

    diverged_at = divergence.divergence_step
    history = memory.history
    val = counted_top1(history.get("val/top1", []), diverged_at, 1.0 / dm.num_classes)
    tops = [v for _, v in val if math.isfinite(v)]
    losses = divergence.losses
    metrics, curves = args.sweep.measure(history)
    record = {
        "cell": name, args.sweep.arm_column: arm, "lr": lr, "batch_size": batch_size, "seed": seed,
        "arch": args.arch, "dataset": args.dataset, "num_classes": dm.num_classes,
        "steps": trainer.global_step,
        "planned_steps": int(trainer.estimated_stepping_batches),
        "best_top1": max(tops, default=math.nan),
        "final_top1": val[-1][1] if val else math.nan,
        "final_val_loss": (history.get("val/loss") or [(0, math.nan)])[-1][1],
        "final_train_loss": losses[-1][1] if losses else math.nan,
        "diverged": diverged_at is not None,
        "divergence_step": diverged_at,
        **metrics,
        "tb_run": str(Path("tb") / name),
        "curves": {"train_loss": thin(losses), "val_top1": [[s, v] for s, v in val], **curves},
    }
    _log_cell_hparams(args, tb, record, trainer)
    return record


#: the record's values every cell shows in TensorBoard's HParams dashboard (with its kind's metric columns)
HPARAMS_METRICS = ("final_top1", "best_top1", "final_val_loss", "final_train_loss", "diverged")


def _log_cell_hparams(args: argparse.Namespace, tb: Logger, record: dict[str, Any], trainer: pl.Trainer) -> None:
    """The cell as one HParams session: the grid's axes and the sweep's settings, and the record's metrics
    (``z-final/<column>``, as ``results.csv`` has them: a diverged cell's final top-1 is chance)."""
    sweep = args.sweep
    params = {
        "sweep": sweep.name, sweep.arm_column: record[sweep.arm_column], "lr": record["lr"],
        "batch_size": record["batch_size"], "seed": record["seed"], "arch": args.arch, "dataset": args.dataset,
        "num_classes": record["num_classes"], "epochs": args.epochs, "max_steps": args.max_steps,
        "precision": str(trainer.precision), "optimizer": sweep.optimizer, "weight_decay": args.weight_decay,
        "warmup_frac": args.warmup_frac, "schedule": args.schedule, "image_size": args.image_size,
        "augment": args.augment, "arch_kwargs": arch_kwargs(args),
    }
    columns = [*HPARAMS_METRICS, *sweep.metric_columns]
    metrics = {f"{FINAL}/{c}": _number(record.get(c)) for c in columns}
    log_hparams([tb], params, metrics, step=trainer.global_step, metric_names=list(metrics))


def _number(value: Any) -> Optional[float]:
    return None if value is None else float(value)  # a bool (diverged) as 0/1
