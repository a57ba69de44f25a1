"""``NormSwap``: swap every norm layer of the model for MRSNorm before training starts.

A thin Lightning wrapper around :func:`lightning_mrs.swap_norms`. The swap happens in the
callback's ``setup``, before ``configure_optimizers``, so the optimizer owns the new weights;
a model built in ``configure_model`` is built first by calling that hook, as Lightning's own
``WeightAveraging`` does (Lightning asks the hook to be idempotent). Nothing of the
LightningModule is rebound: the checkpoint check is a torch load-state-dict pre-hook on the
module, removed when the stage ends.

What the swap built (every norm layer of the target's kind) is the callback's state, so it
is in every checkpoint; resuming compares what this run built with it, and
:meth:`NormSwap.restore` rebuilds a fresh model for inference.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

import lightning_mrs
from lightning_mrs.swap import SwapOptions, SwapReport, iter_norm_layers, swap_norms
from lightning_mrs.swap.spec import LayerRecord, describe_layers, differences, rebuild

__all__ = ["NormSwap"]

_SPEC_VERSION = 2


class NormSwap(Callback):
    """Replace the model's norm layers with MRSNorm (or the RMSNorm/LayerNorm baselines).

    Args:
        target: ``"mrs"``, ``"rms"`` or ``"layer"``, or a whole
            :class:`lightning_mrs.SwapOptions`.
        verbose: log the swap summary (rank zero only).
        **options: the other fields of :class:`lightning_mrs.SwapOptions` (``spatial``,
            ``include``, ``exclude``, ``init``, ``eps``, ``strict``).

    Raises:
        ValueError: an option with a bad value (the message lists the valid ones).
        TypeError: an unknown option (the message lists the valid ones).

    Example:
        >>> import lightning.pytorch as pl
        >>> trainer = pl.Trainer(callbacks=[NormSwap("mrs", exclude="head")])  # doctest: +SKIP
        >>> trainer.fit(model)  # doctest: +SKIP
        >>> model = NormSwap.restore(MyModel(), "last.ckpt")  # doctest: +SKIP
    """

    def __init__(self, target: Union[str, SwapOptions] = "mrs", *, verbose: bool = True, **options: Any) -> None:
        self.options = SwapOptions.of(target, "NormSwap", **options)
        self.verbose = verbose
        self.report: Optional[SwapReport] = None
        self._layers: dict[str, LayerRecord] = {}  # what the swap built: the checkpoint record
        self._handle: Optional[RemovableHandle] = None

    # ------------------------------------------------------------------ swapping
    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        _refuse_unsupported(trainer)
        if is_overridden("configure_model", pl_module):
            pl_module.configure_model()  # build the layers now; Lightning's own call is then a no-op
        report = swap_norms(pl_module, self.options)
        self.report = report if self.report is None else self.report.merge(report)
        self._layers = describe_layers(pl_module, self.options.target)
        if self.verbose and report.converted:
            rank_zero_info(f"NormSwap (setup, stage={getattr(stage, 'value', stage)}): {report}")
        self._remove_hook()
        self._handle = pl_module.register_load_state_dict_pre_hook(self._check_weights)

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._remove_hook()
        late = [name for name, _, spec in iter_norm_layers(pl_module)
                if spec.unsupported is None and name not in self._layers and not self._left_alone(name)]
        if late:
            raise MisconfigurationException(
                f"NormSwap: norm layers {late[:5]}{'...' if len(late) > 5 else ''} appeared after the swap, "
                "probably built in LightningModule.setup, which Lightning runs after the callbacks' setup. "
                "Build the model in __init__ or in configure_model (which NormSwap calls first), or call "
                "lightning_mrs.swap_norms(...) yourself at the end of setup and drop NormSwap."
            )
        owned = {id(p) for opt in trainer.optimizers for group in opt.param_groups for p in group["params"]}
        modules = dict(pl_module.named_modules())
        orphans = [name for name in self._layers
                   if any(p.requires_grad and id(p) not in owned for p in modules[name].parameters())]
        if trainer.optimizers and orphans:
            rank_zero_warn(
                f"NormSwap: the swapped layers {orphans[:5]} have trainable weights that no optimizer holds. "
                "Create the optimizer in configure_optimizers from self.parameters() so it sees the new weights."
            )

    def _left_alone(self, name: str) -> bool:
        """A norm the swap saw and kept (skipped, excluded, of another kind)."""
        report = self.report
        return report is not None and (name in report.skipped or name in report.unchanged)

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._remove_hook()

    def _remove_hook(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    # ------------------------------------------------------------------ checkpoints
    def _check_weights(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """Before Lightning loads a checkpoint's weights: the swapped layers' keys and shapes
        must be those this run built, or the load would fail with bare size-mismatch errors."""
        own = module.state_dict()
        modules = dict(module.named_modules())
        bad = []
        for name in self._layers:
            here = {k: tuple(v.shape) for k, v in own.items() if k.startswith(f"{name}.")}
            theirs = {k: tuple(v.shape) for k, v in state_dict.items() if k.startswith(f"{prefix}{name}.")}
            theirs = {k[len(prefix):]: v for k, v in theirs.items()}
            if here != theirs:
                bad.append(f"{name}: the checkpoint holds {_keys(theirs, name)}, this run built "
                           f"{type(modules[name]).__name__} with {_keys(here, name)}")
        if bad:
            raise MisconfigurationException(
                f"NormSwap({self.options.describe()}): the checkpoint's norm layers differ from the ones this run "
                "built:\n  " + "\n  ".join(bad[:5]) + ("\n  ..." if len(bad) > 5 else "")
                + "\nResume with the NormSwap options of the run that wrote the checkpoint (or without NormSwap if "
                "it had none); for inference, NormSwap.restore(model, path) rebuilds what the checkpoint records."
            )

    @override
    def state_dict(self) -> dict[str, Any]:
        if self.report is None:
            return {}
        return {
            "version": _SPEC_VERSION,
            "lightning_mrs": lightning_mrs.__version__,
            "target": self.options.target,
            "layers": self._layers,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict or self.report is None:
            return
        if "layers" in state_dict:
            saved = _records(state_dict)
            same = saved == self._layers
        else:  # version 1 (lightning-mrs 0.1) recorded the converted names only
            saved = {name: None for name in state_dict.get("converted", ())}
            same = set(saved) <= set(self._layers)
        if not same or state_dict.get("target") != self.options.target:
            raise MisconfigurationException(
                f"NormSwap: the checkpoint was trained with target={state_dict.get('target')!r} norms that differ "
                f"from what NormSwap({self.options.describe()}) built in this run (checkpoint vs this run):\n  "
                + "\n  ".join(differences(saved, self._layers))
                + "\nResume with the checkpoint's options, or load it for inference with NormSwap.restore(model, path)."
            )

    @staticmethod
    def restore(
        model: nn.Module, checkpoint_path: Union[str, os.PathLike], map_location: Any = "cpu", strict: bool = True
    ) -> nn.Module:
        """Rebuild a checkpoint's recorded swap on a fresh ``model`` and load its weights.

        Args:
            model: a freshly built model of the class that was trained (a LightningModule,
                or a plain module whose ``state_dict`` keys match the checkpoint's). Its
                ``configure_model`` hook, if any, is called first.
            checkpoint_path: a Lightning checkpoint written with ``NormSwap`` in the callbacks.
            map_location: passed to ``torch.load``.
            strict: passed to ``load_state_dict``.

        Returns:
            ``model``, swapped exactly like the trained one and holding its weights.

        Raises:
            ValueError: the checkpoint has no NormSwap record, or ``model`` cannot be made to
                match it (another architecture).

        Example:
            >>> model = NormSwap.restore(LitResNet(), "epoch=9.ckpt").eval()  # doctest: +SKIP
        """
        checkpoint = torch.load(checkpoint_path, map_location=map_location, weights_only=False)
        spec = _find_spec(checkpoint)
        if spec is None:
            raise ValueError(
                f"NormSwap.restore: {checkpoint_path} holds no NormSwap record (was it saved with "
                "weights_only=True, or without the NormSwap callback?). Call lightning_mrs.swap_norms(model, "
                "...) with the training options yourself, then model.load_state_dict(...)."
            )
        configure_model = getattr(model, "configure_model", None)
        if callable(configure_model):
            configure_model()  # models built there (Lightning asks for it to be idempotent)
        if "layers" in spec:
            try:
                rebuild(model, spec["target"], _records(spec))
            except ValueError as err:
                raise ValueError(f"NormSwap.restore({checkpoint_path}): {err}") from None
        elif spec["converted"]:  # version 1 (lightning-mrs 0.1): the options and the converted names
            swap_norms(model, spec["target"], spatial=spec["spatial"], eps=spec["eps"], include=spec["converted"],
                       init="ones")
        model.load_state_dict(checkpoint.get("state_dict", checkpoint), strict=strict)
        return model


def _refuse_unsupported(trainer: "pl.Trainer") -> None:
    strategy = trainer.strategy
    if isinstance(strategy, (FSDPStrategy, DeepSpeedStrategy, ModelParallelStrategy)):
        raise MisconfigurationException(
            f"NormSwap does not support {type(strategy).__name__}: it shards or wraps parameters, so norm layers "
            "cannot be replaced module by module once the strategy owns them. Swap before the Trainer instead: call "
            "`lightning_mrs.swap_norms(self.<backbone>)` at the end of your LightningModule's __init__ (or inside "
            "configure_model, before any wrapping) and remove NormSwap from the callbacks. Supported strategies: "
            "single device and DDP (strategy='ddp')."
        )
    if isinstance(strategy.launcher, _MultiProcessingLauncher):
        raise MisconfigurationException(
            f"NormSwap does not support the {type(strategy.launcher).__name__} (strategy='ddp_spawn', "
            "'ddp_fork' or 'ddp_notebook'): its worker processes swap their own copies of the model, and Lightning "
            "then copies their weights back into the main process's model, which was never swapped. Use "
            "strategy='ddp' (one script process per device), or, where only a fork works (notebooks), call "
            "`lightning_mrs.swap_norms(self.<backbone>)` at the end of your LightningModule's __init__ and remove "
            "NormSwap from the callbacks."
        )


def _keys(shapes: dict[str, tuple[int, ...]], name: str) -> str:
    if not shapes:
        return "no weights"
    return "[" + ", ".join(f"{k[len(name) + 1:]} {tuple(v)}" for k, v in sorted(shapes.items())) + "]"


def _records(spec: dict[str, Any]) -> dict[str, LayerRecord]:
    return {name: dict(record) for name, record in (spec.get("layers") or {}).items()}


def _find_spec(checkpoint: dict[str, Any]) -> Optional[dict[str, Any]]:
    for key, state in (checkpoint.get("callbacks") or {}).items():
        if str(key).startswith("NormSwap") and isinstance(state, dict) and ("layers" in state or "converted" in state):
            return state
    return None
