"""The recipes' module names from before the regrouping of issue 47 still import (recipes/common/moved.py):
users' code, their YAML's ``class_path`` and an old run's saved ``config.yaml`` keep working."""

from __future__ import annotations

import importlib
import json
import pickle
import sys
from pathlib import Path

import pytest

from helpers import ROOT
from recipes.common.moved import MOVED

# the layout before the regrouping, written out here (not read from MOVED): old file -> where it is now
BEFORE = {
    "recipes/checkpoints.py": "recipes/common/checkpoints.py", "recipes/errors.py": "recipes/common/errors.py",
    "recipes/hparams.py": "recipes/common/hparams.py", "recipes/interrupt.py": "recipes/common/interrupt.py",
    "recipes/optim.py": "recipes/common/optim.py", "recipes/training.py": "recipes/common/training.py",
    "recipes/classifier.py": "recipes/vision/classifier.py", "recipes/data.py": "recipes/vision/data.py",
    "recipes/datasets.py": "recipes/vision/datasets.py", "recipes/models.py": "recipes/vision/models.py",
    "recipes/synthetic.py": "recipes/vision/synthetic.py", "recipes/byte_lm.py": "recipes/text/byte_lm.py",
    "recipes/causal_lm.py": "recipes/text/causal_lm.py", "recipes/lm_model.py": "recipes/text/model.py",
    "recipes/lm_setup.py": "recipes/text/configure.py", "recipes/lm_checks.py": "recipes/text/checks.py",
    "recipes/pretrained_lm.py": "recipes/text/pretrained.py", "recipes/text_corpus.py": "recipes/text/corpus.py",
    "recipes/text_data.py": "recipes/text/data.py", "recipes/token_cache.py": "recipes/text/token_cache.py",
    "recipes/sweeps/cell.py": "recipes/sweeps/cells/image.py",
    "recipes/sweeps/checks.py": "recipes/sweeps/cells/image_checks.py",
    "recipes/sweeps/lm_cell.py": "recipes/sweeps/cells/lm.py",
    "recipes/sweeps/convert_cell.py": "recipes/sweeps/cells/convert.py",
    "recipes/sweeps/half_inputs.py": "recipes/sweeps/cells/half_inputs.py",
    "recipes/sweeps/master_weights.py": "recipes/sweeps/cells/master_weights.py",
    "recipes/sweeps/mechanism_eval.py": "recipes/sweeps/cells/mechanism_eval.py",
    "recipes/sweeps/registry.py": "recipes/sweeps/kinds/__init__.py", "recipes/sweeps/norm.py": "recipes/sweeps/kinds/norm.py",
    "recipes/sweeps/qk.py": "recipes/sweeps/kinds/qk.py", "recipes/sweeps/lm.py": "recipes/sweeps/kinds/lm.py",
    "recipes/sweeps/lmqk.py": "recipes/sweeps/kinds/lm_qk.py", "recipes/sweeps/convert.py": "recipes/sweeps/kinds/convert.py",
    "recipes/sweeps/lm_claims.py": "recipes/sweeps/claims/lm.py",
    "recipes/sweeps/convert_claims.py": "recipes/sweeps/claims/convert.py",
    "recipes/sweeps/mechanism.py": "recipes/sweeps/claims/mechanism.py",
    "recipes/resume.py": "recipes/vision/resume.py",
}


def _module(path: str) -> str:
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def test_every_old_file_is_gone_and_its_name_points_at_the_file_that_holds_it_now() -> None:
    assert {_module(old): _module(new) for old, new in BEFORE.items()} == MOVED
    for old, new in BEFORE.items():
        assert not (ROOT / old).exists() and (ROOT / new).is_file(), old


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_name_imports_the_same_module_object(old: str) -> None:
    module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])
    assert sys.modules[old] is module  # imported once: a class from either name is the same class


def test_old_import_statements_and_pickles_give_the_new_classes() -> None:
    from recipes.classifier import ImageClassifier  # as docs/recipes.md once wrote it
    from recipes.hparams import StepCSVLogger
    from recipes.vision.classifier import ImageClassifier as New

    assert ImageClassifier is New and StepCSVLogger.__module__ == "recipes.common.hparams"
    # a pickle written before the regrouping names the class by its old module
    assert pickle.loads(b"crecipes.interrupt\nSaveOnInterrupt\n.").__module__ == "recipes.common.interrupt"


def test_an_old_class_path_on_the_command_line_parses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # what a run's saved config.yaml holds: `class_path: recipes.hparams.StepCSVLogger`; jsonargparse imports it
    from recipes.cifar100 import build_cli

    monkeypatch.setattr(sys, "argv", ["cifar100.py"])
    logger = json.dumps({"class_path": "recipes.hparams.StepCSVLogger", "init_args": {"save_dir": str(tmp_path)}})
    cli = build_cli(["--data.dataset", "synthetic", "--model.arch", "resnet18", "--trainer.logger", logger])
    assert type(cli.trainer.logger).__module__ == "recipes.common.hparams"
    assert type(cli.trainer.logger).__name__ == "StepCSVLogger"


def test_an_unknown_old_name_is_still_an_import_error() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("recipes.no_such_module")
