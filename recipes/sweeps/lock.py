"""The lock a running sweep holds on its shard of ``--out``: a second sweep into an overlapping shard refuses.

Each sweep holds a :class:`filelock.FileLock` on ``<out>/.locks/shard-K-of-N.lock`` for as long as it
runs, and writes who holds it (process id, host, start time) to ``<out>/.locks/shard-K-of-N``. Before
running it checks every other shard: one still locked by a live process whose shard overlaps its own
(``K = K' mod gcd(N, N')``) makes it refuse, naming that process. The operating system drops the lock
when a process dies however it dies, so a lock left unlocked (its process was killed) is stale: it is
reported and taken over.
Shards that do not overlap (``--shard 0/2`` and ``1/2``) run side by side into one ``--out``.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from pathlib import Path
from types import TracebackType
from typing import Optional

from filelock import FileLock, Timeout

from recipes.common.errors import UsageError

__all__ = ["OutLock"]


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return (a[0] - b[0]) % math.gcd(a[1], b[1]) == 0


def _holder(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, json.JSONDecodeError):
        return {}


def _who(info: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["since"])) if "since" in info else "?"
    return f"process {info.get('pid', '?')} on {info.get('host', '?')}, started {since}"


def _lock(info: Path) -> FileLock:
    """The lock beside the holder file ``info`` (taken without waiting)."""
    return FileLock(info.with_name(info.name + ".lock"), timeout=0)


class OutLock:
    """Hold the lock of shard ``k/n`` of ``out`` (a context manager); :attr:`stale` lists locks taken over."""

    def __init__(self, out: Path, k: int, n: int) -> None:
        self.out, self.shard = out, (k, n)
        self.path = out / ".locks" / f"shard-{k}-of-{n}"
        self.stale: list[str] = []
        self._lock: Optional[FileLock] = None

    def __enter__(self) -> "OutLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock = _lock(self.path)
        try:
            lock.acquire()
        except Timeout:
            self._refuse(self.path)
        self._lock = lock
        previous = _holder(self.path) if self.path.exists() else {}
        if previous:
            self.stale.append(_who(previous))
        self.path.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                                         "shard": f"{self.shard[0]}/{self.shard[1]}"}))
        for other in sorted(self.path.parent.glob("shard-*-of-*")):
            if other == self.path or other.suffix == ".lock":
                continue
            _, k, _, n = other.name.split("-")
            if not _overlap(self.shard, (int(k), int(n))):
                continue
            theirs = _lock(other)
            try:
                theirs.acquire()
            except Timeout:
                self.__exit__(None, None, None)
                self._refuse(other)
            info = _holder(other)
            if info:
                self.stale.append(_who(info))
            other.unlink()  # stale: its process is gone
            Path(theirs.lock_file).unlink(missing_ok=True)
            theirs.release()
        return self

    def _refuse(self, path: Path) -> None:
        info = _holder(path)
        raise UsageError(f"--out {self.out} is in use by another sweep ({_who(info)}, --shard "
                         f"{info.get('shard', '?')}): wait for it to finish, stop it, or use another --out "
                         "(shards that do not overlap may share one --out).")

    def __exit__(self, kind: Optional[type], err: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        if self._lock is not None:
            self.path.unlink(missing_ok=True)
            Path(self._lock.lock_file).unlink(missing_ok=True)  # removed while still held: no other sweep sees a gap
            self._lock.release()
            self._lock = None
