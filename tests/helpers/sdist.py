"""A peer library's source distribution, fetched at test time for its own test suite.

The peers' suites (timm's ``tests/test_models.py``, transformers' ``tests/test_modeling_common.py``)
run unchanged from the sdist of the installed version, never copied into this repository. Only
the members a suite needs are unpacked (its tests, never its package source), so the run imports
the installed library, the one whose models are swapped.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Callable

import pytest

__all__ = ["fetch_sdist"]


def fetch_sdist(name: str, version: str, cache_dir: Path, wanted: Callable[[str], bool]) -> Path:
    """``<cache_dir>/<name>-<version>``, with the sdist's members for which ``wanted(member name)``
    holds unpacked into it (downloaded once with ``pip download --no-binary :all: --no-deps``).

    Skips the calling test with a one-line reason when the archive cannot be fetched.
    """
    archive = cache_dir / f"{name}-{version}.tar.gz"
    if not archive.is_file():
        cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
               f"{name}=={version}", "-d", str(cache_dir), "-q"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as err:
            pytest.skip(f"cannot fetch the {name} {version} sdist: {err}")
        if done.returncode or not archive.is_file():
            reason = (done.stderr.strip().splitlines() or ["no archive"])[-1]
            pytest.skip(f"cannot fetch the {name} {version} sdist: {reason}")
    with tarfile.open(archive) as tar:
        tar.extractall(cache_dir, members=[m for m in tar.getmembers() if wanted(m.name)], filter="data")
    return cache_dir / f"{name}-{version}"
