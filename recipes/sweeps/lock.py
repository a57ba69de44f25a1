"""The lock a running sweep holds on its ``--out``: a second sweep (another driver) into the same ``--out`` refuses.

Dask gives each cell to one worker; what it does not cover is two drivers writing one ``--out``. Each sweep holds
a :class:`filelock.FileLock` on ``<out>/.locks/sweep.lock`` for as long as it runs, and writes who holds it
(process id, host, start time) to ``<out>/.locks/sweep``. The operating system drops the lock when a process
dies however it dies, so a holder file whose lock is free was left by a killed sweep: it is reported and taken over.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from types import TracebackType
from typing import Optional

from filelock import FileLock, Timeout

from recipes.common.errors import UsageError

__all__ = ["OutLock"]


def _who(info: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["since"])) if "since" in info else "?"
    return f"process {info.get('pid', '?')} on {info.get('host', '?')}, started {since}"


class OutLock:
    """Hold the lock of ``out`` (a context manager); :attr:`stale` names a lock taken over from a killed sweep."""

    def __init__(self, out: Path) -> None:
        self.out, self.path = out, out / ".locks" / "sweep"
        self.stale: list[str] = []
        self._lock = FileLock(self.path.with_name("sweep.lock"), timeout=0)

    def _holder(self) -> dict:
        try:
            return json.loads(self.path.read_text() or "{}")
        except (OSError, json.JSONDecodeError):
            return {}

    def __enter__(self) -> "OutLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._lock.acquire()
        except Timeout:
            raise UsageError(f"--out {self.out} is in use by another sweep ({_who(self._holder())}): wait for it to "
                             "finish, stop it, or use another --out.") from None
        previous = self._holder()
        if previous:
            self.stale.append(_who(previous))
        self.path.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}))
        return self

    def __exit__(self, kind: Optional[type], err: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        if self._lock.is_locked:
            self.path.unlink(missing_ok=True)
            Path(self._lock.lock_file).unlink(missing_ok=True)  # removed while still held: no other sweep sees a gap
            self._lock.release()
