"""One cell of ``--sweep convert``: the base model (trained once and cached, or ``--pretrained``), swapped per arm,
then healed; the val bpb right after the swap and along the healing.

The base model is the LM recipe's ``ByteLM`` with the Llama's own RMSNorms (``norm="none"``),
trained :data:`~recipes.sweeps.kinds.convert.BASE_LR`-peaked AdamW for ``--base-steps`` steps on the
sweep's text with the cell's seed (its initialisation and data order), and its weights are cached
in ``$LIGHTNING_MRS_CACHE/convert_base`` (else ``~/.cache/lightning_mrs/convert_base``) under a key
of every setting that defines it (:func:`base_key`): the arms and seeds of a sweep, its reruns and
other sweeps with the same base settings load it (a file lock makes concurrent cells wait for one
training). ``--pretrained DIR``: the checkpoint is the base, with its tokenizer (val bpb over the
bytes the targets cover, as the LM recipe).

A cell: the base weights, the arm's swap (:func:`swap`; ``mrs-calibrate`` on one batch of
training windows drawn with the cell's seed), then ``--max-steps`` healing steps of the LM recipe's
optimizer and schedule (a fresh AdamW; the healing data order is seeded by the cell's seed, the
same for every arm). :class:`HealingEval` measures the val bpb on the fixed validation windows in
float32, eval mode, at step 0 (after the swap, before any step) and at
:func:`~recipes.sweeps.kinds.convert.eval_steps`. A cell whose loss turns non-finite stops and counts as
:data:`~recipes.sweeps.score.DIVERGED_BPB`. Imported only where a cell trains.
"""

from __future__ import annotations

import argparse
import copy
import fcntl
import hashlib
import json
import logging
import math
import os
import statistics
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_mrs import MRSNorm, SwapReport, swap_norms
from recipes.text.byte_lm import ByteLM
from recipes.common.errors import UsageError
from recipes.text.pretrained import BYTES, check_vocab
from recipes.sweeps.cells.image import DivergenceStop, fit
from recipes.sweeps.kinds.convert import BASE_LR, BASE_WARMUP, eval_steps, split_arm
from recipes.sweeps.cells.lm import trainer_precision
from recipes.sweeps.score import DIVERGED_BPB
from recipes.sweeps.series import thin
from recipes.text.data import RandomWindows, TextDataModule

__all__ = ["HEAL_SEED", "HealingEval", "base_key", "base_state", "cache_root", "calibration_batch", "check_convert_cells",
           "evaluate", "run_convert_cell", "swap"]

#: the healing stream's seed is this plus the cell's (not the base training's stream again); the calibration's, twice it
HEAL_SEED = 1000
#: bump when the base model's training changes in a way its settings do not show
BASE_VERSION = 1


def cache_root() -> Path:
    """Where base models are cached: ``$LIGHTNING_MRS_CACHE/convert_base``, else ``~/.cache/lightning_mrs/...``."""
    base = os.environ.get("LIGHTNING_MRS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "lightning_mrs")
    return Path(base) / "convert_base"


def _quiet() -> None:
    for noisy in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    for message in (".*does not have many workers.*", ".*LeafSpec.*", ".*lr_scheduler.step.*"):
        warnings.filterwarnings("ignore", message=message)


def new_model(args: argparse.Namespace, lr: float, warmup_frac: float, schedule: str) -> ByteLM:
    """The base architecture with its own norms (random weights; ``--pretrained``: the checkpoint's)."""
    if args.pretrained:
        return ByteLM(pretrained=args.pretrained, norm="none", mrs_backend=args.mrs_backend, lr=lr,
                      weight_decay=args.weight_decay, warmup_frac=warmup_frac, schedule=schedule, seq_len=args.seq_len,
                      sample_bytes=0)
    return ByteLM(arch=args.arch, config=args.arch_kwargs, norm="none", mrs_backend=args.mrs_backend, lr=lr,
                  weight_decay=args.weight_decay, warmup_frac=warmup_frac, schedule=schedule, seq_len=args.seq_len,
                  sample_bytes=0)


def datamodule(args: argparse.Namespace, batch_size: int) -> TextDataModule:
    """The sweep's text in windows of ``--seq-len``: bytes, or the ``--pretrained`` checkpoint's tokens."""
    return TextDataModule(dataset=args.dataset, path=args.root if args.dataset == "text" else None,
                          seq_len=args.seq_len, batch_size=batch_size,
                          val_windows=args.sweep.datasets[args.dataset]["val_windows"], num_workers=args.num_workers,
                          tokenizer=args.pretrained)


def _precision(args: argparse.Namespace) -> str:
    return args.precision or args.sweep.datasets[args.dataset]["precision"]


def _trainer(args: argparse.Namespace, out: Path, steps: int, callbacks: list[Callback]) -> pl.Trainer:
    return pl.Trainer(accelerator=args.accelerator, devices=1, max_steps=steps, logger=False, callbacks=callbacks,
                      limit_val_batches=0, num_sanity_val_steps=0, gradient_clip_val=1.0, enable_checkpointing=False,
                      enable_model_summary=False, enable_progress_bar=args.progress, default_root_dir=str(out),
                      **trainer_precision(_precision(args), args.accelerator))


# ----------------------------------------------------------------------------- the base model
def base_key(args: argparse.Namespace, batch_size: int, seed: int) -> dict[str, Any]:
    """Every setting that defines a trained base model (its cache key)."""
    return {"version": BASE_VERSION, "arch": args.arch, "arch_kwargs": args.arch_kwargs, "dataset": args.dataset,
            "root": os.path.abspath(args.root) if args.dataset == "text" else None, "seq_len": args.seq_len,
            "batch_size": batch_size, "steps": args.base_steps, "lr": BASE_LR, "warmup_frac": BASE_WARMUP,
            "schedule": "cosine", "weight_decay": args.weight_decay, "precision": _precision(args), "seed": seed,
            "torch": torch.__version__.split("+")[0]}


def _key_path(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / f"base-{digest}-seed{key['seed']}.pt"


def base_state(args: argparse.Namespace, out: Path, dm: TextDataModule, batch_size: int,
               seed: int) -> tuple[dict[str, torch.Tensor], bool, float, Path]:
    """The base model's weights for ``seed``: from the cache, or trained now and cached.

    Returns ``(state_dict, trained now, seconds it took, cache file)``.
    """
    key = base_key(args, batch_size, seed)
    path = _key_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another cell training the same base: wait for it, then load
        if path.exists():
            return torch.load(path, weights_only=True), False, time.monotonic() - start, path
        pl.seed_everything(seed, workers=True, verbose=False)
        model = new_model(args, BASE_LR, BASE_WARMUP, "cosine")
        divergence = DivergenceStop()
        fit(_trainer(args, out, args.base_steps, [divergence]), model, dm)
        if divergence.divergence_step is not None:
            raise RuntimeError(f"the base model (seed {seed}) diverged at step {divergence.divergence_step}")
        state = {k: v.detach().cpu().clone() for k, v in model.model.state_dict().items()}
        tmp = path.with_name(f".{path.name}.tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)
        path.with_suffix(".json").write_text(json.dumps({**key, "final_train_loss": divergence.losses[-1][1]},
                                                        indent=2) + "\n")
        return state, True, time.monotonic() - start, path


# ----------------------------------------------------------------------------- measuring and swapping
def _loader(dm: TextDataModule, batch_size: int) -> DataLoader:
    return DataLoader(dm.val_set, batch_size=batch_size, shuffle=False)


@torch.no_grad()
def evaluate(lm: ByteLM, loader: DataLoader) -> tuple[float, float]:
    """``(val bits per byte, val nats per token)`` of ``lm`` on ``loader``'s windows, float32, eval mode."""
    was = lm.training
    lm.eval()
    nats, nbytes, tokens = 0.0, 0.0, 0
    try:
        for batch in loader:
            window, covered = lm.windows(batch)
            window = window.to(lm.device)
            nats += float(lm._nats(window).double())
            nbytes += float(covered.sum())
            tokens += window[:, 1:].numel()
    finally:
        lm.train(was)
    return nats / nbytes / math.log(2), nats / tokens


def calibration_batch(dm: TextDataModule, batch_size: int, seed: int) -> torch.Tensor:
    """``batch_size`` training windows' inputs ``(N, T)``, drawn with ``seed`` (never the validation windows)."""
    stream = iter(RandomWindows(dm.train_split.data, dm.seq_len + 1, 2 * HEAL_SEED + seed, batch_size))
    windows = [next(stream) for _ in range(batch_size)]
    tokens = torch.stack([w[0] if isinstance(w, tuple) else w for w in windows]).long()  # (N, T + 1)
    return tokens[:, :-1]


def swap(lm: ByteLM, arm: str, calibration: Optional[torch.Tensor], backend: str) -> Optional[SwapReport]:
    """The arm's swap of ``lm.model`` in place (``continue``: none); every MRSNorm on ``backend``."""
    norm, init = split_arm(arm)
    if norm == "none":
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if init == "calibrate":
            report = swap_norms(lm.model, norm, init="calibrate", calibration=calibration.to(lm.device))
        else:
            report = swap_norms(lm.model, norm, init=init)
    if not report.converted:
        raise UsageError(f"--convert-arms {arm}: the swap converted none of the model's norms ({report})")
    for module in lm.model.modules():
        if isinstance(module, MRSNorm):
            module.backend = backend
    lm.swap_report = report
    return report


class HealingEval(Callback):
    """The val bpb at step 0 (when training starts) and at ``steps``, into ``points`` ``[(step, bpb, nats)]``."""

    def __init__(self, steps: list[int], measure: Callable[[ByteLM], tuple[float, float]]) -> None:
        self.steps, self.measure = set(steps), measure
        self.points: list[tuple[int, float, float]] = []

    def _take(self, step: int, pl_module: pl.LightningModule) -> None:
        if step in self.steps and all(s != step for s, *_ in self.points):
            self.points.append((step, *self.measure(pl_module)))

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._take(trainer.global_step, pl_module)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor) and not torch.isfinite(loss).all():
            return  # DivergenceStop stops the run: a NaN model is not measured
        self._take(trainer.global_step, pl_module)


def _median(values: list[float]) -> Optional[float]:
    return statistics.median(values) if values else None


# ----------------------------------------------------------------------------- the cell
def run_convert_cell(args: argparse.Namespace, out: Path, name: str, *, arm: str, lr: float, batch_size: int,
                     seed: int) -> dict[str, Any]:
    """Swap the base model per ``arm``, heal it ``--max-steps`` steps, return the record (``healing``: its curve)."""
    _quiet()
    pl.seed_everything(seed, workers=True, verbose=False)
    dm = datamodule(args, batch_size)
    dm.load()
    state, trained, base_s, path = (None, False, 0.0, None) if args.pretrained else \
        base_state(args, out, dm, batch_size, seed)
    lm = new_model(args, lr, args.warmup_frac, args.schedule)
    if state is not None:
        lm.model.load_state_dict(state)
    loader = _loader(dm, batch_size)
    base_bpb, _ = evaluate(lm, loader)
    calibration = calibration_batch(dm, batch_size, seed) if split_arm(arm)[1] == "calibrate" else None
    report = swap(lm, arm, calibration, args.mrs_backend)
    healing, divergence = HealingEval(eval_steps(args.max_steps), lambda m: evaluate(m, loader)), DivergenceStop()
    pl.seed_everything(HEAL_SEED + seed, workers=True, verbose=False)  # the healing stream: the same for every arm
    trainer = _trainer(args, out, args.max_steps, [healing, divergence])
    fit(trainer, lm, dm)

    diverged_at = divergence.divergence_step
    points = healing.points
    bpbs = [b for _, b, _ in points]
    final = DIVERGED_BPB if diverged_at is not None or not points else min(points[-1][1], DIVERGED_BPB)
    calibrated = report.calibration if report is not None else {}
    record = {
        "cell": name, "arm": arm, "lr": lr, "batch_size": batch_size, "seed": seed,
        "arch": lm.model.config.model_type, "dataset": args.dataset, "precision": _precision(args),
        "steps": trainer.global_step, "planned_steps": args.max_steps, "final_bpb": final,
        "best_bpb": min([min(b, DIVERGED_BPB) for b in bpbs if math.isfinite(b)], default=DIVERGED_BPB),
        "final_val_loss": points[-1][2] if points and diverged_at is None else math.nan,
        "final_train_loss": divergence.losses[-1][1] if divergence.losses else math.nan,
        "diverged": diverged_at is not None, "divergence_step": diverged_at,
        "bpb_step0": points[0][1] if points and points[0][0] == 0 else None, "base_bpb": base_bpb,
        "converted": len(report.converted) if report is not None else 0,
        "calib_err_inherit": _median([e[0] for e in calibrated.values()]),
        "calib_err_fitted": _median([e[1] for e in calibrated.values()]),
        "base_trained": trained, "base_s": round(base_s, 2), "base_cache": str(path) if path else None,
        "base_pretrained": os.path.abspath(args.pretrained) if args.pretrained else None,
        "tb_run": "",
        "healing": [{"arm": arm, "lr": lr, "batch_size": batch_size, "seed": seed, "step": s, "val_bpb": b}
                    for s, b, _ in points],
        "curves": {"train_loss": thin(divergence.losses), "val_bpb": [[s, b] for s, b, _ in points]},
    }
    return record


def check_convert_cells(args: argparse.Namespace, cells: list[tuple[str, float, int, int]]) -> dict[str, Any]:
    """Before the first cell: the text loads, the model builds and runs on it, a calibrated swap runs."""
    _quiet()
    if args.max_steps is None:
        raise UsageError("--sweep convert heals for a number of optimizer steps: give --max-steps, not --epochs.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = new_model(args, args.lrs[0], args.warmup_frac, args.schedule)
    dm = datamodule(args, 1)
    dm.load()
    if args.pretrained:
        check_vocab(dm.tokenizer, lm.model, args.pretrained)
    vocab = lm.model.get_input_embeddings().num_embeddings
    if dm.tokenizer is None and vocab != BYTES:
        raise UsageError(f"--pretrained {args.pretrained!r}: the model embeds {vocab} tokens and has no tokenizer; the "
                         f"sweep's bytes ({BYTES} ids) cannot feed it: save its tokenizer there.")
    window, _ = lm.windows(next(iter(_loader(dm, 2))))
    for arm in dict.fromkeys(arm for arm, *_ in cells):  # every swap runs on a copy, calibration included
        trial = copy.deepcopy(lm)
        try:
            swap(trial, arm, window[:, :-1], "auto")
        except ValueError as err:
            raise UsageError(f"--convert-arms {arm}: {str(err).splitlines()[0]}") from None
        with torch.no_grad():
            trial.eval()
            trial(window[:, :-1])
    params = sum(p.numel() for p in lm.model.parameters())
    base = (f"--pretrained {os.path.abspath(args.pretrained)} ({lm.model.config.model_type}, {params:,} parameters, "
            f"vocabulary {vocab})" if args.pretrained else
            f"{lm.model.config.model_type} {args.arch_kwargs}, {params:,} parameters, its own RMSNorms, trained "
            f"{args.base_steps} steps per seed and cached in {cache_root()}")
    return {"text": dm.describe(), "base": base}
