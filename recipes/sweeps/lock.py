"""The lock a running sweep holds on its shard of ``--out``: a second sweep into an overlapping shard refuses.

Each sweep holds an ``fcntl`` lock on ``<out>/.locks/shard-K-of-N`` (holding its process id, host and
start time) for as long as it runs. Before running it checks every other shard's lock file: one still
locked by a live process whose shard overlaps its own (``K = K' mod gcd(N, N')``) makes it refuse,
naming that process. The operating system drops the lock when a process dies however it dies, so
a lock file left unlocked (its process was killed) is stale: it is reported and taken over.
Shards that do not overlap (``--shard 0/2`` and ``1/2``) run side by side into one ``--out``.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import socket
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Optional

from recipes.errors import UsageError

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


class OutLock:
    """Hold the lock of shard ``k/n`` of ``out`` (a context manager); :attr:`stale` lists locks taken over."""

    def __init__(self, out: Path, k: int, n: int) -> None:
        self.out, self.shard = out, (k, n)
        self.path = out / ".locks" / f"shard-{k}-of-{n}"
        self.stale: list[str] = []
        self._file: Optional[IO[str]] = None

    def __enter__(self) -> "OutLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        previous = _holder(self.path) if self.path.exists() else {}
        f = open(self.path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            self._refuse(self.path)
        self._file = f
        if previous:
            self.stale.append(_who(previous))
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                            "shard": f"{self.shard[0]}/{self.shard[1]}"}))
        f.flush()
        for other in sorted(self.path.parent.glob("shard-*-of-*")):
            if other == self.path:
                continue
            _, k, _, n = other.name.split("-")
            if not _overlap(self.shard, (int(k), int(n))):
                continue
            with open(other, "a+") as g:
                try:
                    fcntl.flock(g, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    self.__exit__(None, None, None)
                    self._refuse(other)
                info = _holder(other)
                if info:
                    self.stale.append(_who(info))
                other.unlink()  # stale: its process is gone
                fcntl.flock(g, fcntl.LOCK_UN)
        return self

    def _refuse(self, path: Path) -> None:
        info = _holder(path)
        raise UsageError(f"--out {self.out} is in use by another sweep ({_who(info)}, --shard "
                         f"{info.get('shard', '?')}): wait for it to finish, stop it, or use another --out "
                         "(shards that do not overlap may share one --out).")

    def __exit__(self, kind: Optional[type], err: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        if self._file is not None:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None
