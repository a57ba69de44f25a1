"""``NormSwap``: swap every norm layer of the model for MRSNorm before training starts.

A thin Lightning wrapper around :func:`lightning_mrs.swap_norms`. The swap happens in the
callback's ``setup``, before ``configure_optimizers``, so the optimizer owns the new weights;
a model built in ``configure_model`` is built first by calling that hook (in the contexts
Lightning uses for it), as Lightning's own ``WeightAveraging`` does (Lightning asks the hook
to be idempotent). Nothing of the LightningModule is rebound: the checkpoint check is a torch
load-state-dict pre-hook on the module, removed when the stage starts.

What the swap built (every norm layer of the target's kind, see
:func:`lightning_mrs.swap.spec.describe_layers`) is the callback's state, and the module's
``state_dict`` carries it too (its metadata, :mod:`lightning_mrs.callbacks.swap_record`), so it
is in every checkpoint, weights-only ones included; resuming or predicting from a checkpoint
compares what this run built with it, and :meth:`NormSwap.restore` (or
:class:`~lightning_mrs.callbacks.NormSwapMixin` for ``load_from_checkpoint``) rebuilds a fresh
model for inference.

Strategies: ``strategy="ddp"`` (one script process per device) works, and so does FSDP2,
Lightning's ``ModelParallelStrategy``: its ``configure_model`` is where the user parallelises
(``fully_shard``), so under it NormSwap does not call that hook but swaps the model as
``__init__`` built it, unsharded, in ``setup``; Lightning then calls ``configure_model``, which
shards the swapped model. Its checkpoints (a directory of shards, or one file) resume, and
:meth:`NormSwap.restore` reads both. ``FSDPStrategy`` and DeepSpeed are refused (both need a GPU
in Lightning; they wrap the model themselves). The multiprocessing
launcher (``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``) is refused: its workers would swap
their copies of the model, but when training ends Lightning loads rank 0's weights into the
main process's model, and no callback hook runs in the main process to swap that one.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Optional, Union

import lightning.pytorch as pl
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

import lightning_mrs
from lightning_mrs.callbacks.checkpoint_file import read_metadata
from lightning_mrs.callbacks.norm_swap_strategies import refuse_parallelised, refuse_unsupported
from lightning_mrs.callbacks.swap_record import (
    align_compiled_keys, canonical, find_record, install_record, local_record, options_of, records,
)
from lightning_mrs.callbacks.swap_restore import restore
from lightning_mrs.swap import SwapOptions, SwapReport, iter_norm_layers, swap_norms
from lightning_mrs.swap.options import check_bool
from lightning_mrs.swap.spec import LayerRecord, describe_layers, differences, format_record, is_qk_name

__all__ = ["NormSwap"]

_SPEC_VERSION = 2
_SHOWN = 5  # layers listed in an error message


class NormSwap(Callback):
    """Replace the model's norm layers with MRSNorm (or the RMSNorm/LayerNorm baselines).

    Supported: a single device, ``strategy="ddp"`` and FSDP2 (``ModelParallelStrategy``, the
    model built in ``__init__`` and sharded in ``configure_model``: the swap happens before).
    Refused before training, with the reason: ``FSDPStrategy`` and DeepSpeed (they wrap the
    parameters; use ``ModelParallelStrategy``) and ``ddp_spawn``/``ddp_fork``/``ddp_notebook``
    (the trained weights come back into a model no callback can swap). Without
    ``ModelParallelStrategy`` the model may be built in ``__init__`` or ``configure_model``;
    one built in ``LightningModule.setup`` is refused (Lightning runs it after the swap).

    Args:
        target: ``"mrs"``, ``"rms"`` or ``"layer"``, or a whole
            :class:`lightning_mrs.SwapOptions`.
        verbose: log the swap summary (rank zero only).
        **options: the other fields of :class:`lightning_mrs.SwapOptions` (``spatial``,
            ``include``, ``exclude``, ``init``, ``eps``, ``strict``).

    Raises:
        ValueError: an option with a bad value (the message lists the valid ones).
        TypeError: an unknown option (the message lists the valid ones and suggests the
            closest), or an option of the wrong type (``verbose``, ``strict``, ``include``/``exclude``).

    Example:
        >>> import lightning.pytorch as pl
        >>> trainer = pl.Trainer(callbacks=[NormSwap("mrs", exclude="head")])  # doctest: +SKIP
        >>> trainer.fit(model)  # doctest: +SKIP
        >>> trainer.fit(MyModel(), ckpt_path="last.ckpt")  # resume: same NormSwap  # doctest: +SKIP
        >>> model = NormSwap.restore(MyModel(), "last.ckpt")  # inference  # doctest: +SKIP
    """

    def __init__(self, target: Union[str, SwapOptions] = "mrs", *, verbose: bool = True, **options: Any) -> None:
        check_bool("NormSwap", "verbose", verbose)
        self.options = SwapOptions.of(target, "NormSwap", **options)
        if self.options.init == "calibrate":
            raise ValueError("NormSwap: init='calibrate' needs calibration data, which a callback does not have at setup; "
                             "call lightning_mrs.swap_norms(model, ..., init='calibrate', calibration=batch) in your "
                             "LightningModule's __init__ and drop the callback, or use init='inherit'.")
        self.verbose = verbose
        self.report: Optional[SwapReport] = None
        self._layers: dict[str, LayerRecord] = {}  # what the swap built: the checkpoint record
        self._present: set[str] = set()
        self._handle: Optional[RemovableHandle] = None
        self._unchecked = False  # a setup whose late-built layers are still to be looked for
        self._parallel = False  # ModelParallelStrategy: swapped before configure_model
        self._fitting = True  # the stage of the last setup: what a refusal advises
        self._unrecorded = False  # weights loaded without a record: warned at the stage's start

    # ------------------------------------------------------------------ swapping
    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        refuse_unsupported(trainer)
        self._parallel = isinstance(trainer.strategy, ModelParallelStrategy)
        self._fitting = str(getattr(stage, "value", stage)) == "fit"
        self._unrecorded = False
        if self._parallel:
            refuse_parallelised(pl_module)  # configure_model (Lightning's call, next) shards what is swapped here
        elif is_overridden("configure_model", pl_module):
            # build the layers now, where Lightning would; its own call is then a no-op
            with trainer.strategy.tensor_init_context(), trainer.strategy.model_sharded_context(), \
                    trainer.precision_plugin.module_init_context():
                pl_module.configure_model()
        report = swap_norms(pl_module, self.options)
        self.report = report if self.report is None else self.report.merge(report)
        self._layers = describe_layers(pl_module, self.options.target)
        self._present = {name for name, _, _ in iter_norm_layers(pl_module)}  # every norm the swap saw or built
        self._unchecked = True
        install_record(pl_module, self.state_dict())  # weights-only checkpoints carry it in the state_dict
        if self.verbose:
            when = f"NormSwap (setup, stage={getattr(stage, 'value', stage)})"
            if report.converted or report.qk_added or report.attention_replaced:
                rank_zero_info(f"{when}: {report}")
            elif self._layers:
                count = f"{len(self._layers)} {self.options.target}"
                rank_zero_info(f"{when}: the model's {count} norms were swapped already")
        self._remove_hook()
        self._handle = pl_module.register_load_state_dict_pre_hook(functools.partial(self._check_weights, trainer))

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._stage_started(trainer, pl_module)
        owned = {id(p) for opt in trainer.optimizers for group in opt.param_groups for p in group["params"]}
        modules = dict(pl_module.named_modules())
        orphans = [name for name in self._layers if name in modules
                   and any(p.requires_grad and id(p) not in owned for p in modules[name].parameters())]
        if trainer.optimizers and orphans:
            rank_zero_warn(
                f"NormSwap: the swapped layers {orphans[:_SHOWN]} have trainable weights that no optimizer holds. "
                "Create the optimizer in configure_optimizers from self.parameters() so it sees the new weights."
            )

    @override
    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._stage_started(trainer, pl_module)

    @override
    def on_test_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._stage_started(trainer, pl_module)

    @override
    def on_predict_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._stage_started(trainer, pl_module)

    def _stage_started(self, trainer: "pl.Trainer", pl_module: nn.Module) -> None:
        """Checkpoint weights are loaded by now: drop the check, and look once per setup for
        norm layers built after the swap."""
        self._remove_hook()
        self._warn_unrecorded(trainer)
        if self._unchecked:
            self._unchecked = False
            self._refuse_late_layers(pl_module)

    def _refuse_late_layers(self, pl_module: nn.Module) -> None:
        late = [name for name, _, spec in iter_norm_layers(pl_module)
                if spec.unsupported is None and name not in self._present]
        if late and self._parallel:
            raise MisconfigurationException(
                f"NormSwap: norm layers {late[:_SHOWN]}{'...' if len(late) > _SHOWN else ''} appeared after the swap. "
                "Under ModelParallelStrategy NormSwap swaps in setup, before Lightning calls configure_model (where "
                "the model is parallelised), so the model must be built in __init__ and only sharded in "
                "configure_model. Or call lightning_mrs.swap_norms(...) in configure_model before fully_shard and "
                "drop NormSwap."
            )
        if late:
            raise MisconfigurationException(
                f"NormSwap: norm layers {late[:_SHOWN]}{'...' if len(late) > _SHOWN else ''} appeared after the swap, "
                "probably built in LightningModule.setup, which Lightning runs after the callbacks' setup. "
                "Build the model in __init__ or in configure_model (which NormSwap calls first), or call "
                "lightning_mrs.swap_norms(...) yourself at the end of setup and drop NormSwap."
            )

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._remove_hook()

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._remove_hook()  # the hook holds the trainer; the module must not keep it

    def _remove_hook(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    # ------------------------------------------------------------------ checkpoints
    def _check_weights(
        self, trainer: "pl.Trainer", module: nn.Module, state_dict: dict[str, Any], prefix: str,
        local_metadata: Any, strict: bool, *args: Any,
    ) -> None:
        """Before Lightning loads a checkpoint's weights: every norm layer's keys and shapes
        must be the checkpoint's, or the load would fail with bare size-mismatch errors; and the
        layers the weights' metadata records must be this run's (same shapes, other computation:
        ``spatial``, ``eps``). Weights saved from a compiled submodule (``_orig_mod.`` in their
        names) are renamed to this model's names, and the other way round."""
        self._refuse_late_layers(module)
        own = module.state_dict()
        align_compiled_keys(state_dict, own.keys(), prefix)
        bad: dict[str, tuple[str, str]] = {}
        # every norm here, and every QK-norm the checkpoint has (this run may not have added it)
        names = [name for name, _, _ in iter_norm_layers(module)]
        owners = {k[len(prefix):].rsplit(".", 1)[0] for k in state_dict if k.startswith(prefix)}  # module names
        names += sorted({name for name in owners if is_qk_name(name)} - set(names))
        modules = dict(module.named_modules())
        for name in names:
            layer = modules.get(name)
            here = _shapes(own, f"{name}.")
            theirs = _shapes(state_dict, f"{prefix}{name}.", strip=len(prefix))
            if not strict:  # a partial load skips missing and unexpected keys; shapes still must fit
                common = here.keys() & theirs.keys()
                here = {k: v for k, v in here.items() if k in common}
                theirs = {k: v for k, v in theirs.items() if k in common}
            if here != theirs:
                what = type(layer).__name__ if layer is not None else "no such module"
                bad[name] = (_keys(theirs, name), f"{_keys(here, name)} ({what})")
        recorded = local_record(local_metadata)
        if not bad:
            if recorded is not None and "layers" in recorded:
                self._refuse_other_layers(recorded, strict)
            # the callback's state may still hold one (a full checkpoint of lightning-mrs 0.2): on_load_checkpoint
            self._unrecorded = recorded is None and bool(self._layers)
            return
        spec = recorded or _checkpoint_spec(trainer)
        saved = records(spec) if spec is not None and "layers" in spec else None
        lines = []
        for name, (theirs, here) in bad.items():
            ckpt = theirs if saved is None else f"{format_record(saved.get(canonical(name)))} {theirs}"
            lines.append(f"{name}: checkpoint {ckpt}, this run {format_record(self._layers.get(name))} {here}")
        raise MisconfigurationException(self._refusal(spec, lines))

    def _refuse_other_layers(self, spec: dict[str, Any], strict: bool = True) -> None:
        """Refuse a checkpoint whose recorded layers are not the ones this run built (a partial,
        non-strict load: those both have)."""
        saved = records(spec)
        built = {canonical(name): record for name, record in self._layers.items()}
        if not strict:
            saved = {k: v for k, v in saved.items() if k in built}
            built = {k: v for k, v in built.items() if k in saved}
        if saved != built:
            raise MisconfigurationException(
                self._refusal(spec, differences(saved, built, limit=len(saved) + len(built))))

    def _refusal(self, spec: Optional[dict[str, Any]], lines: list[str]) -> str:
        """The one message of every layer mismatch, in fit (resume) and in validate/test/predict."""
        if spec is None and self._fitting:
            advice = ("The checkpoint has no NormSwap record: it was trained without NormSwap. Resume it without "
                      "NormSwap; to fine-tune its weights with MRSNorm, load them into the model before fit (e.g. in "
                      "__init__) instead of passing ckpt_path, and NormSwap swaps them with init='inherit'.")
        elif spec is None:
            advice = "The checkpoint has no NormSwap record: it was trained without NormSwap. Run it without NormSwap."
        else:
            then = "resume with those options" if self._fitting else "pass NormSwap with those options to this Trainer"
            advice = (f"The checkpoint was written with NormSwap({options_of(spec)}): {then}. "
                      "For inference, NormSwap.restore(model, path) rebuilds what the checkpoint records.")
        shown = lines[:_SHOWN] + ([f"... and {len(lines) - _SHOWN} more"] if len(lines) > _SHOWN else [])
        return (
            f"NormSwap({self.options.describe()}): the checkpoint's norm layers differ from the ones this run built, "
            "so its weights cannot be loaded:\n  " + "\n  ".join(shown) + f"\n{advice}"
        )

    @override
    def on_load_checkpoint(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", checkpoint: dict[str, Any]
    ) -> None:
        # a full checkpoint (Lightning calls this only when it has callback states): its record is checked
        # in load_state_dict
        if find_record(checkpoint) is not None:
            self._unrecorded = False

    def _warn_unrecorded(self, trainer: "pl.Trainer") -> None:
        """After the weights loaded (their names and shapes checked): warn when nothing recorded
        the layers they were trained in."""
        if self._unrecorded:
            self._unrecorded = False
            rank_zero_warn(
                f"NormSwap({self.options.describe()}): the checkpoint {trainer.ckpt_path} has no NormSwap record "
                "(trained without NormSwap, or saved with weights_only=True by lightning-mrs 0.2 or older), so only "
                "its weights' names and shapes could be checked, not the swapped layers' kind, layout (per sample "
                "or per position) or eps: if it was trained with other NormSwap options, this run computes "
                "something else with the same weights. Pass the NormSwap options it was trained with."
            )

    @override
    def state_dict(self) -> dict[str, Any]:
        if self.report is None:
            return {}
        return {
            "version": _SPEC_VERSION,
            "lightning_mrs": lightning_mrs.__version__,
            "target": self.options.target,
            "options": self.options.describe(),  # for messages only: the layers are the record
            "layers": self._layers,
            # restore() must not call configure_model: under ModelParallelStrategy it parallelises
            "before_configure_model": self._parallel,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict or self.report is None:
            return
        if "layers" in state_dict:
            self._refuse_other_layers(state_dict)
            return
        # version 1 (lightning-mrs 0.1): the options and the names the swap converted
        opts = self.options
        converted = list(state_dict.get("converted") or ())
        same = (state_dict.get("target"), state_dict.get("spatial", "auto"), state_dict.get("eps")) == (
            opts.target, opts.spatial, opts.eps)
        missing = [name for name in converted if name not in self._layers]
        if not same or missing:
            lines = [] if same else [f"checkpoint NormSwap({options_of(state_dict)}), this run "
                                     f"NormSwap({opts.describe()})"]
            lines += [f"{name}: checkpoint converted it, this run did not" for name in missing]
            raise MisconfigurationException(self._refusal(state_dict, lines))

    @staticmethod
    def restore(
        model: nn.Module, checkpoint_path: Union[str, os.PathLike], map_location: Any = "cpu", strict: bool = True,
        weights_only: bool = True,
    ) -> nn.Module:
        """Rebuild a checkpoint's recorded swap on a fresh ``model`` and load its weights.

        Args:
            model: a freshly built model of the class that was trained (a LightningModule,
                or a plain module whose ``state_dict`` keys match the checkpoint's). Its
                ``configure_model`` hook, if any, is called first, except for a model trained
                under ``ModelParallelStrategy`` (there that hook shards: the model is used unsharded).
                Compiled or not: weights saved from a compiled submodule (``_orig_mod.`` in their
                names) load into the uncompiled one, and the other way round.
            checkpoint_path: a Lightning checkpoint written with ``NormSwap`` in the callbacks
                (by lightning-mrs 0.2, or 0.1; a weights-only one from 0.3 on): a file, or the
                directory of shards that ``ModelParallelStrategy`` writes (read in this one process).
            map_location: passed to ``torch.load``.
            strict: passed to ``load_state_dict``.
            weights_only: passed to ``torch.load``. ``True`` reads tensors and plain data only, so a
                file cannot run code while it is read; a file that holds other objects is refused,
                naming them. Pass ``False`` only for a file from a source you trust.

        Returns:
            ``model``, swapped exactly like the trained one and holding its weights.

        Raises:
            FileNotFoundError: no file at ``checkpoint_path``.
            ValueError: the file is not a readable checkpoint (truncated, another kind of
                file), it holds objects a ``weights_only=True`` load refuses, it has no NormSwap
                record, or ``model`` cannot be made to match it (another architecture), listing
                the layers concerned.
            TypeError: ``model`` is not an ``nn.Module``, or ``strict``/``weights_only`` is not a bool.

        Example:
            >>> model = NormSwap.restore(LitResNet(), "epoch=9.ckpt").eval()  # doctest: +SKIP
        """
        return restore(model, checkpoint_path, map_location, strict, weights_only)


def _shapes(state: dict[str, Any], prefix: str, strip: int = 0) -> dict[str, tuple[int, ...]]:
    """The shapes of ``state``'s entries under ``prefix``, keyed without the first ``strip`` characters."""
    return {k[strip:]: tuple(v.shape) for k, v in state.items() if k.startswith(prefix) and hasattr(v, "shape")}


def _keys(shapes: dict[str, tuple[int, ...]], name: str) -> str:
    if not shapes:
        return "[no weights]"
    return "[" + ", ".join(f"{k[len(name) + 1:]} {tuple(v)}" for k, v in sorted(shapes.items())) + "]"


def _checkpoint_spec(trainer: "pl.Trainer") -> Optional[dict[str, Any]]:
    """The NormSwap record of the checkpoint being resumed, read again for an error message
    (the load-state-dict pre-hook sees the weights only); ``None`` when unreadable."""
    path = trainer.ckpt_path
    if not path:
        return None
    try:
        # weights_only=True: never code from the file; mmap: the record is read, the tensors stay on disk
        return find_record(read_metadata(path, "cpu", mmap=True))
    except Exception:  # noqa: BLE001 - only a better error message is at stake
        return None
