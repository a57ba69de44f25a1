"""The declared floors (pyproject.toml) are tested: ``.ci/floors`` builds a venv with exactly the oldest
torch, Lightning and transformers the package admits and runs the core's and callbacks' tests there."""

from __future__ import annotations

import os
import subprocess
import tomllib

import pytest

from helpers import ROOT


@pytest.mark.slow  # about 15 minutes on 2 cores (installs included)
@pytest.mark.timeout(3600)
def test_the_core_and_callbacks_pass_on_the_declared_floors(tmp_path) -> None:
    env = {**os.environ, "FLOORS_VENV": str(tmp_path / "venv-floors")}
    proc = subprocess.run(["bash", str(ROOT / ".ci" / "floors"), "-q", "-x"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=3500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    torch_floor = next(r for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
                       if r.startswith("torch>="))
    assert f"floors: {torch_floor.removeprefix('torch>=')}" in proc.stdout  # the floor torch, not the suite's own
