"""What gets installed: one top-level package, the callbacks as ``lightning_mrs.callbacks``.

Most Lightning projects have a ``callbacks.py`` of their own, first on ``sys.path`` when their
script runs; lightning-mrs must not install anything named ``callbacks`` at top level.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from helpers import ROOT

USER_CALLBACKS = "WHO = 'the user'\n"
# run from a folder that holds a user's callbacks.py: both imports must find their own module
PROBE = (
    "import callbacks, lightning_mrs.callbacks as ours\n"
    "from lightning_mrs.callbacks import GradientHomogeneityMonitor, NormSwap\n"
    "assert callbacks.WHO == 'the user', callbacks.__file__\n"
    "print(ours.__file__)\n"
)


def _source_modules() -> set[str]:
    """Every module of the source tree, as the path it must have inside the wheel."""
    core = {str(p.relative_to(ROOT)) for p in (ROOT / "lightning_mrs").rglob("*.py")}
    callbacks = {f"lightning_mrs/callbacks/{p.relative_to(ROOT / 'callbacks')}" for p in (ROOT / "callbacks").rglob("*.py")}
    return core | callbacks


def _probe(cwd: Path, extra_path: str = "") -> subprocess.CompletedProcess:
    (cwd / "callbacks.py").write_text(USER_CALLBACKS)
    env_path = [extra_path] if extra_path else []
    code = f"import sys; sys.path[1:1] = {env_path!r}\n" + PROBE
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (path,) = out.glob("lightning_mrs-*.whl")
    return path


def test_the_wheel_installs_one_top_level_package_with_every_module(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"lightning_mrs"}
    assert _source_modules() <= set(names)  # nothing left out (e.g. a new subpackage)
    assert "lightning_mrs/ops/cpu_kernels.cpp" in names  # the CPU kernels' source ships,
    assert {"lightning_mrs/ops/cpu_half.h", "lightning_mrs/ops/cpu_avx2.h"} <= set(names)  # with the headers it includes
    top_level = next(n for n in names if n.endswith("top_level.txt"))
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["lightning_mrs"]


@pytest.mark.slow  # idle 2 cores: 10-45 s; the default suite keeps a faster sibling
def test_the_wheel_imports_beside_a_users_callbacks_module(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    proc = _probe(tmp_path, str(site))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == str(site / "lightning_mrs" / "callbacks" / "__init__.py")


def test_the_editable_install_imports_beside_a_users_callbacks_module(tmp_path: Path) -> None:
    proc = _probe(tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert Path(proc.stdout.strip()) == ROOT / "callbacks" / "__init__.py"
