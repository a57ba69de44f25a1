"""The recipes' modules under the names they had before ``recipes/`` was regrouped (issue 47), still importable.

A run's saved ``config.yaml`` names its classes by module path (``class_path: recipes.hparams.StepCSVLogger``),
and users' own code and YAML may too (``recipes.classifier.ImageClassifier.load_from_checkpoint``): an old
name imports the module that now holds it, the same module object, so ``--config <old run>/config.yaml``
and an old import keep working. New code should use the new names (:data:`MOVED`).

Example:
    >>> import recipes  # installs the finder
    >>> from recipes.hparams import StepCSVLogger  # the old name
    >>> StepCSVLogger.__module__
    'recipes.common.hparams'
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Optional, Sequence

__all__ = ["MOVED", "install"]

#: old module name -> the module that holds it now
MOVED: dict[str, str] = {
    "recipes.checkpoints": "recipes.common.checkpoints",
    "recipes.errors": "recipes.common.errors",
    "recipes.hparams": "recipes.common.hparams",
    "recipes.interrupt": "recipes.common.interrupt",
    "recipes.optim": "recipes.common.optim",
    "recipes.training": "recipes.common.training",
    "recipes.classifier": "recipes.vision.classifier",
    "recipes.data": "recipes.vision.data",
    "recipes.datasets": "recipes.vision.datasets",
    "recipes.models": "recipes.vision.models",
    "recipes.synthetic": "recipes.vision.synthetic",
    "recipes.byte_lm": "recipes.text.byte_lm",
    "recipes.causal_lm": "recipes.text.causal_lm",
    "recipes.lm_model": "recipes.text.model",
    "recipes.lm_setup": "recipes.text.configure",
    "recipes.lm_checks": "recipes.text.checks",
    "recipes.pretrained_lm": "recipes.text.pretrained",
    "recipes.text_corpus": "recipes.text.corpus",
    "recipes.text_data": "recipes.text.data",
    "recipes.token_cache": "recipes.text.token_cache",
    "recipes.sweeps.cell": "recipes.sweeps.cells.image",
    "recipes.sweeps.checks": "recipes.sweeps.cells.image_checks",
    "recipes.sweeps.lm_cell": "recipes.sweeps.cells.lm",
    "recipes.sweeps.convert_cell": "recipes.sweeps.cells.convert",
    "recipes.sweeps.half_inputs": "recipes.sweeps.cells.half_inputs",
    "recipes.sweeps.master_weights": "recipes.sweeps.cells.master_weights",
    "recipes.sweeps.mechanism_eval": "recipes.sweeps.cells.mechanism_eval",
    "recipes.sweeps.registry": "recipes.sweeps.kinds",
    "recipes.sweeps.norm": "recipes.sweeps.kinds.norm",
    "recipes.sweeps.qk": "recipes.sweeps.kinds.qk",
    "recipes.sweeps.lm": "recipes.sweeps.kinds.lm",
    "recipes.sweeps.lmqk": "recipes.sweeps.kinds.lm_qk",
    "recipes.sweeps.convert": "recipes.sweeps.kinds.convert",
    "recipes.sweeps.lm_claims": "recipes.sweeps.claims.lm",
    "recipes.sweeps.convert_claims": "recipes.sweeps.claims.convert",
    "recipes.sweeps.mechanism": "recipes.sweeps.claims.mechanism",
    "recipes.resume": "recipes.vision.resume",
}


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module object of its new name (imported once, shared)."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the new module ran when it was imported."""


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Finds the old names of :data:`MOVED`, after every other finder (a real module of that name wins)."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]],
                  target: Optional[ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        new = MOVED.get(fullname)
        return None if new is None else importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Make the old names importable (once; :mod:`recipes` calls it on import)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
