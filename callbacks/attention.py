"""``AttentionMonitor``: logit size, softmax entropy and collapse of every attention layer, live.

PAPER.md's claim for phasor attention is that a QK-norm keeps large-magnitude outliers from
saturating the softmax ("softmax collapse"). This monitor shows it during training: on
logging steps only, it captures the per-head queries and keys that enter each attention
layer's logits (hooks on the layer's ``q_norm``/``k_norm``, see
:mod:`lightning_mrs.swap.attention`), recomputes the logits of a bounded sample of queries
(fused attention never materialises them) and logs their size, the softmax entropy and the
share of collapsed attention rows (:mod:`lightning_mrs.attention_stats` defines every figure).

How a logging step works (the steps are Lightning's own,
:mod:`lightning_mrs.callbacks.logging_steps`: the figures appear where ``self.log``'s do):

1. ``on_train_batch_start``: the layers are found (``iter_attention_layers``) and a forward
   hook goes on each ``q_norm`` and ``k_norm``
   (:class:`~lightning_mrs.callbacks.attention_report.AttentionCapture`); each layer call
   reduces its q and k to a few sums on the device at once.
2. ``on_before_backward`` (and at the latest ``on_train_batch_end``): the hooks are removed.
   Only the training forward is captured: not backward recomputation (activation
   checkpointing), not validation. Micro-batches of gradient accumulation add up.
3. ``on_train_batch_end`` of the batch Lightning logs: two ``trainer.strategy.reduce`` calls,
   the step's only collectives (a sum for the sums, ``ReduceOp.MAX`` for ``logit_max``;
   ``entropy_min`` needs no minimum over ranks: it is taken over the per-head sums after
   they are summed, so it is the global batch's), figures on the device, one copy to the
   host, logged from rank zero through every logger; TensorBoard also gets, once, the
   "Attention" custom-scalars layout.

Between logging steps no hook is registered and nothing runs but a step-number check.
"""

from __future__ import annotations

import re
from collections import Counter
from functools import partial
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_mrs.attention_stats import LAYOUTS
from lightning_mrs.callbacks.attention_report import AttentionCapture, WatchedLayer, step_metrics
from lightning_mrs.callbacks.logging_steps import LoggingSteps
from lightning_mrs.callbacks.tb_layout import ATTENTION, tensorboard_experiment
from lightning_mrs.swap import AttentionInfo, iter_attention_layers

__all__ = ["AttentionMonitor"]

_ROPE_CLASSES = ("EvaAttention", "AttentionRope", "Gemma4Attention")  # rotary embedding after q_norm/k_norm


def _skip_reason(info: AttentionInfo) -> Optional[str]:
    """Why an attention layer cannot be monitored (``None`` when it can)."""
    if info.scale is None:
        return "its logit scale is learned per head (cosine attention), so the logits cannot be recomputed"
    if info.layout not in LAYOUTS:
        return f"its q/k layout {info.layout!r} is not one of {list(LAYOUTS)}"
    return None


def _unseen_terms(module: nn.Module) -> Optional[str]:
    """What the layer adds to ``scale * q . k`` that the monitor does not recompute."""
    terms = []
    if (getattr(module, "relative_position_bias_table", None) is not None
            or getattr(module, "rel_pos", None) is not None or getattr(module, "use_rel_pos", False)):
        terms.append("a relative position bias")
    if getattr(module, "rope", None) is not None or type(module).__name__ in _ROPE_CLASSES:
        terms.append("rotary embeddings (when the model passes them)")
    return " and ".join(terms) or None


def _reduce(strategy: Any, flat: torch.Tensor, op: str) -> torch.Tensor:
    """``op`` (``"sum"`` or ``"max"``) over ranks through ``strategy.reduce``; a strategy that
    only sums (XLA) gives the maximum through one ``all_gather`` instead."""
    if op == "sum":
        return strategy.reduce(flat, reduce_op="sum")
    try:
        return strategy.reduce(flat, reduce_op=torch.distributed.ReduceOp.MAX if torch.distributed.is_available()
                               else "max")
    except ValueError:
        return strategy.all_gather(flat).reshape(-1, flat.numel()).amax(dim=0)  # (world, n) -> (n,)


class AttentionMonitor(Callback):
    """Log the logits and softmax of every attention layer as ``attention/<layer>/<stat>``.

    Per layer, from the per-head queries and keys that enter the logits (the outputs of the
    layer's ``q_norm``/``k_norm``: after the QK-norm where there is one) and, for each sampled
    query, all keys of the same sample and head (see :mod:`lightning_mrs.attention_stats`):

    * ``logit_max``: the largest ``|q . k|`` times the layer's own logit scale (``1/sqrt(d)``
      for most);
    * ``entropy_mean``: the softmax entropy (nats) of each attention row, averaged over heads
      and queries; ``entropy_min``: the same mean for the lowest head;
    * ``collapsed_frac``: the share of attention rows (queries x heads) whose largest weight
      exceeds ``collapse_threshold``;
    * layers with a QK-norm only: ``q_norm_mean`` and ``k_norm_mean``, the mean L2 norm of the
      per-head query vectors (the sampled queries) and key vectors (the keys they attend to)
      *after* the QK-norm, as they enter the logits.

    ``attention/all/<stat>``: the worst layer's ``logit_max`` and ``collapsed_frac``, the mean
    over layers of the rest. Under DDP the sums are summed over ranks and ``logit_max`` takes
    the maximum, so the figures are those of the global batch (each rank samples its own
    queries). A head is one softmax: timm's differential attention has two per head.

    Limits: attention masks, additive position biases (Swin, MaxViT, relpos ViT, SAM) and
    rotary embeddings applied after ``k_norm`` (EVA, rope ViTs, Gemma 4) are not part of the
    recomputed logits (a warning names such layers); ViT-style models have none of them.
    Layers with a learned per-head logit scale (Swin V2) are skipped with a warning. Only
    what ``iter_attention_layers`` covers is monitored: timm's attention as it is,
    torch/torchvision attention once rebuilt (``expose_attention`` or a QK-norm swap).

    Args:
        log_every_n_steps: capture on the batches Lightning logs at with this interval;
            ``None`` uses the Trainer's ``log_every_n_steps``, and then the figures line up
            with ``self.log``'s.
        max_queries: queries sampled per layer call and rank (evenly spaced over samples and
            positions, the same on every step; see
            :func:`~lightning_mrs.attention_stats.query_sample`); ``None`` takes every query.
        collapse_threshold: a row is collapsed when its largest weight exceeds this; in (0, 1).
        include: a regex; only attention layers whose name matches (``re.search``) are monitored.
        dashboard: write the TensorBoard custom-scalars layout ("Attention").

    Example:
        >>> import lightning.pytorch as pl
        >>> from lightning_mrs.callbacks import AttentionMonitor
        >>> trainer = pl.Trainer(callbacks=[AttentionMonitor(max_queries=128)])  # doctest: +SKIP
    """

    def __init__(
        self,
        log_every_n_steps: Optional[int] = None,
        *,
        max_queries: Optional[int] = 256,
        collapse_threshold: float = 0.99,
        include: Optional[str] = None,
        dashboard: bool = True,
    ) -> None:
        super().__init__()
        for name, value in (("log_every_n_steps", log_every_n_steps), ("max_queries", max_queries)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"AttentionMonitor: {name} must be None or an int >= 1, got {value!r}.")
        if isinstance(collapse_threshold, bool) or not isinstance(collapse_threshold, (int, float)) or not (
            0.0 < collapse_threshold < 1.0
        ):
            raise ValueError(f"AttentionMonitor: collapse_threshold must lie in (0, 1) (a softmax weight), got "
                             f"{collapse_threshold!r}.")
        try:
            self._include = re.compile(include) if include is not None else None
        except re.error as err:
            raise ValueError(f"AttentionMonitor: include={include!r} is not a valid regex: {err}.") from err
        self.log_every_n_steps = log_every_n_steps
        self.max_queries = max_queries
        self.collapse_threshold = float(collapse_threshold)
        self.include = include
        self.dashboard = dashboard
        self._n_logs = 0  # persistent (state_dict), with the steps' count
        self._steps = LoggingSteps("AttentionMonitor", "attention/*")
        self._capture: Optional[AttentionCapture] = None
        self._start_step = 0
        self._layout_written = False
        self._warned: set[str] = set()

    @property
    def state_key(self) -> str:
        return self._generate_state_key(log_every_n_steps=self.log_every_n_steps, include=self.include)

    def _interval(self, trainer: pl.Trainer) -> int:
        return self.log_every_n_steps if self.log_every_n_steps is not None else trainer.log_every_n_steps

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message)

    def _discover(self, pl_module: pl.LightningModule) -> list[WatchedLayer]:
        found = list(iter_attention_layers(pl_module))
        # a q_norm/k_norm module that two hooks would share (within a layer or across layers)
        uses = Counter(id(m) for _, module, _ in found for m in (module.q_norm, module.k_norm))
        layers, skipped, unseen = [], [], []
        for name, module, info in found:
            if self._include is not None and not self._include.search(name):
                continue
            reason = _skip_reason(info)
            if reason is None and (uses[id(module.q_norm)] > 1 or uses[id(module.k_norm)] > 1):
                reason = ("its q_norm or k_norm module is shared (with k_norm or another layer), so hooks cannot "
                          "tell q from k")
            if reason is not None:
                skipped.append(f"{name or 'root'} ({type(module).__name__}: {reason})")
                continue
            layers.append(WatchedLayer(name, module, info))
            terms = _unseen_terms(module)
            if terms is not None:
                unseen.append(f"{name or 'root'} ({terms})")
        if skipped:
            self._warn_once("skipped:" + ";".join(skipped),
                            "AttentionMonitor: not monitoring these attention layers: " + "; ".join(skipped) + ".")
        if unseen:
            self._warn_once("unseen:" + ";".join(unseen), (
                "AttentionMonitor: these layers add terms to scale * q.k that the monitor does not recompute, so "
                "their figures are those of scale * q.k alone: " + "; ".join(unseen) + "."))
        if not layers:
            self._warn_once("nolayers", (
                "AttentionMonitor: the model has no attention layer it can monitor (timm ViT/DeiT/EVA... attention, "
                "or torch/torchvision attention after lightning_mrs.swap.expose_attention(model) or a QK-norm "
                "swap); nothing will be logged."))
        return layers

    def _drop_capture(self) -> None:
        if self._capture is not None:
            self._capture.disarm()
            self._capture = None

    def _warn_interval(self, trainer: pl.Trainer, end: float, ended: bool) -> None:
        if trainer.loggers:
            message = self._steps.no_logging_step(self._start_step, end, self._interval(trainer), ended)
            if message is not None:
                self._warn_once("interval", message)

    # ------------------------------------------------------------------ hooks
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        guessed = self._steps.start(trainer, pl_module)
        if guessed is not None:
            self._warn_once("resume", guessed)
        self._start_step = self._steps.current(trainer, pl_module)
        self._warn_interval(trainer, LoggingSteps.run_length(trainer), ended=False)
        self._discover(pl_module)  # warnings now, not at the first logging step

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = self._steps.current(trainer, pl_module)
        capture = self._capture
        if capture is not None and (LoggingSteps.manual(pl_module) or capture.step != step):
            self._drop_capture()  # a capture whose logging batch never ended: discard
        if self._capture is None:
            if not (LoggingSteps.is_logging_step(step, self._interval(trainer)) or trainer.should_stop):
                return
            layers = self._discover(pl_module)
            if not layers:
                return
            self._capture = AttentionCapture(layers, step, pl_module.device, self.max_queries,
                                             self.collapse_threshold, self._warn_once)
        self._capture.arm()  # every micro-batch of the logging step

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._capture is not None:
            self._capture.disarm()  # the training forward is over

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._capture is not None:
            self._capture.stepped = True

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        capture = self._capture
        try:
            if capture is None:
                return
            capture.disarm()
            # automatic optimization logs the batch that steps; manual logs every batch
            if capture.stepped or LoggingSteps.manual(pl_module):
                self._capture = None
                self._finish(trainer, capture)
        finally:
            self._steps.batch_done(pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._drop_capture()
        self._warn_interval(trainer, self._steps.current(trainer, pl_module), ended=True)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._drop_capture()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._drop_capture()

    # ------------------------------------------------------------------ reduce + log
    def _finish(self, trainer: pl.Trainer, capture: AttentionCapture) -> None:
        sums = capture.reduced(partial(_reduce, trainer.strategy))
        metrics = step_metrics(capture.layers, sums)
        if trainer.is_global_zero and metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=capture.step)
            if self.dashboard and not self._layout_written:
                names = [layer.name for layer in capture.layers]
                written = [ATTENTION.write(e, names) for e in map(tensorboard_experiment, trainer.loggers)
                           if e is not None]
                self._layout_written = any(written)
        self._n_logs += 1

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"n_logs": self._n_logs, **self._steps.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._n_logs = int(state_dict.get("n_logs", 0))
        self._steps.load_state_dict(state_dict)

    @property
    def n_logs(self) -> int:
        """Logging steps whose figures were computed so far (over resumes)."""
        return self._n_logs
