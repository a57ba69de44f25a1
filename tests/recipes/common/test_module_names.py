"""The recipes' modules under their names only (issue 54 §3: no aliases of the names before issue 47's
regrouping): an old name is an ImportError, a module reloads, and an old ``class_path`` or sweep folder
is told its new name in one line."""

from __future__ import annotations

import contextlib
import importlib
import json
import sys
from pathlib import Path

import pytest

from recipes.common.errors import UsageError


@pytest.mark.parametrize("old", ["recipes.hparams", "recipes.classifier", "recipes.sweeps.registry",
                                 "recipes.sweeps.lm_cell"])
def test_an_old_module_name_does_not_import(old: str) -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


def test_reload_of_a_recipes_module_runs_it_again() -> None:
    import recipes.common.optim as module

    with contextlib.suppress(ModuleNotFoundError):  # what an old config's class_path did before: an alias
        importlib.import_module("recipes.optim")
    saved = dict(module.__dict__)
    try:
        for name in module.__all__:
            delattr(module, name)
        assert importlib.reload(module) is module
        assert module.__spec__.name == "recipes.common.optim"
        assert all(hasattr(module, name) for name in module.__all__)  # the source ran again
    finally:
        module.__dict__.clear()
        module.__dict__.update(saved)  # the classes other tests hold stay the module's


def test_an_old_class_path_is_one_line_with_the_new_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from recipes.cifar100 import build_cli
    from recipes.common.hparams import StepCSVLogger

    monkeypatch.setattr(sys, "argv", ["cifar100.py"])
    logger = json.dumps({"class_path": "recipes.hparams.StepCSVLogger", "init_args": {"save_dir": str(tmp_path)}})
    with pytest.raises(UsageError) as err:  # what a run's config.yaml from before the regrouping holds
        build_cli(["--data.dataset", "synthetic", "--model.arch", "resnet18", "--trainer.logger", logger])
    assert f"{StepCSVLogger.__module__}.StepCSVLogger" == "recipes.common.hparams.StepCSVLogger"
    assert str(err.value) == ("class_path 'recipes.hparams.StepCSVLogger' names a module that recipes/ no longer has: "
                              "StepCSVLogger is now recipes.common.hparams.StepCSVLogger (replace the old name, e.g. "
                              "in the run's config.yaml)")
    logger = json.dumps({"class_path": "recipes.common.hparams.StepCSVLogger", "init_args": {"save_dir": str(tmp_path)}})
    cli = build_cli(["--data.dataset", "synthetic", "--model.arch", "resnet18", "--trainer.logger", logger])
    assert type(cli.trainer.logger) is StepCSVLogger  # the new name, as the message says


def test_a_class_path_of_no_recipes_class_keeps_jsonargparses_message() -> None:
    from recipes.common.training import moved_class_path

    assert moved_class_path("Problem with given class_path 'recipes.hparams.NoSuchClass': ...") is None
    assert moved_class_path("Problem with given class_path 'recipes.common.hparams.Nope': ...") is None  # imports
    assert moved_class_path("Problem with given class_path 'recipes.no.such.StepCSVLogger': x").endswith(
        "StepCSVLogger is now recipes.common.hparams.StepCSVLogger (replace the old name, e.g. in the run's config.yaml)")


def test_a_sweep_folder_that_names_moved_files_says_how_to_resume(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from recipes.stress import parse_args
    from recipes.sweeps import settings as st
    from recipes.sweeps.runner import run

    argv = ["--sweep", "lm", "--out", str(tmp_path)]
    current = st.sweep_settings(parse_args(argv))
    # what a sweep written before the regrouping recorded (its texts named the files of that layout)
    old = {**current, "split": current["split"].replace("recipes/text/data.py", "recipes/text_data.py"),
           "mechanism": current["mechanism"].replace("recipes/sweeps/claims/mechanism.py", "recipes/sweeps/mechanism.py")}
    assert old != current
    (tmp_path / st.SETTINGS_FILE).write_text(json.dumps(old))
    assert run(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.endswith(
        "only files of recipes/ that have moved since (same computation): to resume, replace recipes/sweeps/mechanism.py "
        "with recipes/sweeps/claims/mechanism.py, recipes/text_data.py with recipes/text/data.py in its settings.json): "
        "use another --out, or the same settings to resume that sweep.")
    # the fix it names makes the folder's settings the current ones
    fixed = json.loads(json.dumps(old).replace("recipes/text_data.py", "recipes/text/data.py")
                       .replace("recipes/sweeps/mechanism.py", "recipes/sweeps/claims/mechanism.py"))
    assert st.changed(fixed, current) == ""
    # another difference is not called a move
    assert "moved" not in st.changed({**old, "seq_len": 7}, current)
