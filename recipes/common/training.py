"""What the LightningCLI recipes share: the one-line-error parser, building a CLI, running it
with user mistakes as one ``error:`` line, the precision rules, and the last-step validation.

``recipes/cifar100.py`` (images) and ``recipes/lm.py`` (text) are each one LightningModule, one
data module and a LightningCLI subclass; everything else they have in common lives here.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional, Sequence, TypeVar

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback, TQDMProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_mrs.swap import SwapReport, iter_attention_layers
from recipes.common.errors import UsageError, report

__all__ = ["QK_NORM_CHOICES", "DtypeWatch", "OneLineParser", "StepProgressBar", "ValidateAtEnd", "build_quietly",
           "check_model_options", "check_nodes", "check_qk_norms", "cpu_fp16", "default_precision", "moved_class_path",
           "run_main"]

CLI = TypeVar("CLI", bound=LightningCLI)

#: ``--model.qk_norm`` of both recipes: the QK-norm to add (or swap to) in every attention layer.
QK_NORM_CHOICES = ("none", "mrs", "rms", "layer")


class OneLineParser(LightningArgumentParser):
    """The recipe's parser: a parsing mistake is one ``error: ...`` line and exit 2, not the usage."""

    @override
    def error(self, message: str, ex: Optional[Exception] = None) -> NoReturn:
        if not self.exit_on_error:  # jsonargparse's nested parsers report to their parent
            super().error(message, ex)
        raise UsageError(moved_class_path(message) or f"{message} (options: --help)")


def _imports(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing too
        return False


def moved_class_path(message: str) -> Optional[str]:
    """One line naming where a ``class_path: recipes.<module>.<Class>`` that no longer imports lives now.

    A run's ``config.yaml`` written before ``recipes/`` was regrouped (issue 47) names e.g.
    ``recipes.hparams.StepCSVLogger``; the class is looked up by name in the recipes' sources.
    """
    match = re.search(r"class_path '(recipes(?:\.\w+)*)\.(\w+)'", message)
    if match is None or _imports(match[1]):
        return None
    root = Path(__file__).resolve().parents[1]  # recipes/
    pattern = re.compile(rf"^class {match[2]}\b", re.MULTILINE)
    found = [path for path in sorted(root.rglob("*.py")) if pattern.search(path.read_text(encoding="utf-8"))]
    if not found:
        return None
    module = ".".join(found[0].relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
    return (f"class_path '{match[1]}.{match[2]}' names a module that recipes/ no longer has: {match[2]} is now "
            f"{module}.{match[2]} (replace the old name, e.g. in the run's config.yaml)")


class StepProgressBar(TQDMProgressBar):
    """The training bar of a run whose length is ``max_steps``: ``train: 86/400`` optimizer steps.

    Lightning's bars count the batches of an epoch, and an endless stream has one epoch of unknown
    length (``Epoch 0/-2``, ``86/?``); this one counts the run's steps, from the resumed step on.
    """

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        bar = self.train_progress_bar
        bar.reset(total=trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None)
        bar.n = trainer.global_step
        bar.set_description("train")

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        bar = self.train_progress_bar
        step = trainer.global_step
        if bar is None or bar.disable or step == bar.n:
            return
        if step % max(self.refresh_rate, 1) == 0 or step == bar.total:
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # and redraws


class ValidateAtEnd(Callback):
    """Stop (and so validate and checkpoint) on the last step when ``max_steps`` ends a run mid-epoch.

    Without it a run cut short by ``--trainer.max_steps`` inside the first epoch never validates,
    so it has no top-1 and no best checkpoint. Lightning validates when ``should_stop`` is set.
    """

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.max_steps is not None and 0 < trainer.max_steps <= trainer.global_step:
            trainer.should_stop = True


def default_precision(accelerator: Any) -> str:
    """``bf16-mixed`` on a GPU with bf16, ``16-mixed`` on other GPUs, ``32-true`` elsewhere."""
    name = accelerator if isinstance(accelerator, str) else type(accelerator).__name__.lower()
    if name in ("auto", "gpu", "cuda") or "cuda" in name:
        if torch.cuda.is_available():
            return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    return "32-true"


def cpu_fp16(precision: Any, accelerator: Any) -> Optional[Any]:
    """For ``precision="16-mixed"`` on the CPU, the plugin of real float16 autocast with a loss scaler
    (``MixedPrecision("16-mixed", "cpu", scaler=GradScaler("cpu"))``); ``None`` otherwise.

    Lightning alone runs ``16-mixed`` on the CPU as bfloat16 (with a warning); a user who asked for
    16 gets float16, the precision whose overflows the scaler and the monitors are there to show.
    """
    name = accelerator if isinstance(accelerator, str) else type(accelerator).__name__.lower()
    on_cpu = name == "cpu" or "cpuaccelerator" in name or (name == "auto" and not torch.cuda.is_available())
    if str(precision) not in ("16-mixed", "16") or not on_cpu:
        return None
    from lightning.pytorch.plugins import MixedPrecision

    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))


def usable_cpus() -> int:
    """The CPU cores this process may run on (its affinity, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def on_cpu(accelerator: Any) -> bool:
    """Whether ``--trainer.accelerator`` (a name or an accelerator object) runs on the CPU here."""
    name = accelerator if isinstance(accelerator, str) else type(accelerator).__name__.lower()
    return name == "cpu" or "cpuaccelerator" in name or (name == "auto" and not torch.cuda.is_available())


def note_processes(given: Any) -> None:
    """One notice when ``--trainer.devices`` starts more CPU processes than there are cores
    (``given``: the ``trainer`` options as given); the run goes on.

    Example:
        >>> note_processes({"accelerator": "cpu", "devices": 1})  # never more than the cores: silent
    """
    devices = given.get("devices")
    if isinstance(devices, str) and devices.isdigit():
        devices = int(devices)
    cores = usable_cpus()
    if on_cpu(given.get("accelerator", "auto")) and isinstance(devices, int) and devices > cores:
        rank_zero_info(f"note: --trainer.devices {devices} on the CPU starts {devices} processes on {cores} cores: "
                       "they share the cores, so each step takes longer than with fewer processes (the global "
                       "batch stays per-device batch x processes).")


def check_nodes(num_nodes: Any, plugins: Any = None) -> None:
    """A usage error when ``--trainer.num_nodes`` is above 1 but nothing started this process as one of the
    nodes: no launcher Lightning detects (torchrun, SLURM's ``srun``, LSF, MPI, in Lightning's order) and no
    ``NODE_RANK`` of its own variables. Lightning would wait for the other nodes forever (Ctrl-C included);
    ``plugins`` given may hold the user's own cluster environment, so they skip the check.

    Example:
        >>> check_nodes(1)  # one node: nothing to start
    """
    if not isinstance(num_nodes, int) or num_nodes <= 1 or plugins:
        return
    from lightning.fabric.plugins.environments import (LSFEnvironment, MPIEnvironment, SLURMEnvironment,
                                                       TorchElasticEnvironment)

    if any(env.detect() for env in (TorchElasticEnvironment, SLURMEnvironment, LSFEnvironment, MPIEnvironment)):
        return
    if "NODE_RANK" in os.environ or "GROUP_RANK" in os.environ:  # LightningEnvironment's node rank
        return
    raise UsageError(f"--trainer.num_nodes {num_nodes}: nothing started this process as one of {num_nodes} nodes, so "
                     "it would wait for the others forever; run the command on each node under torchrun "
                     f"(--nnodes {num_nodes} --node_rank R --master_addr HOST ...), srun (SLURM), or with MASTER_ADDR, "
                     "MASTER_PORT and NODE_RANK set (docs/recipes.md#several-machines).")


def check_model_options(*, norm: str, norms: Sequence[str], qk_norm: str, schedule: str, warmup_frac: float,
                        mrs_backend: str) -> None:
    """The ``--model.*`` checks both recipes' LightningModules make, as one-line usage errors."""
    from lightning_mrs.ops import BACKENDS

    if norm not in norms:
        raise UsageError(f"--model.norm {norm!r} is not valid; choose one of {list(norms)}.")
    if qk_norm not in QK_NORM_CHOICES:
        raise UsageError(f"--model.qk_norm {qk_norm!r} is not valid; choose one of {list(QK_NORM_CHOICES)}.")
    if schedule not in ("cosine", "constant"):
        raise UsageError(f"--model.schedule {schedule!r} is not valid; choose one of ['cosine', 'constant'].")
    if not 0.0 <= warmup_frac < 1.0:
        raise UsageError(f"--model.warmup_frac must lie in [0, 1), got {warmup_frac}.")
    if mrs_backend not in BACKENDS:
        raise UsageError(f"--model.mrs_backend {mrs_backend!r} is not valid; choose one of {list(BACKENDS)}.")


def check_qk_norms(model: torch.nn.Module, kind: str, swap_report: SwapReport, arch: str) -> None:
    """Every attention layer of ``model`` must have a QK-norm of ``kind`` after the swap, or a usage error."""
    layers = list(iter_attention_layers(model))
    if not layers:
        raise UsageError(f"--model.qk_norm {kind}: {arch!r} has no attention layer a QK-norm can be added to; "
                         "use a transformer (e.g. timm:vit_tiny_patch16_224) or --model.qk_norm none.")
    missing = [name for name, _, info in layers if info.qk_norm != kind]
    if missing:
        why = swap_report.attention_skipped.get(missing[0], "its QK-norm is of another kind")
        raise UsageError(f"--model.qk_norm {kind}: no {kind} QK-norm in {len(missing)} of {len(layers)} attention "
                         f"layers of {arch!r} (e.g. {missing[0]}: {why}).")


def build_quietly(cli_class: Callable[..., CLI], *args: Any, **kwargs: Any) -> CLI:
    """``cli_class(*args, parser_class=OneLineParser, run=False, **kwargs)``, saying "Seed set to"
    only once the configuration is valid (a mistake is then the only line printed)."""
    seed_log = logging.getLogger("lightning.fabric.utilities.seed")
    level = seed_log.level
    seed_log.setLevel(logging.WARNING)
    try:
        cli = cli_class(*args, parser_class=OneLineParser, run=False, **kwargs)
    finally:
        seed_log.setLevel(level)
    rank_zero_info(f"Seed set to {cli.config.seed_everything}")
    return cli


def run_main(main: Callable[[Optional[list[str]]], None], args: Optional[list[str]] = None) -> int:
    """``main(args)`` with user errors (:class:`recipes.common.errors.UsageError`, and Lightning's for a bad
    ``--trainer.*`` value) as one stderr line and exit status 2; 0 otherwise."""
    try:
        main(args)
    except (UsageError, MisconfigurationException) as err:
        return report(err)
    return 0


class DtypeWatch:
    """The dtype of the first matmul output (``nn.Linear``, GPT-2's ``Conv1D``) inside a block: what the
    activations ran in under the run's precision setting, recorded by a forward hook.

    The hook never removes itself: a compiled block (``--model.compile``) cannot trace a handle's
    removal and would fall back to eager code; :meth:`close` removes it once the dtype is known.
    """

    def __init__(self) -> None:
        self.dtype: Optional[torch.dtype] = None
        self._handle: Optional[Any] = None

    def watch(self, block: torch.nn.Module) -> None:
        """Hook the first 2-d weight of ``block`` that is not an embedding (nothing if none, or already seen)."""
        first = next((m for m in block.modules() if getattr(m, "weight", None) is not None and m.weight.dim() == 2
                      and not isinstance(m, torch.nn.Embedding)), None)
        if first is not None and self.dtype is None and self._handle is None:
            self._handle = first.register_forward_hook(self._record)

    def _record(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            self.dtype = output.dtype

    def close(self) -> None:
        """Remove the hook (the dtype stays)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
