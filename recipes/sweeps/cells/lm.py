"""One cell of a language-model sweep (``lm``, ``lm-qk``): train the LM recipe's ``ByteLM`` once, return its record.

The kind's ``model_arms`` says what the arm sets (``norm``, ``qk_norm``, ``precision``); the data are
the recipe's :class:`~recipes.text.data.TextDataModule` (``--dataset stdlib`` or ``text``). Every cell
runs a fixed number of optimizer steps on an endless stream of random windows and validates
:data:`VALIDATIONS` times on the fixed validation windows. Precision ``fp16`` is float16 autocast
with a loss scaler on every device (on the CPU through ``MixedPrecision("16-mixed", "cpu",
GradScaler("cpu"))``, as the recipe does); :class:`ScalerLog` counts the steps the scaler skipped
(each halves its scale: the gradients held an Inf/NaN) and keeps its last scale. ``fp16-true`` is
Lightning's ``16-true``: the model (weights, optimizer state, every activation) in float16, no scaler.
The experimental half-precision norms (``rms-half``, ``mrs-half``, ``*-safe``) are swapped in here (the LM
recipe's ``--model.norm`` does not offer them): the model is built with its own norms, then
:func:`lightning_mrs.swap_norms`. At ``fp16`` (autocast) their float32 inputs are cast to float16
(:class:`~recipes.sweeps.cells.half_inputs.HalfInputs`); the dtypes they computed in go into the record
(``norm_input_dtypes``). ``fp16-master`` is ``16-true`` with AdamW on float32 master weights, clipped there
(:mod:`recipes.sweeps.cells.master_weights`).

An fp32 cell of a kind with the mechanism table (``--sweep lm``) at
:data:`~recipes.sweeps.claims.mechanism.MECHANISM_LR` is evaluated after training by
:func:`~recipes.sweeps.cells.mechanism_eval.mechanism_rows`; its record keeps the rows under ``mechanism``.

A cell whose training loss turns non-finite stops there (:class:`~recipes.sweeps.cells.image.DivergenceStop`)
and counts as :data:`~recipes.sweeps.score.DIVERGED_BPB` bits per byte: its ``final_bpb`` is that, its
``best_bpb`` the best validation before the divergence (capped there). Imported only where a cell trains.
"""

from __future__ import annotations

import argparse
import logging
import math
import shutil
import warnings
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins import MixedPrecision
from typing_extensions import override

from lightning_mrs import swap_norms
from lightning_mrs.swap.attention import expose_attention
from lightning_mrs.swap.dyt import LLAMA_ALPHA0
from recipes.common.training import ValidateAtEnd, cpu_fp16
from recipes.common.errors import UsageError
from recipes.common.hparams import FINAL, RunLogger, log_hparams
from recipes.sweeps.cells.image import DivergenceStop, MemoryLogger, fit
from recipes.text.byte_lm import ByteLM
from recipes.text.checks import check_swap
from recipes.sweeps.kinds.lm import VALIDATIONS
from recipes.sweeps.claims.lm import HALF_NORMS, PRECISIONS, split_arm
from recipes.sweeps.output_scale import gain_factor, scale_gains, split_gain
from recipes.sweeps.claims.mechanism import MECHANISM_LR
from recipes.sweeps.score import DIVERGED_BPB
from recipes.sweeps.cells.half_inputs import HalfInputs
from recipes.sweeps.cells.master_weights import use_fp32_master
from recipes.sweeps.cells.residual_trace import ResidualTrace, trace_callback
from recipes.sweeps.series import thin
from recipes.text.data import TextDataModule

#: the arms' norms swapped in after the model is built with its own (not a --model.norm of the LM recipe)
SWAPPED = (*HALF_NORMS, "dyt", "derf")  # derf: the official alpha0 0.5, shift0 0

#: DyT's initial alpha on the LM's Llama: the paper's LLaMA values for its narrowest LLM (7B: 0.8 in front of
#: attention, 0.2 elsewhere; lightning_mrs.swap.dyt.LLAMA_ALPHA0), the paper's initialisation for LLMs
DYT_ALPHA0 = dict(zip(("*.input_layernorm", "*"), LLAMA_ALPHA0["7b"]))

__all__ = ["DYT_ALPHA0", "GRADIENT_CLIP", "MASTER", "MASTERS", "PRECISIONS", "VALIDATIONS", "ScalerLog", "check_lm_cells", "datamodule", "run_lm_cell", "trainer_precision"]



class ScalerLog(Callback):
    """The loss scaler's bookkeeping: steps it skipped and its scale after every optimizer step.

    ``torch.amp.GradScaler`` halves its scale on every step whose gradients hold an Inf/NaN (and
    skips that step) and doubles it after ``growth_interval`` clean steps; a fall of the scale is a
    skipped step. Without a scaler (bf16, fp32) nothing is recorded (``skipped`` stays ``None``).
    """

    def __init__(self) -> None:
        self.skipped: Optional[int] = None
        self.scales: list[tuple[int, float]] = []
        self._last: Optional[float] = None

    @staticmethod
    def scaler(trainer: pl.Trainer) -> Optional[torch.amp.GradScaler]:
        return getattr(trainer.precision_plugin, "scaler", None)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        scaler = self.scaler(trainer)
        if scaler is not None:
            self.skipped, self._last = 0, float(scaler.get_scale())

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        scaler = self.scaler(trainer)
        if scaler is None or self._last is None:
            return
        scale = float(scaler.get_scale())
        if scale < self._last:
            self.skipped = (self.skipped or 0) + 1
        self._last = scale
        self.scales.append((trainer.global_step, scale))

    @property
    def final_scale(self) -> Optional[float]:
        return self._last


#: results.csv's name of 16-true with float32 master weights (lm_claims.PRECISIONS["fp16-master"])
MASTER = PRECISIONS["fp16-master"]
#: the pure half precisions trained on float32 master weights -> Lightning's precision for the model
MASTERS = {MASTER: "16-true", PRECISIONS["bf16-master"]: "bf16-true"}
#: the gradient clipping of every cell (the LM recipe's): by global norm
GRADIENT_CLIP = 1.0


def trainer_precision(precision: str, accelerator: str) -> dict[str, Any]:
    """The Trainer's ``precision``/``plugins`` for a precision name (fp16 on the CPU: a real scaler; the master-weight
    16-true: Lightning's 16-true, the optimizer does the rest)."""
    if precision in MASTERS:
        return {"precision": MASTERS[precision]}
    if cpu_fp16(precision, accelerator):
        return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]}
    return {"precision": precision}


def _setting(args: argparse.Namespace, arm: str) -> dict[str, Any]:
    """The arm's model arguments and its Lightning precision name."""
    chosen = dict(args.sweep.model_arms(arm))
    precision = chosen.pop("precision", None) or args.precision or args.sweep.datasets[args.dataset]["precision"]
    return {"model": chosen, "precision": PRECISIONS.get(precision, precision)}


def datamodule(args: argparse.Namespace, batch_size: int) -> TextDataModule:
    """The cell's text: ``stdlib`` or ``--root`` (``text``), windows of the kind's sequence length."""
    d = args.sweep.datasets[args.dataset]
    return TextDataModule(dataset=args.dataset, path=args.root if args.dataset == "text" else None,
                          seq_len=args.seq_len, batch_size=batch_size, val_windows=d["val_windows"],
                          num_workers=args.num_workers)


def build_model(args: argparse.Namespace, arm: str, lr: float) -> ByteLM:
    """The arm's ``ByteLM``; without a QK-norm its attention is exposed (same outputs) for the AttentionMonitor."""
    d = args.sweep.datasets[args.dataset]
    setting = _setting(args, arm)
    chosen = setting["model"]
    norm, _ = split_gain(chosen["norm"])  # "-as-<family>": the gains start at that family's output scale
    half = norm in SWAPPED  # experimental: not a --model.norm of the recipe
    model = ByteLM(arch=args.arch, config=args.arch_kwargs, mrs_backend=args.mrs_backend, lr=lr,
                   weight_decay=args.weight_decay, warmup_frac=args.warmup_frac, schedule=args.schedule,
                   seq_len=args.seq_len, sample_bytes=0, **{**chosen, "norm": "none" if half else norm})
    if half:
        with warnings.catch_warnings():  # "converted none" is check_swap's error
            warnings.simplefilter("ignore")
            model.swap_report = swap_norms(model.model, norm, **({"alpha0": DYT_ALPHA0} if norm == "dyt" else {}))
        check_swap(model.model, args.arch, norm, chosen.get("qk_norm", "none"), model.swap_report)
        if norm in HALF_NORMS and setting["precision"] == "16-mixed":  # under autocast their inputs would be
            model.half_inputs = HalfInputs(model.model)  # float32: cast, and record
    if norm != chosen["norm"]:
        scale_gains(model.model, _norm_types(norm), gain_factor(chosen["norm"]))
    if setting["precision"] in MASTERS:
        use_fp32_master(model, GRADIENT_CLIP)
    if chosen.get("qk_norm", "none") == "none":
        expose_attention(model.model)
    return model


def _norm_types(norm: str) -> tuple[type, ...]:
    """The module types of the body norms an arm's ``norm`` puts in the model (for ``-as-`` gain scaling)."""
    from lightning_mrs.swap.half import MRSNormHalf, RMSNormHalf

    if norm in HALF_NORMS:
        return (RMSNormHalf, MRSNormHalf)
    raise UsageError(f"{norm!r}-as-...: the output-scale controls are for the half-precision norms "
                     f"({', '.join(HALF_NORMS)}).")


def check_lm_cells(args: argparse.Namespace, cells: list[tuple[str, float, int, int]]) -> dict[str, Any]:
    """The text loads, every batch size fits, every arm's model builds and runs: before the first cell."""
    if args.max_steps is None:
        raise UsageError(f"--sweep {args.sweep.name} trains on an endless stream of windows: give --max-steps, not "
                         "--epochs.")
    if args.precision is not None and any("precision" in args.sweep.model_arms(arm) for arm, *_ in cells):
        raise UsageError(f"--precision: --sweep {args.sweep.name} sets the precision per arm ({args.sweep.flag}); "
                         "drop --precision.")
    models = {}
    for arm in dict.fromkeys(arm for arm, *_ in cells):  # a model mistake before the data's log line
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            models[arm] = build_model(args, arm, args.lrs[0])
    dm = datamodule(args, 1)
    dm.load()
    for model in models.values():
        model.eval()
        with torch.no_grad():
            logits = model(dm.val_set[0][None, :-1].long())  # (1, T, 256)
        if logits.shape[-1] != 256:
            raise UsageError(f"--arch {args.arch!r} gives {logits.shape[-1]} logits per byte, not 256.")
    return {"text": dm.describe()}


def run_lm_cell(args: argparse.Namespace, out: Path, name: str, *, arm: str, lr: float, batch_size: int,
                seed: int) -> dict[str, Any]:
    """Train one cell of a language-model kind and return its record (the row of ``results.csv`` plus curves)."""
    for noisy in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")  # a step the loss scaler skipped
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    warnings.filterwarnings("ignore", message=".*add terms to scale \\* q.k.*")  # rotary and mask: stated in the report
    pl.seed_everything(seed, workers=True, verbose=False)
    setting = _setting(args, arm)
    dm = datamodule(args, batch_size)
    model = build_model(args, arm, lr)
    tb_dir = out / "tb" / name
    if tb_dir.exists():  # a cell interrupted earlier: start its run afresh
        shutil.rmtree(tb_dir)
    tb = RunLogger(save_dir=str(out / "tb"), name=name, version="")
    memory, divergence, scaler = MemoryLogger(), DivergenceStop(), ScalerLog()
    trace = ResidualTrace(model.model)  # the residual stream's largest |x| per layer and step (issue 56)
    steps = args.max_steps
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=1, max_steps=steps, logger=[tb, memory],
        callbacks=[*args.sweep.monitors(args), divergence, scaler, trace_callback(trace), ValidateAtEnd()],
        log_every_n_steps=args.log_every, val_check_interval=args.val_every or max(1, steps // VALIDATIONS),
        check_val_every_n_epoch=None, limit_val_batches=int(args.limit_val_batches) if args.limit_val_batches > 1
        else args.limit_val_batches, num_sanity_val_steps=0, enable_checkpointing=False,
        # the master-weight optimizer clips its float32 master gradients itself (recipes/sweeps/cells/master_weights.py)
        gradient_clip_val=None if setting["precision"] in MASTERS else GRADIENT_CLIP,
        enable_model_summary=False, enable_progress_bar=args.progress, default_root_dir=str(out),
        **trainer_precision(setting["precision"], args.accelerator),
    )
    fit(trainer, model, dm)

    diverged_at = divergence.divergence_step
    history = memory.history
    val = [(s, v) for s, v in history.get("val/bpb", []) if diverged_at is None or s < diverged_at]
    if diverged_at is not None:
        val.append((diverged_at, DIVERGED_BPB))
    finite = [min(v, DIVERGED_BPB) for _, v in val if math.isfinite(v)]
    losses = divergence.losses
    metrics, curves = args.sweep.measure(history)
    record = {
        "cell": name, args.sweep.arm_column: arm, "lr": lr, "batch_size": batch_size, "seed": seed,
        "arch": args.arch, "dataset": args.dataset, "precision": setting["precision"],
        "steps": trainer.global_step, "planned_steps": steps,
        "final_bpb": min(val[-1][1], DIVERGED_BPB) if val and math.isfinite(val[-1][1]) else DIVERGED_BPB,
        "best_bpb": min(finite, default=DIVERGED_BPB),
        "final_val_loss": (history.get("val/loss") or [(0, math.nan)])[-1][1],
        "final_train_loss": losses[-1][1] if losses else math.nan,
        "diverged": diverged_at is not None, "divergence_step": diverged_at,
        "channels": model.model.config.hidden_size,
        "scaler_skipped": scaler.skipped, "scaler_final_scale": scaler.final_scale,
        # the dtype each forward of a half norm computed in -> calls (fp16 autocast: it must be float16 alone)
        **({"norm_input_dtypes": dict(model.half_inputs.seen)} if hasattr(model, "half_inputs") else {}),
        **_mechanism(args, model, dm, arm, {"lr": lr, "batch_size": batch_size, "seed": seed}, diverged_at),
        **metrics,
        "growth": [{args.sweep.arm_column: arm, "lr": lr, "batch_size": batch_size, "seed": seed, **row}
                   for row in trace.rows()],
        "tb_run": str(Path("tb") / name),
        "curves": {"train_loss": thin(losses), "val_bpb": [[s, v] for s, v in val], "loss_scale": thin(scaler.scales),
                   **curves},
    }
    _log_cell_hparams(args, tb, record, setting["precision"])
    return record


def _mechanism(args: argparse.Namespace, model: ByteLM, dm: TextDataModule, arm: str, cell: dict[str, Any],
               diverged_at: Optional[int]) -> dict[str, Any]:
    """``{"mechanism": rows}`` for an fp32 RMSNorm/MRSNorm cell at MECHANISM_LR of a kind that has the table."""
    norm, precision = split_arm(arm)
    wanted = any(t.name == "mechanism" for t in args.sweep.tables)
    if not wanted or precision != "fp32" or norm not in ("rms", "mrs") or diverged_at is not None:
        return {}
    if abs(cell["lr"] - MECHANISM_LR) > 1e-9 * MECHANISM_LR:
        return {}
    from recipes.sweeps.cells.mechanism_eval import mechanism_rows

    windows = torch.stack([dm.val_set[i] for i in range(len(dm.val_set))])  # (W, T + 1)
    return {"mechanism": mechanism_rows(model.model, windows, norm, cell)}


#: the record's values every language-model cell shows in TensorBoard's HParams dashboard (with the kind's columns)
HPARAMS_METRICS = ("final_val_loss", "final_train_loss", "diverged")


def _log_cell_hparams(args: argparse.Namespace, tb: RunLogger, record: dict[str, Any], precision: str) -> None:
    """The cell as one HParams session: the grid's axes and settings, the record's metrics (``z-final/<column>``,
    as ``results.csv`` has them: a diverged cell's final bpb is 8)."""
    sweep, d = args.sweep, args.sweep.datasets[args.dataset]
    params = {"sweep": sweep.name, sweep.arm_column: record[sweep.arm_column], "lr": record["lr"],
              "batch_size": record["batch_size"], "seed": record["seed"], "arch": args.arch, "dataset": args.dataset,
              "max_steps": args.max_steps, "precision": precision, "optimizer": sweep.optimizer,
              "weight_decay": args.weight_decay, "warmup_frac": args.warmup_frac, "schedule": args.schedule,
              "seq_len": args.seq_len, "arch_kwargs": args.arch_kwargs or {}}
    metrics = {f"{FINAL}/{c}": None if record.get(c) is None else float(record[c])
               for c in (*sweep.metric_columns, *HPARAMS_METRICS)}
    log_hparams([tb], params, metrics, step=record["steps"], metric_names=list(metrics))
