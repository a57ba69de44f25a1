"""What gets installed: one top-level package, the callbacks as ``lightning_mrs.callbacks``.

Most Lightning projects have a ``callbacks.py`` of their own, first on ``sys.path`` when their
script runs; lightning-mrs must not install anything named ``callbacks`` at top level.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

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


def _installed_closure(name: str) -> list[md.Distribution]:
    """``name``'s distribution and every one it requires (extras included, as pip resolves them)."""
    found: dict[str, md.Distribution] = {}
    todo: list[tuple[str, frozenset[str]]] = [(name, frozenset())]
    while todo:
        dist_name, extras = todo.pop()
        key = re.sub(r"[-_.]+", "-", dist_name).lower()
        try:
            dist = md.distribution(dist_name)
        except md.PackageNotFoundError:
            continue  # a requirement pip skips here too (another platform); the install below says if not
        if key in found and not extras:
            continue
        found[key] = dist
        for text in dist.requires or ():
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras | {""}):
                todo.append((req.name, frozenset(req.extras)))
    return list(found.values())


def test_the_bare_wheel_installs_beside_a_users_torch_and_pulls_in_nothing(wheel: Path, tmp_path: Path) -> None:
    # the user's environment: a fresh venv that already has this torch (its files linked in, not copied)
    farm = tmp_path / "users-torch"
    farm.mkdir()
    for dist in _installed_closure("torch"):
        for top in {f.parts[0] for f in dist.files or () if f.parts[0] != ".."}:
            if not (farm / top).exists():
                (farm / top).symlink_to(dist.locate_file(top))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "users-torch.pth").write_text(f"{farm}\n")
    # no index and no configured wheel folders: a requirement beyond torch's would fail the install
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index",
                           "--find-links", str(wheel.parent), "lightning-mrs"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert re.findall(r"Successfully installed (.*)", proc.stdout) == [f"lightning-mrs-{wheel.name.split('-')[1]}"]
    use = (
        "import torch\n"
        "from lightning_mrs import MRSNorm, mrs_norm, swap_norms\n"
        "model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))\n"
        "swap_norms(model, 'mrs')\n"
        "x = torch.randn(3, 4)\n"
        "h = model[0](x)\n"
        "assert type(model[1]) is MRSNorm and torch.allclose(model(x), mrs_norm(h, eps=model[1].eps), atol=1e-6)\n"
        "try:\n"
        "    import lightning_mrs.callbacks\n"
        "except ImportError as err:\n"
        "    print(err)\n"
        "print(torch.__version__)\n"
    )
    proc = subprocess.run([str(python), "-c", use], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [
        "lightning_mrs.callbacks needs Lightning: pip install 'lightning-mrs[callbacks]'",
        torch.__version__,  # the user's torch, untouched
    ]


@pytest.mark.parametrize(("missing", "module", "extra"), [
    ("lightning", "lightning_mrs.callbacks", "'lightning-mrs[callbacks]'"),
    ("timm", "recipes", "'.[recipes]'"),
])
def test_a_missing_extra_is_named_in_one_line(missing: str, module: str, extra: str, tmp_path: Path) -> None:
    # a fresh process where `missing` cannot be found (as in an environment without the extra)
    code = (
        "import importlib.util, sys\n"
        "find = importlib.util.find_spec\n"
        f"importlib.util.find_spec = lambda name, *a: None if name == {missing!r} else find(name, *a)\n"
        f"import {module}\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith("ImportError: ") and missing in last and extra in last, proc.stderr
