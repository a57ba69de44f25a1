"""One cell of a stress sweep: one training run, its record, and the checks every cell passes before the first.

:mod:`.image` and :mod:`.image_checks` (the ``norm`` and ``qk`` kinds), :mod:`.lm` (``lm``, ``lm-qk``),
:mod:`.convert` (``convert``), and the pieces the LM cells train with: :mod:`.half_inputs`,
:mod:`.master_weights`, :mod:`.mechanism_eval`. A kind names its cell as ``"module:function"``
(:attr:`recipes.sweeps.kind.Sweep.runner`), loaded only when a cell trains: the one part of the sweeps that
imports torch.
"""
