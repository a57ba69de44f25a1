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

__all__ = ["UsageError", "report"]


class UsageError(ValueError):
    """A user mistake; the message is one line naming the option (or path) and the fix."""


def report(err: BaseException) -> int:
    """Print ``err`` as a single ``error: ...`` line on stderr and return the exit status 2."""
    text = " ".join(str(err).split())  # one line whatever the message holds
    print(f"error: {text}", file=sys.stderr)
    return 2
