"""The stress sweeps behind ``python recipes/stress.py``: a resumable grid of training runs with computed verdicts.

Layout (one idea per module; the sweep kinds own everything that differs between them):

* :mod:`~recipes.sweeps.cli` - the command line; :mod:`~recipes.sweeps.runner` - the resumable grid
  (shards, ``--jobs``, resume, the lock, the refusal of changed settings); :mod:`~recipes.sweeps.cell`
  - one training run; :mod:`~recipes.sweeps.checks` - every cell's settings checked before the first runs;
* :mod:`~recipes.sweeps.kind` - :class:`~recipes.sweeps.kind.Sweep`, what a sweep kind provides;
  :mod:`~recipes.sweeps.norm`, :mod:`~recipes.sweeps.qk` - the two kinds; :mod:`~recipes.sweeps.registry`
  - the kinds ``--sweep`` knows (a new kind: one module and one line there);
* shared: :mod:`~recipes.sweeps.records` (typed rows, CSV, atomic writes), :mod:`~recipes.sweeps.robustness`,
  :mod:`~recipes.sweeps.report`, :mod:`~recipes.sweeps.figure`, :mod:`~recipes.sweeps.claims` (intervals,
  verdicts, the Markdown of a claims section; no sweep-specific text).

Everything but :mod:`~recipes.sweeps.cell` and :mod:`~recipes.sweeps.checks` needs no torch, so a rerun with
nothing left to train stays fast.
"""
