"""Building the C++ library of the CPU path (:mod:`.cpu_kernels`) on first use, once per machine:
the compiler, the cache folder and the cached compile.

The cache folder is ``$LIGHTNING_MRS_CACHE``, else ``$XDG_CACHE_HOME/lightning_mrs`` (default
``~/.cache/lightning_mrs``), else, where that is not writable, a per-user folder in the temp dir.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

__all__ = ["cache_dir", "compile_cached", "compiler", "cpu_signature"]


def cpu_signature() -> str:
    """The CPU's model and instruction sets: a library built with ``-march=native`` on one
    machine must not be loaded on another (shared home folders on a cluster)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        keys = ("model name", "flags", "Features")
        keep = [ln for ln in text.splitlines() if ln.startswith(keys)]
        return "\n".join(sorted(set(keep)))
    except OSError:
        return platform.processor() or platform.machine()


def compiler() -> Optional[str]:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def cache_dir() -> Path:
    root = os.environ.get("LIGHTNING_MRS_CACHE")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = Path(base) / "lightning_mrs"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if os.access(folder, os.W_OK):
            return folder
    except OSError:
        pass
    # a read-only home (containers): a per-user folder in the temp dir
    user = os.getuid() if hasattr(os, "getuid") else "user"
    return Path(tempfile.gettempdir()) / f"lightning_mrs_{user}"


def compile_cached(name: str, cxx: str, flags: list[str], sources: list[Path], contents: list[bytes],
                   libs: tuple[str, ...] = ()) -> tuple[Path, Optional[str]]:
    """``(path, error)``: the library ``<name>_<key>.so`` in the cache folder, compiled by
    ``cxx *flags *sources *libs -o path`` unless it is there already. ``key`` hashes ``contents``
    (what the sources hold, and what else must force a rebuild), the compiler's version, ``flags``
    and ``libs``; ``error`` is the compiler's message when the compile failed, else ``None``."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    parts = [*contents, version.encode(), " ".join([*flags, *libs]).encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:20]
    target = cache_dir() / f"{name}_{key}.so"
    if target.exists():
        return target, None
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes (DDP ranks) each build a
    # complete file and the rename is atomic, so no lock is needed.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    proc = subprocess.run([cxx, *flags, *map(str, sources), *libs, "-o", tmp], capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        return target, proc.stderr
    os.replace(tmp, target)
    return target, None
