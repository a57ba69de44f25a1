"""The lock a running sweep holds on its ``--out``: what Dask does not cover, a second driver writing the same ``--out``.

A :class:`filelock.FileLock` on ``<out>/.locks/sweep.lock`` for as long as the sweep runs, and who holds it (process,
host, start) in ``<out>/.locks/sweep`` for the refusal to name. The operating system drops the lock when its process
dies, however it dies, so a killed sweep's lock is simply taken by the next one.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Iterator

from filelock import FileLock, Timeout

from recipes.common.errors import UsageError

__all__ = ["out_lock"]


@contextlib.contextmanager
def out_lock(out: Path) -> Iterator[None]:
    """Hold the lock of ``out`` while the ``with`` block runs; a second holder is refused in one line naming the first."""
    holder = out / ".locks" / "sweep"
    holder.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(holder.with_name("sweep.lock"), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        try:
            who = json.loads(holder.read_text())
        except (OSError, json.JSONDecodeError):  # between its lock and its note
            who = {}
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(who.get("since", 0)))
        raise UsageError(f"--out {out} is in use by another sweep (process {who.get('pid', '?')} on "
                         f"{who.get('host', '?')}, started {since}): wait for it to finish, stop it, or use another "
                         "--out.") from None
    try:
        holder.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}))
        yield
    finally:
        holder.unlink(missing_ok=True)
        Path(lock.lock_file).unlink(missing_ok=True)  # removed while still held: no other sweep sees a gap
        lock.release()
