"""The recipes' user-mistake exception: the scripts print its message as one line and exit 2.

Raise :class:`UsageError` for anything the user can fix from the command line or the disk
(a bad option value, a missing dataset, a malformed image folder); its message names the
option or path and the fix. Programming errors stay ordinary exceptions with a traceback.

Example:
    >>> try:
    ...     raise UsageError("--model.lr must be > 0, got 0.0.")
    ... except ValueError as err:  # a UsageError is a ValueError for callers that catch those
    ...     print(err)
    --model.lr must be > 0, got 0.0.
"""

from __future__ import annotations

import sys
from typing import Optional

__all__ = ["UsageError", "check_loader_options", "report"]


class UsageError(ValueError):
    """A user mistake; the message is one line naming the option (or path) and the fix."""


def check_loader_options(val_fraction: float, num_workers: Optional[int]) -> None:
    """The options every recipe DataModule shares (``--data.val_fraction``, ``--data.num_workers``).

    Raises:
        UsageError: one line naming the option and its valid range.

    Example:
        >>> check_loader_options(0.1, None)
        >>> check_loader_options(1.0, 0)
        Traceback (most recent call last):
        ...
        recipes.common.errors.UsageError: --data.val_fraction must lie in (0, 1), got 1.0.
    """
    if not 0.0 < val_fraction < 1.0:
        raise UsageError(f"--data.val_fraction must lie in (0, 1), got {val_fraction}.")
    if num_workers is not None and num_workers < 0:
        raise UsageError(f"--data.num_workers must be >= 0 or None (auto), got {num_workers}.")


def report(err: BaseException) -> int:
    """Print ``err`` as a single ``error: ...`` line on stderr and return the exit status 2."""
    text = " ".join(str(err).split())  # one line whatever the message holds
    print(f"error: {text}", file=sys.stderr)
    return 2
