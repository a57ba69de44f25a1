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
    # FSDP2 (torch's fully_shard per decoder layer; data-parallel over all the processes)
    python recipes/lm.py --trainer.strategy fsdp2 --trainer.devices 4
    python recipes/lm.py --help

The model (:mod:`recipes.causal_lm`) is any transformers causal LM (``--model.arch``: a
``model_type``) built from its config with small defaults and ``--model.config`` overrides,
nothing downloaded. Bytes are the tokens (vocabulary 256), so ``val/bpb`` (bits per byte) is
``val/loss / ln 2``. The data (:mod:`recipes.text_data`): the interpreter's standard library
(``stdlib``) or your text files (``text``), split by file, random windows for training and a
fixed set for validation.

Defaults: AdamW (betas 0.9/0.95, lr 1e-3, decoupled weight decay 0.1 on weight matrices only:
not on norms, biases and embeddings), linear warm-up then cosine decay stepped every step,
gradient clipping at norm 1 (``--trainer.gradient_clip_val``), 2000 steps
(``--trainer.max_steps``), validation every 250; precision ``bf16-mixed`` on GPUs that support
it (``16-mixed`` otherwise) and ``32-true`` on the CPU unless ``--trainer.precision`` is given.
``16-mixed`` is float16 autocast with a loss scaler on every device: on the CPU, where Lightning
would silently run bfloat16, the recipe passes ``MixedPrecision("16-mixed", "cpu",
GradScaler("cpu"))``; the log says which dtype the activations ran in. Metrics:
``train/loss``, ``train/tokens_per_s`` (all processes), ``val/loss``, ``val/bpb``; at each
validation a greedy continuation of ``--model.prompt`` goes to TensorBoard's Text tab
(``samples/greedy``). Checkpoints ``last.ckpt`` and the best ``val/loss``.

A user mistake (an unknown ``--model.arch`` or config field, a requested norm swap that
converts nothing, a folder without text, too little text, ...) is one ``error: ...`` line on
stderr and exit status 2.
"""

from __future__ import annotations

if __name__ == "__main__":  # `python recipes/lm.py`: run this file as the module recipes.lm
    import os as _os
    import sys as _sys

    _sys.path[0] = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))  # the repository root
    from recipes.lm import run

    _sys.exit(run())

import math
import os
import time
import warnings
from contextlib import nullcontext
from typing import Any, Literal, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_mrs import MRSNorm, SwapOptions, swap_norms
from recipes.causal_lm import build_causal_lm, decoder_layers, require_transformers
from recipes.errors import UsageError
from recipes.lm_checks import check_swap
from recipes.optim import optimizer_options, param_groups, warmup_cosine
from recipes.text_corpus import unigram_entropy
from recipes.text_data import TextDataModule
from recipes.hparams import FINAL, HParamsSummary, RunLogger
from recipes.training import ValidateAtEnd, build_quietly, check_model_options, cpu_fp16, default_precision, run_main

__all__ = ["ByteLM", "FSDP2Strategy", "LMCLI", "TextDataModule", "build_cli", "main", "run"]

NORMS = ("mrs", "rms", "layer", "none")
DEFAULT_PROMPT = "def __init__(self"


class ByteLM(pl.LightningModule):
    """A transformers causal LM on bytes whose norms are swapped to MRSNorm (or a baseline) at build.

    The swap happens in ``__init__``, so ``ByteLM.load_from_checkpoint(path)`` rebuilds the same
    architecture from the saved hyperparameters and loads the weights.

    Args:
        arch: a transformers ``model_type`` with a causal-LM head (see :mod:`recipes.causal_lm`).
        config: overrides of its config (e.g. ``{"hidden_size": 256, "num_hidden_layers": 8}``).
        norm: ``mrs`` (MRSNorm), ``rms`` (RMSNorm), ``layer`` (LayerNorm) replace every body norm
            (a swap that converts none is a usage error); ``none`` keeps the model's own norms.
        qk_norm: ``none``: no QK-norm is added (one the model has, e.g. Qwen3's, follows
            ``norm``); ``mrs``/``rms``/``layer``: a per-head norm of that kind on the queries
            and keys of every attention layer, whatever ``norm`` does (as the image recipe).
        mrs_backend: implementation of the MRSNorm layers: ``auto``, ``eager`` or one of
            :data:`lightning_mrs.ops.BACKENDS` (same maths; a speed/debugging knob).
        lr: peak learning rate (reached at the end of the warm-up); ``None``: 1e-3.
        weight_decay: AdamW's decoupled weight decay on the weight matrices (not on norms,
            biases and embeddings); ``None``: 0.1.
        betas: AdamW's betas; ``None``: (0.9, 0.95), the usual language-model choice.
        warmup_frac: fraction of all optimizer steps spent in linear warm-up from ~0 to ``lr``.
        schedule: ``cosine`` (decay to 0 after the warm-up) or ``constant``; stepped per step.
        seq_len: bytes per sample (the recipe links it to ``--data.seq_len``); sets the model's
            ``max_position_embeddings`` unless ``config`` does.
        attn_implementation: transformers' attention (``sdpa``, ``eager``); ``None``: its default.
        prompt: the text whose greedy continuation is logged at each validation.
        sample_bytes: bytes of that continuation (0: none).

    Example:
        >>> lm = ByteLM(config={"num_hidden_layers": 2, "hidden_size": 32}, norm="none", seq_len=32)  # doctest: +SKIP
        >>> lm(torch.zeros(2, 32, dtype=torch.long)).shape  # doctest: +SKIP
        torch.Size([2, 32, 256])
    """

    def __init__(
        self,
        arch: str = "llama",
        config: Optional[dict[str, Any]] = None,
        norm: Literal["mrs", "rms", "layer", "none"] = "mrs",
        qk_norm: Literal["none", "mrs", "rms", "layer"] = "none",
        mrs_backend: str = "auto",
        lr: Optional[float] = None,
        weight_decay: Optional[float] = None,
        betas: Optional[tuple[float, float]] = None,
        warmup_frac: float = 0.05,
        schedule: Literal["cosine", "constant"] = "cosine",
        seq_len: int = 128,
        attn_implementation: Optional[str] = None,
        prompt: str = DEFAULT_PROMPT,
        sample_bytes: int = 64,
    ) -> None:
        super().__init__()
        check_model_options(norm=norm, norms=NORMS, qk_norm=qk_norm, schedule=schedule, warmup_frac=warmup_frac,
                            mrs_backend=mrs_backend)
        if sample_bytes < 0 or (sample_bytes and not prompt):
            raise UsageError("--model.sample_bytes must be >= 0, with a non-empty --model.prompt.")
        chosen = optimizer_options("adamw", lr=lr, weight_decay=weight_decay, betas=betas)
        if weight_decay is None:
            chosen["weight_decay"] = 0.1
        if betas is None:
            chosen["betas"] = (0.9, 0.95)
        self.save_hyperparameters()
        self.hparams.update(chosen)  # the optimizer's defaults, resolved: checkpoints and logs state them
        self.model = build_causal_lm(arch, config, seq_len, attn_implementation)
        self.swap_report = None
        if norm != "none" or qk_norm != "none":
            options = SwapOptions(None if norm == "none" else norm, qk_norm=None if qk_norm == "none" else qk_norm)
            with warnings.catch_warnings(record=True) as caught:  # "converted none" is the error below
                warnings.simplefilter("always")
                self.swap_report = swap_norms(self.model, options)
            check_swap(self.model, arch, norm, qk_norm, self.swap_report)
            for w in caught:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        for module in self.model.modules():
            if isinstance(module, MRSNorm):
                module.backend = mrs_backend
        self.activation_dtype: Optional[torch.dtype] = None  # what the first decoder Linear put out
        self.last_sample: Optional[str] = None
        self._last_batch_end: Optional[float] = None
        self._fit_start = time.perf_counter()
        self._sharded = False

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx, use_cache=False).logits  # (N, T) -> (N, T, 256)

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        window = batch.long()  # (N, T + 1) bytes
        logits = self(window[:, :-1])  # (N, T, 256)
        return F.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten())  # nats per byte

    # ------------------------------------------------------------------ fitting
    @override
    def configure_model(self) -> None:
        mesh = self.device_mesh  # set by ModelParallelStrategy only
        if mesh is None or self._sharded:
            return
        from torch.distributed.fsdp import fully_shard

        if "tensor_parallel" in mesh.mesh_dim_names and mesh["tensor_parallel"].size() > 1:
            raise UsageError("ModelParallelStrategy: the LM recipe shards data-parallel only (FSDP2); give it "
                             "tensor_parallel_size=1.")
        dp = mesh["data_parallel"]
        layers = decoder_layers(self.model)
        kinds = ", ".join(sorted({type(layer).__name__ for layer in layers})) or "no decoder layer found"
        for layer in layers:  # one all-gather per block, as transformers' own FSDP wrapping does
            fully_shard(layer, mesh=dp)
        fully_shard(self.model, mesh=dp)
        self._sharded = True
        rank_zero_info(f"FSDP2: fully_shard on {len(layers)} decoder layers ({kinds}) and the whole model, "
                       f"over {dp.size()} processes")

    @override
    def on_fit_start(self) -> None:
        if self.swap_report is not None:
            rank_zero_info(str(self.swap_report))
        params = sum(p.numel() for p in self.model.parameters())
        rank_zero_info(f"model: {self.hparams.arch} ({type(self.model).__name__}), {params / 1e6:.2f} M parameters")
        self._fit_start = time.perf_counter()
        dm = getattr(self.trainer, "datamodule", None)
        if getattr(dm, "val_split", None) is not None:  # the bpb of a model that ignores the context
            for logger in self.trainer.loggers:
                logger.log_metrics({"data/val_unigram_bpb": unigram_entropy(dm.val_split.data)}, step=0)
        per_device = getattr(dm, "batch_size", None)
        if per_device is not None:
            world, accumulate = self.trainer.world_size, self.trainer.accumulate_grad_batches
            rank_zero_info(f"global batch {per_device * world * accumulate} windows of {self.hparams.seq_len} bytes "
                           f"= {per_device} per device x {world} processes x {accumulate} accumulation")
        layers = decoder_layers(self.model) or [self.model]
        first = next((m for m in layers[0].modules() if isinstance(m, nn.Linear)), None)
        if first is not None and self.activation_dtype is None:
            def record(module: nn.Module, args: Any, output: torch.Tensor) -> None:
                self.activation_dtype = output.dtype
                handle.remove()

            handle = first.register_forward_hook(record)

    @override
    def on_fit_end(self) -> None:
        bpb = self.trainer.callback_metrics.get("val/bpb")
        dm = getattr(self.trainer, "datamodule", None)
        unigram = (f" (unigram entropy of the validation bytes {unigram_entropy(dm.val_split.data):.2f})"
                   if getattr(dm, "val_split", None) is not None else "")
        rank_zero_info(f"fit: {self.trainer.global_step} steps in {time.perf_counter() - self._fit_start:.0f} s; "
                       f"val/bpb {float(bpb) if bpb is not None else float('nan'):.3f}{unigram}")

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._last_batch_end is None:
            self._last_batch_end = time.perf_counter()  # the first step's clock starts here

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    @override
    def on_train_batch_end(self, outputs: Any, batch: torch.Tensor, batch_idx: int) -> None:
        now = time.perf_counter()
        tokens = (batch.shape[1] - 1) * batch.shape[0] * self.trainer.world_size
        self.log("train/tokens_per_s", tokens / max(now - self._last_batch_end, 1e-9), on_step=True, on_epoch=False)
        self._last_batch_end = now
        if self.trainer.global_step == 1 and batch_idx == 0:
            rank_zero_info(self.describe_precision())

    def describe_precision(self) -> str:
        """Which dtype the activations ran in, under which precision setting and loss scaler."""
        plugin = self.trainer.precision_plugin
        scaler = getattr(plugin, "scaler", None)
        scaling = "no loss scaler" if scaler is None else f"loss scaler {type(scaler).__name__} on {scaler._device}"
        return (f"precision {self.trainer.precision}: activations ran in {self.activation_dtype} "
                f"({type(plugin).__name__}, {scaling})")

    # ------------------------------------------------------------------ validation
    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        loss = self._loss(batch)
        self.log("val/loss", loss, sync_dist=True, batch_size=batch.shape[0])
        self.log("val/bpb", loss / math.log(2), prog_bar=True, sync_dist=True, batch_size=batch.shape[0])

    @override
    def on_validation_end(self) -> None:
        self._last_batch_end = None  # the next step's clock starts with it, not with the validation

    @override
    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking or not self.hparams.sample_bytes:
            return
        sample = self.continuation(self.hparams.prompt, self.hparams.sample_bytes)  # every rank: FSDP2 gathers
        self.last_sample = sample
        if self.trainer.is_global_zero:
            text = "\n".join("    " + line for line in (self.hparams.prompt + sample).splitlines())  # markdown code
            for logger in self.loggers:
                if isinstance(logger, TensorBoardLogger):
                    logger.experiment.add_text("samples/greedy", text, self.global_step)

    @torch.no_grad()
    def continuation(self, prompt: str, length: int) -> str:
        """The greedy continuation of ``prompt`` (``length`` bytes, decoded as UTF-8 with replacement)."""
        ids = list(prompt.encode("utf-8"))
        context = self.trainer.precision_plugin.forward_context() if self._trainer is not None else nullcontext()
        was_training = self.training
        self.eval()
        with context:
            for _ in range(length):
                x = torch.tensor([ids[-self.hparams.seq_len:]], device=self.device)  # (1, T)
                ids.append(int(self(x)[0, -1].argmax()))
        self.train(was_training)
        return bytes(ids[len(prompt.encode("utf-8")):]).decode("utf-8", errors="replace")

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        embeddings = {f"{name}.{p}" if name else p for name, m in self.model.named_modules()
                      if isinstance(m, nn.Embedding) for p, _ in m.named_parameters(recurse=False)}
        optimizer = torch.optim.AdamW(param_groups(self.model, hp.weight_decay, no_decay=embeddings), lr=hp.lr,
                                      betas=tuple(hp.betas))
        total = max(1, int(self.trainer.estimated_stepping_batches))
        factor = warmup_cosine(total, int(round(hp.warmup_frac * total)), cosine=hp.schedule == "cosine")
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        # "name": LearningRateMonitor's tag, train/lr/<group> beside train/* (as the image recipe's)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "name": "train/lr"}}


class FSDP2Strategy(ModelParallelStrategy):
    """``--trainer.strategy fsdp2``: ModelParallelStrategy sharding over every process, no tensor parallelism.

    ModelParallelStrategy's ``"auto"`` sizes make every device of a node tensor-parallel; the
    recipe's :meth:`ByteLM.configure_model` shards data-parallel only (``fully_shard`` per decoder
    layer, then the whole model), so its data-parallel group is all the processes.
    """

    @override
    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()


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


class LMCLI(LightningCLI):
    """LightningCLI with the LM recipe's checkpointing, precision and data checks (one-line errors)."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults({
            "checkpoint.monitor": "val/loss",
            "checkpoint.mode": "min",
            "checkpoint.save_last": True,
            "checkpoint.filename": "best-step{step:06d}-bpb_{val/bpb:.4f}",
            "checkpoint.auto_insert_metric_name": False,
        })
        parser.link_arguments("data.seq_len", "model.seq_len")
        parser.add_argument("--ckpt_path", type=Optional[str], default=None,
                            help="resume training from this checkpoint (e.g. <run>/checkpoints/last.ckpt)")

    @override
    def before_instantiate_classes(self) -> None:
        require_transformers()
        config = self.config[self.subcommand] if self.subcommand else self.config
        trainer = config.trainer
        if trainer.precision is None:
            trainer.precision = default_precision(trainer.accelerator)
        if trainer.max_steps is None or trainer.max_steps <= 0:
            raise UsageError(f"--trainer.max_steps must be > 0, got {trainer.max_steps}: the training windows are an "
                             "endless random stream, so the run's length is its number of steps.")
        self.fp16_plugin = cpu_fp16(trainer.precision, trainer.accelerator)
        if self.fp16_plugin is not None:
            trainer.precision = None  # the plugin below says it
        ckpt_path = config.get("ckpt_path")
        if ckpt_path and not os.path.exists(ckpt_path):
            raise UsageError(f"--ckpt_path {ckpt_path!r}: no such file; give an existing checkpoint "
                             "(e.g. <run>/lightning_logs/version_0/checkpoints/last.ckpt) or leave it out.")

    @override
    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        self.datamodule.load()  # a missing path or too little text: one line, before the trainer talks
        given = self._get(self.config_init, "trainer", default={})
        strategy = given.get("strategy")
        if strategy == "fsdp2":  # FSDP2 over every process: data-parallel only, no tensor parallelism
            kwargs["strategy"] = FSDP2Strategy()
        if self.fp16_plugin is not None:
            plugins = given.get("plugins") or []
            plugins = plugins if isinstance(plugins, list) else [plugins]
            kwargs["plugins"] = [*plugins, self.fp16_plugin]
        if given.get("logger") in (None, True):  # Lightning's default logger, without the empty hp_metric
            root = given.get("default_root_dir") or os.getcwd()
            kwargs["logger"] = RunLogger(root, version=SLURMEnvironment.job_id())
        try:
            return super().instantiate_trainer(**kwargs)
        except (MisconfigurationException, ImportError, ValueError) as err:  # e.g. a bad accelerator
            raise UsageError(f"a --trainer option: {err}") from None


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
            "callbacks": [LearningRateMonitor(logging_interval="step"), ValidateAtEnd(), HParamsSummary(LM_SUMMARY)],
        },
        save_config_kwargs={"overwrite": True},
    )


def main(args: Optional[list[str]] = None) -> None:
    """Parse the command line, load the text, and fit."""
    cli = build_cli(args)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=cli.config.get("ckpt_path"))


def run(args: Optional[list[str]] = None) -> int:
    """:func:`main` with user errors as one stderr line, exit 2."""
    return run_main(main, args)
