"""The claims of a sweep as computed comparisons: intervals over seeds (:mod:`.stats`), comparisons and
their combined verdicts (:mod:`.engine`), the "Claims" section of ``results.md`` (:mod:`.markdown`).

The engine is specific to no sweep kind: each kind builds its claims from these parts and words them
itself, in its own module (:mod:`recipes.sweeps.kinds.norm`, :mod:`recipes.sweeps.kinds.qk`) or, where the
texts are a module of their own, here beside the engine: :mod:`.lm` (the ``lm`` sweep), :mod:`.mechanism`
(its claim M) and :mod:`.convert` (the ``convert`` sweep).
"""
