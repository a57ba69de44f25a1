"""``NormSwap``: swap every norm layer of the model for MRSNorm before training starts.

A thin Lightning wrapper around :func:`lightning_mrs.swap_norms`. The swap happens in
``setup`` (before ``configure_optimizers``, so the optimizer owns the new weights) and right
after ``configure_model`` for models built there. The swap spec (options and the converted
layer names) is the callback's state, so it is saved in every checkpoint; resuming with the
same callback works, and :meth:`NormSwap.restore` rebuilds a fresh model for inference.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

import lightning_mrs
from lightning_mrs.norm_registry import iter_norm_layers
from lightning_mrs.swap import Selector, SwapReport, _as_list, _check_options, swap_norms

__all__ = ["NormSwap"]

_SPEC_VERSION = 1
_UNSUPPORTED_STRATEGIES = ("FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy")


class NormSwap(Callback):
    """Replace the model's norm layers with MRSNorm (or the RMSNorm/LayerNorm baselines).

    Args:
        target: ``"mrs"``, ``"rms"`` or ``"layer"``.
        spatial, include, exclude, init, eps, strict: as in :func:`lightning_mrs.swap_norms`.
        verbose: log the swap summary (rank zero only).

    Example:
        >>> import lightning.pytorch as pl
        >>> trainer = pl.Trainer(callbacks=[NormSwap("mrs")], max_steps=10)  # doctest: +SKIP
        >>> trainer.fit(model)  # doctest: +SKIP
        >>> model = NormSwap.restore(MyModel(), "last.ckpt")  # doctest: +SKIP
    """

    def __init__(
        self,
        target: str = "mrs",
        *,
        spatial: Union[str, bool] = "auto",
        include: Selector = None,
        exclude: Selector = None,
        init: str = "inherit",
        eps: Optional[float] = None,
        strict: bool = False,
        verbose: bool = True,
    ) -> None:
        _check_options(target, spatial, init, eps)
        self.options: dict[str, Any] = dict(
            target=target,
            spatial=spatial,
            include=_as_list(include, "include") or None,
            exclude=_as_list(exclude, "exclude") or None,
            init=init,
            eps=eps,
            strict=strict,
        )
        self.verbose = verbose
        self.report: Optional[SwapReport] = None

    # ------------------------------------------------------------------ swapping
    def _swap(self, pl_module: nn.Module, when: str) -> None:
        report = swap_norms(pl_module, **self.options)
        self.report = report if self.report is None else self.report.merge(report)
        if self.verbose and report.converted:
            rank_zero_info(f"NormSwap ({when}): {report}")

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        strategy = type(trainer.strategy)
        names = {k.__name__ for k in strategy.__mro__}
        bad = names.intersection(_UNSUPPORTED_STRATEGIES)
        if bad:
            raise MisconfigurationException(
                f"NormSwap does not support {strategy.__name__}: it shards or wraps parameters, so "
                "norm layers cannot be replaced module by module once the strategy owns them. Swap "
                "before the Trainer instead: call `lightning_mrs.swap_norms(self.<backbone>)` at the end "
                "of your LightningModule's __init__ (or inside configure_model, before any wrapping) and "
                "remove NormSwap from the callbacks. Supported strategies: single device, DDP and its variants."
            )
        self._swap(pl_module, f"setup, stage={getattr(stage, 'value', stage)}")
        # Lightning calls configure_model after every callback's setup (the swap must follow it)
        # and the module's on_load_checkpoint before loading weights (the spec check must
        # precede the load, or a mismatch surfaces as a bare missing-keys error).
        # LightningModule.setup runs after the callbacks' setup too: models built there are caught.
        for hook in ("setup", "configure_model"):
            if is_overridden(hook, pl_module):
                swap = functools.partial(self._swap, pl_module, f"after {hook}")
                self._wrap(pl_module, hook, lambda *_, _swap=swap, **__: _swap(), after=True)
        self._wrap(pl_module, "on_load_checkpoint", lambda checkpoint: self._check_checkpoint(checkpoint), after=False)

    @staticmethod
    def _wrap(pl_module: nn.Module, hook: str, extra: Any, after: bool) -> None:
        if hook in vars(pl_module):
            return  # already wrapped by an earlier setup
        original = getattr(pl_module, hook)

        @functools.wraps(original)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if not after:
                extra(*args, **kwargs)
            result = original(*args, **kwargs)
            if after:
                extra(*args, **kwargs)
            return result

        setattr(pl_module, hook, wrapped)

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._unwrap(pl_module)
        report = self.report or SwapReport(self.options["target"])
        done = set(report.converted) | set(report.skipped) | set(report.unchanged)
        left = [
            name
            for name, _, _ in iter_norm_layers(pl_module)
            if name not in done and not any(name.startswith(f"{c}.") for c in report.converted)
        ]
        if left:
            raise MisconfigurationException(
                f"NormSwap: norm layers {left[:5]}{'...' if len(left) > 5 else ''} appeared after the swap "
                "(built in a hook after setup/configure_model?). Build the model in __init__, setup or "
                "configure_model so NormSwap can swap it before the optimizer is created."
            )
        owned = {id(p) for opt in trainer.optimizers for group in opt.param_groups for p in group["params"]}
        modules = dict(pl_module.named_modules())
        orphans = [
            name
            for name in report.converted
            if name in modules and any(p.requires_grad and id(p) not in owned for p in modules[name].parameters())
        ]
        if trainer.optimizers and orphans:
            rank_zero_warn(
                f"NormSwap: the swapped layers {orphans[:5]} have trainable weights that no optimizer holds. "
                "Create the optimizer in configure_optimizers from self.parameters() so it sees the new weights."
            )

    @staticmethod
    def _unwrap(pl_module: nn.Module) -> None:
        # The hook wrappers have served once the stage starts; drop them so the module pickles.
        for hook in ("setup", "configure_model", "on_load_checkpoint"):
            if hook in vars(pl_module):
                delattr(pl_module, hook)  # back to the class's method

    @override
    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._unwrap(pl_module)

    @override
    def on_test_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._unwrap(pl_module)

    @override
    def on_predict_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._unwrap(pl_module)

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._unwrap(pl_module)

    # ------------------------------------------------------------------ checkpoints
    def spec(self) -> dict[str, Any]:
        """The swap spec saved in checkpoints: options (without include/exclude, replaced by
        the exact converted names) and the converted layer names."""
        report = self.report
        return {
            "version": _SPEC_VERSION,
            "lightning_mrs": lightning_mrs.__version__,
            "target": self.options["target"],
            "spatial": self.options["spatial"],
            "eps": self.options["eps"],
            "converted": list(report.converted) if report else [],
        }

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.spec() if self.report is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict or self.report is None:
            return
        mine = self.spec()
        diff = [k for k in ("target", "spatial", "eps", "converted") if _norm(state_dict.get(k)) != _norm(mine[k])]
        if diff:
            raise MisconfigurationException(
                f"NormSwap: the checkpoint was swapped with NormSwap({_describe(state_dict)}), this run with "
                f"NormSwap({_describe(mine)}) (they differ in {diff}). Resume with the checkpoint's options, "
                "or load it for inference with NormSwap.restore(model, path)."
            )

    def _check_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a checkpoint swapped with other options, before its weights are loaded."""
        saved = _find_spec(checkpoint)
        if saved is not None:
            self.load_state_dict(saved)

    @staticmethod
    def restore(
        model: nn.Module, checkpoint_path: Union[str, os.PathLike], map_location: Any = "cpu", strict: bool = True
    ) -> nn.Module:
        """Re-apply a checkpoint's recorded swap to a fresh ``model`` and load its weights.

        Args:
            model: a freshly built model of the class that was trained (a LightningModule,
                or a plain module whose ``state_dict`` keys match the checkpoint's). Its
                ``configure_model`` hook, if any, is called first.
            checkpoint_path: a Lightning checkpoint written with ``NormSwap`` in the callbacks.
            map_location: passed to ``torch.load``.
            strict: passed to ``load_state_dict``.

        Returns:
            ``model``, swapped exactly like the trained one and holding its weights.

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
        names = list(spec["converted"])
        configure_model = getattr(model, "configure_model", None)
        if callable(configure_model):
            configure_model()  # models built there (Lightning asks for it to be idempotent)
        if names:
            report = swap_norms(model, spec["target"], spatial=spec["spatial"], eps=spec["eps"], include=names, init="ones")
            missing = sorted(set(names) - set(report.converted))
            if missing:
                raise ValueError(
                    f"NormSwap.restore: the checkpoint converted layers this model does not have as norms: "
                    f"{missing[:5]}. Pass a freshly built model of the class that was trained."
                )
        state = checkpoint.get("state_dict", checkpoint)
        model.load_state_dict(state, strict=strict)
        return model


def _norm(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else value


def _describe(spec: dict[str, Any]) -> str:
    return f"target={spec.get('target')!r}, spatial={spec.get('spatial')!r}, eps={spec.get('eps')!r}"


def _find_spec(checkpoint: dict[str, Any]) -> Optional[dict[str, Any]]:
    for key, state in (checkpoint.get("callbacks") or {}).items():
        if str(key).startswith("NormSwap") and isinstance(state, dict) and "converted" in state:
            return state
    return None
