"""The language-model recipe's LightningModule: a transformers causal LM, its norms swapped at build.

:class:`ByteLM` is what ``recipes/lm.py`` trains (its command line) and what the LM stress sweeps
(:mod:`recipes.sweeps.cells.lm`) train cell by cell. The model is built in one place,
:func:`recipes.text.model.build_byte_model`: from a config (:mod:`recipes.text.causal_lm`, checked before any weight
exists; bytes are the tokens) or from a pretrained checkpoint (``pretrained``,
:mod:`recipes.text.pretrained`; its tokenizer's tokens), then the norm swap and its check.

``val/loss`` is nats per *token*; ``val/bpb`` is bits per UTF-8 *byte*: the summed token losses of
the validation windows divided by the bytes their targets cover, over ``ln 2``, so it compares
models with different tokenizers (for bytes, the two differ by ``ln 2`` only).

Logged: ``train/loss`` (nats per byte), ``train/tokens_per_s`` (all processes), ``val/loss``,
``val/bpb``, and (``learning_curve``, as the recipe's command line runs it) the learning curve
``bpb/train`` and ``bpb/val`` (bits per byte of training and validation), which TensorBoard shows
first, each with the unigram entropy of its split's bytes (the bits per byte of a model that
ignores the context) as the run ``<run>/unigram`` on the same chart; at each validation a greedy
continuation of ``prompt`` (``samples/greedy``, TensorBoard's Text tab).

Example:
    >>> lm = ByteLM(config={"num_hidden_layers": 2, "hidden_size": 32}, norm="none", seq_len=32)  # doctest: +SKIP
    >>> lm(torch.zeros(2, 32, dtype=torch.long)).shape  # doctest: +SKIP
    torch.Size([2, 32, 256])
"""

from __future__ import annotations

import inspect
import math
import os
import time
from contextlib import nullcontext
from typing import Any, Literal, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_mrs.callbacks.checkpoint_file import is_sharded, load_weights, read_metadata
from recipes.text.causal_lm import decoder_layers
from recipes.common.errors import UsageError
from recipes.text.model import build_byte_model
from recipes.text.configure import FSDP2Strategy, compile_layers, shard_layers
from recipes.common.optim import eps_underflows, optimizer_options, param_groups, run_schedule
from recipes.text.corpus import unigram_entropy
from recipes.common.training import DtypeWatch, check_model_options

__all__ = ["DEFAULT_PROMPT", "NORMS", "ByteLM", "FSDP2Strategy", "build_byte_model"]

NORMS = ("mrs", "rms", "layer", "none")
DEFAULT_PROMPT = "def __init__(self"
#: the learning curve's tag group: first in TensorBoard's Time Series (before attention/, outlier/, phasor/)
CURVE = "bpb"
#: the run beside the model's (``<run>/unigram``) that draws the unigram baselines on the curve's charts
UNIGRAM_RUN = "unigram"


class ByteLM(pl.LightningModule):
    """A transformers causal LM on bytes whose norms are swapped to MRSNorm (or a baseline) at build.

    The swap happens in ``__init__``, so ``ByteLM.load_from_checkpoint(path)`` rebuilds the same
    architecture from the saved hyperparameters and loads the weights. A resumed fit takes the
    learning rate, betas and weight decay of this run (the optimizer's saved state keeps the old
    ones otherwise): what the command line says is what trains. ``learning_curve`` (an attribute,
    off by default, on in ``recipes/lm.py``) adds the learning curve ``bpb/*`` and its unigram
    baselines (the run ``<run>/unigram``); the sweeps' cells log without it.

    Args:
        arch: a transformers ``model_type`` with a causal-LM head (see :mod:`recipes.text.causal_lm`).
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
        sample_bytes: bytes of that continuation (0: none; with a tokenizer: tokens).
        pretrained: a pretrained checkpoint to fine-tune instead of a model built from ``arch``
            and ``config`` (which it excludes): a ``save_pretrained`` directory, or a hub name
            where the network allows (:mod:`recipes.text.pretrained`); its tokenizer feeds the
            data (the recipe links ``--data.tokenizer`` to it).
        compile: ``torch.compile`` the decoder layers when the trainer sets the model up
            (:func:`recipes.text.configure.compile_layers`: in place, weights' names unchanged; after
            FSDP2's sharding); the first steps then take longer while Inductor compiles.
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
        pretrained: Optional[str] = None,
        compile: bool = False,
    ) -> None:
        super().__init__()
        if pretrained is not None and config:
            raise UsageError(f"--model.config {config} conflicts with --model.pretrained {pretrained!r}: the model's "
                             "config is the checkpoint's; drop --model.config.")
        if pretrained is not None and arch != "llama":
            raise UsageError(f"--model.arch {arch} conflicts with --model.pretrained {pretrained!r}: the "
                             "architecture is the checkpoint's; drop --model.arch.")
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
        self.model, self.swap_report = build_byte_model(arch, config, norm, qk_norm, mrs_backend, seq_len,
                                                        attn_implementation, pretrained)
        self._val_sums: Optional[torch.Tensor] = None  # (summed target nats, target bytes) of this validation
        self._dtype_watch = DtypeWatch()  # what the first decoder layer's first matmul put out
        self.last_sample: Optional[str] = None
        self._precision_said = False
        self._last_batch_end: Optional[float] = None
        self._fit_start = time.perf_counter()
        self._start_step: Optional[int] = None  # the step this fit's training started at (None: it did not)
        self._saved_val_bpb: Optional[tuple[int, float]] = None  # (step, val/bpb) of the resumed checkpoint
        self._unigram: dict[str, float] = {}  # split -> bits per byte of its unigram model
        self._unigram_writers: dict[str, Any] = {}  # TensorBoard log dir -> writer of <run>/unigram
        self.learning_curve = False  # bpb/* and the <run>/unigram baselines; the command line turns it on
        self._sharded = False
        self._compiled = False

    @property
    def activation_dtype(self) -> Optional[torch.dtype]:
        """The dtype the first decoder layer's first matmul put out in this fit (``None`` before its first batch)."""
        return self._dtype_watch.dtype

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx, use_cache=False).logits  # (N, T) -> (N, T, vocab)

    @staticmethod
    def windows(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch's windows ``(N, T + 1)`` and the UTF-8 bytes their targets cover ``(N,)`` (bytes: ``T`` each)."""
        if isinstance(batch, (list, tuple)):
            window, nbytes = batch
            return window.long(), nbytes
        window = batch.long()
        return window, torch.full((window.shape[0],), window.shape[1] - 1, device=window.device)

    def _nats(self, window: torch.Tensor) -> torch.Tensor:
        """The summed next-token losses (nats) of ``window`` ``(N, T + 1)``."""
        logits = self(window[:, :-1])  # (N, T, vocab)
        return F.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten(), reduction="sum")

    # ------------------------------------------------------------------ fitting
    @override
    def configure_model(self) -> None:
        mesh = self.device_mesh  # set by ModelParallelStrategy only
        if mesh is not None and not self._sharded:
            self._sharded = True
            rank_zero_info(shard_layers(self.model, mesh))
        if self.hparams.get("compile") and not self._compiled:  # after the sharding: its hooks stay eager
            self._compiled = True
            rank_zero_info(f"torch.compile: {compile_layers(self.model)}")

    @override
    def on_fit_start(self) -> None:
        if self.swap_report is not None:
            rank_zero_info(str(self.swap_report))
        params = sum(p.numel() for p in self.model.parameters())
        rank_zero_info(f"model: {self.hparams.arch} ({type(self.model).__name__}), {params / 1e6:.2f} M parameters")
        self._fit_start = time.perf_counter()
        self._start_step = None
        dm = getattr(self.trainer, "datamodule", None)
        for split in ("train", "val"):  # the bpb of a model that ignores the context
            data = getattr(getattr(dm, f"{split}_split", None), "data", None)
            if data is not None:
                self._unigram[split] = data.unigram_bpb() if hasattr(data, "unigram_bpb") else unigram_entropy(data)
        tokenizer = getattr(dm, "tokenizer", None)
        if tokenizer is not None:
            rank_zero_info(f"tokens: {type(tokenizer).__name__} of {len(tokenizer)} ids; val/loss is nats per token, "
                           "val/bpb bits per UTF-8 byte of the targets (comparable across tokenizers)")
        per_device = getattr(dm, "batch_size", None)
        if per_device is not None:
            world, accumulate = self.trainer.world_size, self.trainer.accumulate_grad_batches
            unit = "tokens" if tokenizer is not None else "bytes"
            rank_zero_info(f"global batch {per_device * world * accumulate} windows of {self.hparams.seq_len} {unit} "
                           f"= {per_device} per device x {world} processes x {accumulate} accumulation")
        self._dtype_watch.watch((decoder_layers(self.model) or [self.model])[0])

    @override
    def on_train_start(self) -> None:
        for optimizer in self.trainer.optimizers:  # the optimizer that trains (a wrapper may hold float32 masters)
            self._check_eps_in_half(optimizer)
        self._start_step = self.trainer.global_step
        if self.trainer.ckpt_path is not None:
            self._apply_optimizer_options()
        if self._start_step == 0:
            self._log_unigram(0)

    def _apply_optimizer_options(self) -> None:
        """This run's lr, betas and weight decay on the optimizer and schedule restored from a checkpoint, at
        the resumed step's point of the schedule (unchanged options: the same values, bit for bit)."""
        hp = self.hparams
        optimizer = self.trainer.optimizers[0]
        scheduler = self.trainer.lr_scheduler_configs[0].scheduler
        scheduler.base_lrs = [hp.lr] * len(optimizer.param_groups)
        for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
            group["betas"] = tuple(hp.betas)
            group["weight_decay"] = hp.weight_decay if group.get("name") == "decay" else 0.0
            group["initial_lr"] = hp.lr
            group["lr"] = hp.lr * factor(scheduler.last_epoch)  # LambdaLR's own formula

    @override
    def on_fit_end(self) -> None:
        trainer = self.trainer
        start = trainer.global_step if self._start_step is None else self._start_step  # None: nothing to train
        ran = trainer.global_step - start
        metric = trainer.callback_metrics.get("val/bpb")
        bpb = f"val/bpb {float(metric):.3f}" if metric is not None else "no validation"
        if metric is None and self._saved_val_bpb is not None:
            bpb = f"val/bpb {self._saved_val_bpb[1]:.3f} at step {self._saved_val_bpb[0]} (the checkpoint's)"
        unigram = (f" (a unigram model of the validation text: {self._unigram['val']:.2f} bits per byte)"
                   if "val" in self._unigram else "")
        if ran == 0 and start > 0:
            rank_zero_info(f"fit: nothing to train: the checkpoint is at step {start} and "
                           f"--trainer.max_steps is {trainer.max_steps} (raise it to train on); {bpb}{unigram}")
            return
        span = f" ({start} -> {trainer.global_step})" if start else ""
        rank_zero_info(f"fit: {ran} steps{span} in {time.perf_counter() - self._fit_start:.0f} s; {bpb}{unigram}")

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._last_batch_end is None:
            self._last_batch_end = time.perf_counter()  # the first step's clock starts here

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        window, nbytes = self.windows(batch)
        nats = self._nats(window)
        loss = nats / window[:, 1:].numel()  # nats per token
        self.log("train/loss", loss, prog_bar=True)
        if self.learning_curve:
            self.log(f"{CURVE}/train", nats.detach() / nbytes.sum() / math.log(2))  # bits per byte
        return loss

    @override
    def on_train_batch_end(self, outputs: Any, batch: torch.Tensor, batch_idx: int) -> None:
        now = time.perf_counter()
        window, _ = self.windows(batch)
        tokens = (window.shape[1] - 1) * window.shape[0] * self.trainer.world_size
        self.log("train/tokens_per_s", tokens / max(now - self._last_batch_end, 1e-9), on_step=True, on_epoch=False)
        self._last_batch_end = now
        if not self._precision_said and self.activation_dtype is not None:  # the fit's first batch, whatever its step
            self._precision_said = True
            rank_zero_info(self.describe_precision())
        if self.activation_dtype is not None:
            self._dtype_watch.close()

    def describe_precision(self) -> str:
        """Which dtype the activations ran in, under which precision setting and loss scaler."""
        plugin = self.trainer.precision_plugin
        scaler = getattr(plugin, "scaler", None)
        scaling = "no loss scaler" if scaler is None else f"loss scaler {type(scaler).__name__} on {scaler._device}"
        ran = self.activation_dtype if self.activation_dtype is not None else "a dtype not observed"
        return f"precision {self.trainer.precision}: activations ran in {ran} ({type(plugin).__name__}, {scaling})"

    # ------------------------------------------------------------------ checkpoints
    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, map_location: Any = None, hparams_file: Any = None,
                             strict: Optional[bool] = None, **kwargs: Any) -> "ByteLM":
        """Lightning's ``load_from_checkpoint``, which also takes FSDP2's directory of shards
        (``--trainer.strategy fsdp2``): rebuilt from its ``meta.pt`` and the shards gathered in one process."""
        if not is_sharded(checkpoint_path):
            return super().load_from_checkpoint(checkpoint_path, map_location, hparams_file, strict, **kwargs)
        meta = read_metadata(checkpoint_path, owner="ByteLM.load_from_checkpoint")
        accepted = inspect.signature(cls.__init__).parameters  # not LightningCLI's "_instantiator"
        saved = {k: v for k, v in meta.get("hyper_parameters", {}).items() if k in accepted}
        module = cls(**{**saved, **kwargs})
        load_weights(module, checkpoint_path, meta, strict=True if strict is None else strict)
        return module

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        metric = self.trainer.callback_metrics.get("val/bpb")
        if metric is not None:
            checkpoint["lm_val_bpb"] = (self.trainer.global_step, float(metric))
        elif self._saved_val_bpb is not None:
            checkpoint["lm_val_bpb"] = self._saved_val_bpb

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("lm_val_bpb")
        self._saved_val_bpb = (int(saved[0]), float(saved[1])) if saved is not None else None

    # ------------------------------------------------------------------ validation
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        window, nbytes = self.windows(batch)
        nats = self._nats(window)
        self.log("val/loss", nats / window[:, 1:].numel(), sync_dist=True, batch_size=window.shape[0])  # per token
        wide = torch.float32 if window.device.type == "mps" else torch.float64  # MPS has no float64
        sums = torch.stack([nats.detach().to(wide), nbytes.sum().to(wide)])
        self._val_sums = sums if self._val_sums is None else self._val_sums + sums

    def _log_val_bpb(self) -> None:
        """val/bpb of the whole validation: summed nats over summed target bytes (all processes), over ln 2."""
        sums, self._val_sums = self._val_sums, None
        if sums is None:
            return
        sums = self.trainer.strategy.reduce(sums, reduce_op="sum")
        bpb = (sums[0] / sums[1] / math.log(2)).float()
        self.log("val/bpb", bpb, prog_bar=True)
        if self.learning_curve:
            self.log(f"{CURVE}/val", bpb)

    @override
    def on_validation_end(self) -> None:
        self._last_batch_end = None  # the next step's clock starts with it, not with the validation

    @override
    def on_validation_epoch_end(self) -> None:
        self._log_val_bpb()
        if self.trainer.sanity_checking:
            return
        self._log_unigram(self.global_step)
        if not self.hparams.sample_bytes:
            return
        sample = self.continuation(self.hparams.prompt, self.hparams.sample_bytes)  # every rank: FSDP2 gathers
        self.last_sample = sample
        if self.trainer.is_global_zero:
            text = "\n".join("    " + line for line in (self.hparams.prompt + sample).splitlines())  # markdown code
            for logger in self.loggers:
                if isinstance(logger, TensorBoardLogger):
                    logger.experiment.add_text("samples/greedy", text, self.global_step)

    def _log_unigram(self, step: int) -> None:
        """The unigram baselines at ``step`` as the curve's tags of the run ``<run>/unigram`` (TensorBoard)."""
        if not (self.learning_curve and self._unigram) or self._trainer is None or not self.trainer.is_global_zero:
            return
        from torch.utils.tensorboard import SummaryWriter

        for logger in self.loggers:
            if isinstance(logger, TensorBoardLogger):
                path = os.path.join(logger.log_dir, UNIGRAM_RUN)
                if path not in self._unigram_writers:
                    self._unigram_writers[path] = SummaryWriter(path)
                writer = self._unigram_writers[path]
                for split, bpb in self._unigram.items():
                    writer.add_scalar(f"{CURVE}/{split}", bpb, step)
                writer.flush()

    @override
    def teardown(self, stage: str) -> None:
        for writer in self._unigram_writers.values():
            writer.close()
        self._unigram_writers.clear()
        self._dtype_watch.close()  # a fit that ended before its first training batch still holds the hook

    @torch.no_grad()
    def continuation(self, prompt: str, length: int) -> str:
        """The greedy continuation of ``prompt``: ``length`` bytes decoded as UTF-8 with replacement, or
        ``length`` tokens of the data's tokenizer."""
        tokenizer = getattr(getattr(self._trainer, "datamodule", None), "tokenizer", None) if self._trainer else None
        if tokenizer is not None:
            ids = tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = list(prompt.encode("utf-8"))
        start = len(ids)
        context = self.trainer.precision_plugin.forward_context() if self._trainer is not None else nullcontext()
        was_training = self.training
        self.eval()
        with context:
            for _ in range(length):
                x = torch.tensor([ids[-self.hparams.seq_len:]], device=self.device)  # (1, T)
                ids.append(int(self(x)[0, -1].argmax()))
        self.train(was_training)
        if tokenizer is not None:
            return tokenizer.decode(ids[start:])
        return bytes(ids[start:]).decode("utf-8", errors="replace")

    def _check_eps_in_half(self, optimizer: torch.optim.Optimizer) -> None:
        dtypes = eps_underflows(optimizer)
        if dtypes:
            names = ", ".join(str(d) for d in dtypes)
            rank_zero_warn(f"precision {self.trainer.precision}: AdamW's eps={optimizer.defaults['eps']:g} is 0 in "
                           f"{names}, the parameters' dtype, so every parameter entry whose "
                           "gradient is exactly 0 (an embedding row no token of the batch uses) becomes NaN at its "
                           "first step and the run diverges whatever its norm; train with --trainer.precision "
                           "16-mixed (float32 weights, float16 autocast) or bf16-true (docs/results-lm.md, P1h)")

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        embeddings = {f"{name}.{p}" if name else p for name, m in self.model.named_modules()
                      if isinstance(m, nn.Embedding) for p, _ in m.named_parameters(recurse=False)}
        optimizer = torch.optim.AdamW(param_groups(self.model, hp.weight_decay, no_decay=embeddings), lr=hp.lr,
                                      betas=tuple(hp.betas))
        factor = run_schedule(self.trainer, hp.warmup_frac, hp.schedule)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        # "name": LearningRateMonitor's tag, train/lr/<group> beside train/* (as the image recipe's)
        schedule = {"scheduler": scheduler, "interval": "step", "name": "train/lr"}
        return {"optimizer": optimizer, "lr_scheduler": schedule}
