"""What a sweep kind is: :class:`Sweep`, the one object the runner, the cells and the report ask.

A kind owns everything that differs between sweeps: its arms and the model arguments of an arm,
its grid and per-dataset defaults, the monitors its cells need and what it measures from their
logs (its own ``results.csv`` columns), its claims with their wording, its per-cell table
columns and its figure. The shared code never looks at a kind's name. A new kind is one module
defining a :class:`Sweep` and one line in :mod:`recipes.sweeps.kinds`.

The behaviour fields are plain module-level functions, so a kind pickles by reference into the
``--jobs`` worker processes. Needs no torch (a kind imports Lightning only inside ``monitors``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from recipes.sweeps.claims.engine import Claim
from recipes.sweeps.records import HEAD_COLUMNS, Row
from recipes.sweeps.score import TOP1, Score

__all__ = ["History", "Measured", "Sweep", "Table"]

#: every metric a cell logged: ``history[name] = [(step, value), ...]``
History = Mapping[str, Sequence[tuple[int, float]]]
#: what a kind measures from a cell's history: its metric columns' values, and curves for the record
Measured = tuple[dict[str, Any], dict[str, list[list[float]]]]


def _nothing(args: argparse.Namespace) -> dict[str, Any]:
    return {}


def _no_note(record: Mapping[str, Any]) -> str:
    return ""


def _no_factors(values: Mapping[str, Any]) -> dict[str, str]:
    return {}


def _no_lines(rows: list[dict[str, Any]]) -> list[str]:
    return []


@dataclass(frozen=True)
class Table:
    """A kind's own tidy table beside ``results.csv``, from its cells' records (e.g. ``--sweep lm``'s mechanism
    stress): ``<name>.csv``, a section of ``results.md`` with its own claims, ``<name>.png``.

    Attributes:
        name: the file stem and the record's key that holds the rows (a list of dicts).
        columns: the CSV's columns, in order.
        numeric: the columns read back as floats (the others stay text).
        title: the section's heading.
        intro: the section's opening lines (what the table is, how it was measured).
        claims: the table's rows (read back from the CSV) -> its claims, not yet evaluated.
        rule: the lines that open its claims (definitions).
        figure: draw ``<name>.png`` from the rows (atomically).
        plotted: what the figure shows, for the section's text.
        lines: the rows -> the section's computed lines (e.g. a table of means).
    """

    name: str
    columns: tuple[str, ...]
    numeric: tuple[str, ...]
    title: str
    intro: tuple[str, ...]
    claims: Callable[[list[dict[str, Any]]], list[Claim]]
    rule: tuple[str, ...]
    figure: Callable[[list[dict[str, Any]], Path], Any]
    plotted: str
    lines: Callable[[list[dict[str, Any]]], list[str]] = field(default=_no_lines)


@dataclass(frozen=True)
class Sweep:
    """One kind of stress sweep.

    Attributes:
        name: the ``--sweep`` value.
        arm_column: what the sweep varies, as the record and ``results.csv`` column (e.g. ``norm``).
        flag: the command-line option that lists the arms (e.g. ``--norms``).
        arms: the valid arms, in table order.
        arms_help: the option's help, without its default.
        grid: the default axes: ``arms``, ``lrs``, ``batch_sizes``, ``seeds``.
        quick: ``--quick``'s smaller axes, and its ``epochs`` per dataset.
        datasets: per dataset, the model, input and budget defaults (``epochs`` None: required).
        optimizer: ``sgd`` or ``adamw`` (``recipes/common/optim.py``).
        weight_decay: the default ``--weight-decay``.
        warmup_frac: the default ``--warmup-frac``.
        optimizer_text: the optimizer as ``results.md`` states it.
        help: what the sweep is, for ``--sweep``'s help.
        model_arms: an arm -> the classifier's keyword arguments that set it.
        monitors: the parsed arguments -> the Lightning callbacks a cell needs (imports Lightning).
        measure: a cell's logged history -> its metric columns' values and curves to keep.
        metric_columns: the kind's ``results.csv`` columns (between the shared ones and the cost).
        table: the per-cell table's extra columns: (header, metric column).
        table_note: what those columns mean.
        claims: typed rows -> the kind's claims, not yet evaluated.
        rule: the lines that open the "Claims" section (the decision rule and the kind's definitions).
        figure: draw ``results.png`` from typed rows (atomically); returns the panels.
        title: ``results.md``'s heading; arm_label: the arm in prose; plotted: what the figure shows.
        cell_prefix: the cell id's prefix (ids of different kinds never collide).
        out_stem: the default ``--out`` is ``runs/<out_stem>_<dataset>``.
        extra_settings: the parsed arguments -> settings of this kind beyond the shared ones.
        progress_note: a finished cell's record -> extra text for its progress line.
        score: what a cell is scored by (final top-1; bits per byte for language models).
        head_columns: the shared ``results.csv`` columns the kind has (a language model has no top-1).
        default_dataset: the ``--dataset`` when none is given.
        runner: ``module:function`` that trains one cell (imported only where a cell trains).
        checker: ``module:function`` that checks every cell's settings before the first runs.
        keep: the cells of the grid the kind runs (e.g. a reference arm at a few learning rates only).
        data_note: the record of the checked data (``data.json``) -> its line in ``results.md``.
        factor_columns: the factors an arm packs, each a ``results.csv`` column after the arm's (tidy rows).
        factors: a record or CSV row -> its factors' values (from its arm), where the row lacks them.
        aliases: a metric column's old name -> its name now: records written before a rename are read under it.
        tables: the kind's own tables beside ``results.csv`` (:class:`Table`).
        against: what ``results.png`` plots against, for ``results.md``'s text.
        lr_robustness: whether ``results.md`` has the learning-rate robustness section (not for a single lr).
    """

    name: str
    arm_column: str
    flag: str
    arms: tuple[str, ...]
    arms_help: str
    grid: dict[str, list[Any]]
    quick: dict[str, Any]
    datasets: dict[str, dict[str, Any]]
    optimizer: str
    weight_decay: float
    warmup_frac: float
    optimizer_text: str
    help: str
    model_arms: Callable[[str], dict[str, Any]]
    monitors: Callable[[argparse.Namespace], list[Any]]
    measure: Callable[[History], Measured]
    metric_columns: tuple[str, ...]
    table: tuple[tuple[str, str], ...]
    table_note: str
    claims: Callable[[list[Row]], list[Claim]]
    rule: tuple[str, ...]
    figure: Callable[[list[Row], Path], Any]
    title: str
    arm_label: str
    plotted: str
    cell_prefix: str = ""
    out_stem: str = "stress"
    extra_settings: Callable[[argparse.Namespace], dict[str, Any]] = field(default=_nothing)
    progress_note: Callable[[Mapping[str, Any]], str] = field(default=_no_note)
    score: Score = TOP1
    head_columns: tuple[str, ...] = HEAD_COLUMNS
    default_dataset: str = "cifar100"
    runner: str = "recipes.sweeps.cells.image:run_cell"
    checker: str = "recipes.sweeps.cells.image_checks:check_cells"
    keep: Optional[Callable[[tuple[str, float, int, int], argparse.Namespace], bool]] = None
    data_note: Optional[Callable[[Mapping[str, Any]], str]] = None
    factor_columns: tuple[str, ...] = ()
    factors: Callable[[Mapping[str, Any]], dict[str, str]] = field(default=_no_factors)
    aliases: Mapping[str, str] = field(default_factory=dict)
    tables: tuple[Table, ...] = ()
    against: str = "the learning rate"
    lr_robustness: bool = True

    @property
    def dest(self) -> str:
        """The attribute of the parsed arguments that holds the arms (``--qk-norms`` -> ``qk_norms``)."""
        return self.flag[2:].replace("-", "_")

    def cell_name(self, arm: str, lr: float, batch_size: int, seed: int) -> str:
        """The cell's id: its TensorBoard run name and the stem of its record file."""
        return f"{self.cell_prefix}{arm}_lr{lr:g}_bs{batch_size}_seed{seed}"

    def load(self, what: str) -> Callable[..., Any]:
        """The function ``runner`` or ``checker`` names, imported now."""
        import importlib

        module, name = getattr(self, what).split(":")
        return getattr(importlib.import_module(module), name)

    def row(self, values: Mapping[str, Any]) -> Row:
        """A typed row of this kind from a record or a CSV row (old column names and missing factors filled in)."""
        values = dict(values)
        for old, new in self.aliases.items():
            if values.get(new) in (None, "") and old in values:
                values[new] = values[old]
        for name, value in self.factors(values).items():
            if values.get(name) in (None, ""):
                values[name] = value
        return Row.parse(values, self.arm_column, self.metric_columns, self.factor_columns)

    def read(self, path: Path) -> list[Row]:
        """The typed rows of this kind's ``results.csv`` at ``path`` (older files included: :meth:`row`)."""
        import csv

        with open(path, newline="") as f:
            return [self.row(values) for values in csv.DictReader(f)]
