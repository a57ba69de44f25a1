"""The order of the rows in each round of an interleaved benchmark (``bench_norm``, ``bench_small``,
``bench_lm_step``).

Rows are timed in turns within one process, so that machine noise hits them alike. What a row
leaves behind (caches filled with its buffers, large blocks freed for the next allocation) costs
the row that runs next, so the order must not give one row the same neighbour every round. A
rotation of one fixed order does: it changes which row starts a round, not who follows whom,
and in ``bench_norm`` it put the default module after the eager formula (the row that trashes
the caches) in every round. Each round here is a fresh, seeded random permutation.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

__all__ = ["round_orders"]


def round_orders(names: Sequence[str], rounds: int, seed: int = 0) -> list[list[str]]:
    """One order of ``names`` per round, a random permutation each (the same for one ``seed``).

    Example:
        >>> round_orders(["a", "b", "c"], 2)
        [['b', 'c', 'a'], ['b', 'c', 'a']]
    """
    rng = random.Random(seed)
    return [rng.sample(list(names), len(names)) for _ in range(rounds)]
