"""The stress sweeps behind ``python recipes/stress.py``: a resumable grid of training runs with computed verdicts.

Layout (one idea per module; the sweep kinds own everything that differs between them):

* the machinery: :mod:`~recipes.sweeps.cli` - the command line; :mod:`~recipes.sweeps.runner` - the resumable
  grid (``--jobs``, the Dask cluster, resume, :mod:`~recipes.sweeps.lock`, the refusal of changed
  :mod:`~recipes.sweeps.settings`); :mod:`~recipes.sweeps.kind` - :class:`~recipes.sweeps.kind.Sweep`, what a
  sweep kind provides; :mod:`~recipes.sweeps.rebuild` - a report from ``results.csv`` alone;
* :mod:`~recipes.sweeps.kinds` - the kinds ``--sweep`` knows, one module each (``norm``, ``qk``, ``lm``,
  ``lm_qk``, ``convert``), registered in the package's ``__init__`` (a new kind: one module and one line there);
* :mod:`~recipes.sweeps.claims` - the claims engine (intervals, verdicts, the Markdown of a claims section)
  and, beside it, the claim texts of the kinds that keep them apart (``lm``, ``mechanism``, ``convert``);
* :mod:`~recipes.sweeps.cells` - one training run of each kind (image, lm, convert) and what it needs;
* shared: :mod:`~recipes.sweeps.records` (typed rows, CSV, atomic writes), :mod:`~recipes.sweeps.score`,
  :mod:`~recipes.sweeps.series`, :mod:`~recipes.sweeps.robustness`, :mod:`~recipes.sweeps.report`,
  :mod:`~recipes.sweeps.figure`.

Everything but :mod:`~recipes.sweeps.cells` needs no torch, so a rerun with nothing left to train stays fast.
"""
