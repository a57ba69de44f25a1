"""The claims of a sweep as computed comparisons: intervals over seeds (:mod:`.stats`), comparisons and
their combined verdicts (:mod:`.engine`), the "Claims" section of ``results.md`` (:mod:`.markdown`).

Nothing here is specific to a sweep kind: each kind (:mod:`recipes.sweeps.norm`, :mod:`recipes.sweeps.qk`)
builds its claims from these parts and words them itself.
"""
