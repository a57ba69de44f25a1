"""Train a byte-level causal language model with MRSNorm (or a baseline norm), via LightningCLI.

Run from the repository root (no subcommand: the script fits, validating every
``--trainer.val_check_interval`` steps):

    # offline demo on a CPU (a 4-layer, 128-wide Llama on the standard library's sources, ~2 minutes)
    python recipes/lm.py --config recipes/configs/lm_demo.yaml
    # any transformers causal LM, sized by its config; your own text; the model's own norms
    python recipes/lm.py --model.arch gpt2 --model.config '{"n_layer": 6, "n_embd": 256}' --model.norm none \\
        --data.dataset text --data.path my_corpus/
    # MRS QK-norms, true fp16 mixed precision (with a loss scaler, also on the CPU), 4 GPUs (DDP)
    python recipes/lm.py --model.qk_norm mrs --trainer.precision 16-mixed --trainer.devices 4
    # 2 machines of 4 GPUs: on node R (0, 1), or `srun python recipes/lm.py ...` (docs/recipes.md#several-machines)
    torchrun --nnodes 2 --node_rank R --nproc_per_node 4 --master_addr HOST --master_port 29500 recipes/lm.py \\
        --trainer.num_nodes 2 --trainer.devices 4
    # FSDP2 (torch's fully_shard per decoder layer; data-parallel over all the processes)
    python recipes/lm.py --trainer.strategy fsdp2 --trainer.devices 4
    # torch.compile each decoder layer (Inductor; MRSNorm keeps its own kernels inside the graphs)
    python recipes/lm.py --model.compile true --trainer.precision bf16-mixed
    # fine-tune a pretrained checkpoint (a save_pretrained directory) with its tokenizer, its norms swapped
    python recipes/lm.py --model.pretrained my-llama/ --model.norm mrs --data.dataset text --data.path corpus/
    # the monitors: which run (--monitors) and their options (--outlier.*, --monitor.*, --attention.*)
    python recipes/lm.py --monitors '[outlier, homogeneity, attention]' --outlier.log_every_n_steps 50
    python recipes/lm.py --help

The model (:mod:`recipes.text.byte_lm`, built by :mod:`recipes.text.causal_lm`) is any transformers causal
LM (``--model.arch``: a ``model_type``) built from its config with small defaults and
``--model.config`` overrides, nothing downloaded, its config checked before any weight exists;
bytes are the tokens (vocabulary 256). Or ``--model.pretrained``: a checkpoint and its tokenizer
(:mod:`recipes.text.pretrained`, the text tokenized once into cached memory-mapped files,
:mod:`recipes.text.token_cache`). ``val/loss`` is nats per token, ``val/bpb`` bits per UTF-8 byte of the
targets (``val/loss / ln 2`` for bytes), comparable across tokenizers. The data
(:mod:`recipes.text.data`): the interpreter's standard library (``stdlib``) or your text files
(``text``), split by file, random windows for training and a fixed set for validation. The end of
fit exports the model as a Hugging Face directory (``--export``, :mod:`recipes.text.export`).

Defaults: AdamW (betas 0.9/0.95, lr 1e-3, decoupled weight decay 0.1 on weight matrices only:
not on norms, biases and embeddings), linear warm-up then cosine decay stepped every step,
gradient clipping at norm 1 (``--trainer.gradient_clip_val``), 2000 steps
(``--trainer.max_steps``), validation every 250; precision ``bf16-mixed`` on GPUs that support
it (``16-mixed`` otherwise) and ``32-true`` on the CPU unless ``--trainer.precision`` is given.
``16-mixed`` is float16 autocast with a loss scaler on every device: on the CPU, where Lightning
would silently run bfloat16, and under FSDP2, which Lightning refuses it for, the recipe passes
``MixedPrecision("16-mixed", device, GradScaler(device))``; the log says which dtype the
activations ran in. Monitors (``--monitors``): ``OutlierMonitor`` (``outlier/*``) and
``GradientHomogeneityMonitor`` (``phasor/*``) by default, ``AttentionMonitor`` (``attention/*``)
on request, at ``--trainer.log_every_n_steps`` unless their own ``log_every_n_steps`` says.
Checkpoints ``last.ckpt`` and the best ``val/loss``; the run's settings and final metrics in
TensorBoard's HParams dashboard.

Resuming (``--ckpt_path``): the options that define the model (:data:`RESUME`) must be those the
checkpoint was trained with (else one error line names them); the others may change and are named
in one notice line. Ctrl-C (or SIGTERM) finishes the step, saves ``<run>/checkpoints/last.ckpt``, prints
the command that resumes and exits 130 (143); the resumed run ends where the uninterrupted one would have.
A crash saves ``crash.ckpt`` when it can (:mod:`recipes.common.interrupt`) and fails as usual.

A user mistake (an unknown ``--model.arch`` or config field, an inconsistent config, a requested
norm swap that converts nothing, a folder without text, too little text, a checkpoint of another
model, ...) is one ``error: ...`` line on stderr and exit status 2, with nothing written.
"""

from __future__ import annotations

if __name__ == "__main__":  # `python recipes/lm.py`: run this file as the module recipes.lm
    import os as _os
    import sys as _sys

    _sys.path[0] = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))  # the repository root
    from recipes.lm import run

    _sys.exit(run())

import os
from typing import Any, Literal, Optional

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_mrs.callbacks import AttentionMonitor, GradientHomogeneityMonitor, OutlierMonitor
from recipes.text.byte_lm import ByteLM, FSDP2Strategy
from recipes.text.causal_lm import require_transformers
from recipes.common.checkpoints import DEFINES_MODEL, MAY_CHANGE, OptionsRecord, check_resume
from recipes.common.errors import UsageError
from recipes.common.hparams import FINAL, HParamsSummary, RunLogger
from recipes.text.export import ExportHF
from recipes.common.interrupt import resume_callbacks, run_resumable
from recipes.text.pretrained import check_vocab
from recipes.text.data import TextDataModule
from recipes.common.training import (StepProgressBar, ValidateAtEnd, build_quietly, check_nodes, cpu_fp16,
                                     default_precision, note_processes)

__all__ = ["LM_SUMMARY", "MONITORS", "RESUME", "ByteLM", "FSDP2Strategy", "LMCLI", "TextDataModule", "build_cli",
           "cpu_fp16", "main", "run"]

SCRIPT = "recipes/lm.py"

#: the final metrics of a run in TensorBoard's HParams dashboard: ``name -> (logged tag, reduction)``
LM_SUMMARY: dict[str, tuple[str, str]] = {
    f"{FINAL}/val_bpb": ("val/bpb", "last"),
    f"{FINAL}/best_val_bpb": ("val/bpb", "min"),
    f"{FINAL}/val_loss": ("val/loss", "last"),
    f"{FINAL}/train_loss": ("train/loss", "last"),
    f"{FINAL}/diverged": ("train/loss", "nonfinite"),
    f"{FINAL}/mean_grad_cv": ("phasor/all/grad_cv", "mean"),
    f"{FINAL}/max_logit": ("attention/all/logit_max", "max"),
    f"{FINAL}/max_absmax": ("outlier/all/absmax", "max"),
}

#: what each option is to a resumed run (``--ckpt_path``); a new option is one line here
RESUME: dict[str, str] = {
    "--model.arch": DEFINES_MODEL,
    "--model.pretrained": DEFINES_MODEL,
    "--model.config": DEFINES_MODEL,
    "--model.norm": DEFINES_MODEL,
    "--model.qk_norm": DEFINES_MODEL,
    "--data.seq_len": DEFINES_MODEL,  # the model's positions (max_position_embeddings) and the windows
    "--model.lr": MAY_CHANGE,
    "--model.weight_decay": MAY_CHANGE,
    "--model.betas": MAY_CHANGE,
    "--model.warmup_frac": MAY_CHANGE,
    "--model.schedule": MAY_CHANGE,
    "--model.mrs_backend": MAY_CHANGE,
    "--model.attn_implementation": MAY_CHANGE,
    "--model.compile": MAY_CHANGE,
    "--data.dataset": MAY_CHANGE,
    "--data.path": MAY_CHANGE,
    "--data.batch_size": MAY_CHANGE,
    "--data.val_fraction": MAY_CHANGE,
    "--data.split_seed": MAY_CHANGE,
    "--data.val_windows": MAY_CHANGE,
    "--data.cache_dir": MAY_CHANGE,
    "--trainer.max_steps": MAY_CHANGE,
    "--trainer.precision": MAY_CHANGE,
    "--trainer.accumulate_grad_batches": MAY_CHANGE,
    "--trainer.gradient_clip_val": MAY_CHANGE,
    "--trainer.devices": MAY_CHANGE,
    "--trainer.num_nodes": MAY_CHANGE,
    "--seed_everything": MAY_CHANGE,
}

#: ``--monitors`` choices -> (the monitor, its option group: ``--monitor.*`` as in the image recipe)
MONITORS: dict[str, tuple[type, str]] = {
    "outlier": (OutlierMonitor, "outlier"),
    "homogeneity": (GradientHomogeneityMonitor, "monitor"),
    "attention": (AttentionMonitor, "attention"),
}
DEFAULT_MONITORS = ["outlier", "homogeneity"]


def fp16_plugin(precision: Any, accelerator: Any, strategy: Any) -> Optional[Any]:
    """The plugin of real float16 autocast with a loss scaler where Lightning would not give it: on the CPU
    (:func:`recipes.common.training.cpu_fp16`) and under ``--trainer.strategy fsdp2`` on a GPU (Lightning refuses
    ``16-mixed`` with ModelParallelStrategy; torch's ``GradScaler`` is right there: its Inf/NaN check of
    FSDP2's sharded gradients is reduced over the shards by DTensor, so every process skips the same steps)."""
    plugin = cpu_fp16(precision, accelerator)
    if plugin is None and strategy == "fsdp2" and str(precision) in ("16-mixed", "16") and torch.cuda.is_available():
        from lightning.pytorch.plugins import MixedPrecision

        plugin = MixedPrecision("16-mixed", "cuda", scaler=torch.amp.GradScaler("cuda"))
    return plugin


class LMCLI(LightningCLI):
    """LightningCLI with the LM recipe's checkpointing, monitors, precision, resume and data checks."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")  # the best; last.ckpt: resume_callbacks()
        parser.set_defaults({
            "checkpoint.monitor": "val/loss",
            "checkpoint.mode": "min",
            "checkpoint.filename": "best-step{step:06d}-bpb_{val/bpb:.4f}",
            "checkpoint.auto_insert_metric_name": False,
        })
        parser.link_arguments("data.seq_len", "model.seq_len")
        parser.link_arguments("model.pretrained", "data.tokenizer")  # a pretrained model reads its own tokens
        parser.add_argument("--export", type=Optional[str], default="auto",
                            help="where the fit's end writes the model as a Hugging Face directory that "
                                 "lightning_mrs.from_pretrained loads: auto (<run>/hf), a path, or none")
        parser.add_argument("--monitors", type=list[Literal["outlier", "homogeneity", "attention"]],
                            default=list(DEFAULT_MONITORS),
                            help="the monitors that run: outlier (OutlierMonitor, options --outlier.*), homogeneity "
                                 "(GradientHomogeneityMonitor, --monitor.*), attention (AttentionMonitor, "
                                 "--attention.*); [] for none")
        for name, (monitor, group) in MONITORS.items():
            parser.add_lightning_class_args(monitor, group)  # dropped from the trainer unless in --monitors
        parser.add_argument("--ckpt_path", type=Optional[str], default=None,
                            help="resume training from this checkpoint (e.g. <run>/checkpoints/last.ckpt)")

    @override
    def before_instantiate_classes(self) -> None:
        require_transformers()
        config = self.config[self.subcommand] if self.subcommand else self.config
        trainer = config.trainer
        if trainer.precision is None:
            trainer.precision = default_precision(trainer.accelerator)
        check_nodes(trainer.num_nodes, trainer.plugins)
        if trainer.max_steps is None or trainer.max_steps <= 0:
            raise UsageError(f"--trainer.max_steps must be > 0, got {trainer.max_steps}: the training windows are an "
                             "endless random stream, so the run's length is its number of steps.")
        chosen = list(config.monitors or [])
        repeated = sorted({m for m in chosen if chosen.count(m) > 1})
        if repeated:
            raise UsageError(f"--monitors lists {', '.join(repeated)} more than once.")
        self.precision = str(trainer.precision)  # as asked; the plugin below may take its place
        self.fp16_plugin = fp16_plugin(trainer.precision, trainer.accelerator, trainer.strategy)
        if self.fp16_plugin is not None:
            trainer.precision = None  # the plugin below says it
        _one_row_per_step(trainer)
        ckpt_path = config.get("ckpt_path")
        if ckpt_path and not os.path.exists(ckpt_path):
            raise UsageError(f"--ckpt_path {ckpt_path!r}: no such file; give an existing checkpoint "
                             "(e.g. <run>/lightning_logs/version_0/checkpoints/last.ckpt) or leave it out.")

    def options(self) -> dict[str, Any]:
        """This run's value of every :data:`RESUME` option (the model's and the data's resolved)."""
        given = self._get(self.config, "trainer", default={})
        values: dict[str, Any] = {}
        for option in RESUME:
            section, _, key = option[2:].partition(".")
            if section == "model":
                values[option] = self.model.hparams.get(key)
            elif section == "data":
                values[option] = self.datamodule.hparams.get(key)
            elif option == "--trainer.precision":
                values[option] = self.precision
            elif section == "trainer":
                values[option] = given.get(key)
            else:
                values[option] = self._get(self.config, section, default=None)
        return values

    @override
    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        self._check_model_runs()
        options = self.options()
        ckpt_path = self.config.get("ckpt_path")
        notice = check_resume(ckpt_path, self.model, RESUME, options) if ckpt_path else None
        self.datamodule.load()  # a missing path or too little text: one line, before the trainer talks
        pretrained = self.model.hparams.get("pretrained")
        if pretrained is not None:
            check_vocab(self.datamodule.tokenizer, self.model.model, pretrained)
        if notice:
            rank_zero_info(notice)
        given = self._get(self.config_init, "trainer", default={})
        note_processes(given)
        self.model.learning_curve = True  # bpb/* first in TensorBoard, with the unigram baselines
        monitors = list(self._get(self.config, "monitors", default=DEFAULT_MONITORS) or [])
        if "attention" in monitors and self.model.hparams.qk_norm == "none":
            from lightning_mrs.swap.attention import expose_attention

            expose_attention(self.model.model)  # same weights and outputs; the monitor sees q and k
        if given.get("strategy") == "fsdp2":  # FSDP2 over every process: data-parallel only, no tensor parallelism
            kwargs["strategy"] = FSDP2Strategy()
        if self.fp16_plugin is not None:
            plugins = given.get("plugins") or []
            plugins = plugins if isinstance(plugins, list) else [plugins]
            kwargs["plugins"] = [*plugins, self.fp16_plugin]
        if given.get("logger") in (None, True):  # Lightning's default logger, without the empty hp_metric
            root = given.get("default_root_dir") or os.getcwd()
            kwargs["logger"] = RunLogger(root, version=SLURMEnvironment.job_id(), epochs=False)
        callbacks = given.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
        callbacks.append(OptionsRecord(options))
        export = self._get(self.config, "export", default="auto")
        if export not in (None, "none"):
            callbacks.append(ExportHF(None if export == "auto" else export))
        if given.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            callbacks.append(StepProgressBar())  # "train: 86/400" steps, not "Epoch 0/-2"
        kwargs["callbacks"] = callbacks
        try:
            trainer = super().instantiate_trainer(**kwargs)
        except (MisconfigurationException, ImportError, ValueError) as err:  # e.g. a bad accelerator
            raise UsageError(f"a --trainer option: {err}") from None
        unused = [self._get(self.config_init, group) for name, (_, group) in MONITORS.items() if name not in monitors]
        trainer.callbacks = [c for c in trainer.callbacks if not any(c is u for u in unused)]
        return trainer

    def _check_model_runs(self) -> None:
        """One forward of a few bytes: a config no check caught fails here, in one line."""
        model = self.model
        window = torch.zeros(1, min(8, model.hparams.seq_len), dtype=torch.long)  # (1, T)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                model(window)
        except (RuntimeError, IndexError, ValueError, TypeError, AssertionError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise UsageError(f"--model.config {model.hparams.config or {}}: the {model.hparams.arch} model it builds "
                             f"fails on its first bytes ({type(err).__name__}: {first}); check its sizes.") from None
        finally:
            model.train(was_training)


def _one_row_per_step(trainer: Any) -> None:
    """``--trainer.logger CSVLogger`` becomes :class:`recipes.common.hparams.StepCSVLogger` (same options, one row
    a step)."""
    loggers = trainer.get("logger")
    for logger in loggers if isinstance(loggers, list) else [loggers]:
        if getattr(logger, "class_path", None) in ("lightning.pytorch.loggers.CSVLogger",
                                                   "lightning.pytorch.loggers.csv_logs.CSVLogger"):
            logger.class_path = "recipes.common.hparams.StepCSVLogger"


def build_cli(args: Optional[list[str]] = None) -> LMCLI:
    """Parse the command line, build the model, data and trainer, and load the text; nothing trains."""
    return build_quietly(
        LMCLI,
        ByteLM,
        TextDataModule,
        args=args,
        seed_everything_default=0,
        trainer_defaults={
            "max_steps": 2000,
            "val_check_interval": 250,
            "check_val_every_n_epoch": None,
            "gradient_clip_val": 1.0,
            "log_every_n_steps": 10,
            "callbacks": [LearningRateMonitor(logging_interval="step"), ValidateAtEnd(), HParamsSummary(LM_SUMMARY),
                          *resume_callbacks()],
        },
        save_config_kwargs={"overwrite": True},
    )


def main(args: Optional[list[str]] = None) -> None:
    """Parse the command line, load the text, and fit."""
    cli = build_cli(args)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=cli.config.get("ckpt_path"))


def run(args: Optional[list[str]] = None) -> int:
    """:func:`main` with user errors as one stderr line (exit 2), and Ctrl-C as a resumable interruption:
    the checkpoint saved and the command that resumes (exit 130). A crash says what it saved and fails
    (:func:`recipes.common.interrupt.run_resumable`)."""
    return run_resumable(build_cli, SCRIPT, args)
