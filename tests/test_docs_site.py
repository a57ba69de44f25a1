"""The documentation site builds: ``sphinx-build -W`` over docs/ (the guides through MyST, the API
reference through autodoc), so a broken cross-reference, a heading that does not resolve, a
public name without a docstring, an ``Example:`` or a page fails here. Needs the ``docs`` extra."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import ROOT

_MISSING = [m for m in ("sphinx", "myst_parser", "furo") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"needs the docs extra (pip install -e '.[docs]'): "
                                                       f"{', '.join(_MISSING)} missing")


def _conf():
    spec = importlib.util.spec_from_file_location("lightning_mrs_docs_conf", ROOT / "docs" / "conf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_site_builds_without_a_warning(tmp_path: Path) -> None:
    # about 45 s on the shared 2-core machine, most of it importing the modules autodoc documents
    done = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                           str(ROOT / "docs"), str(tmp_path / "html")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"sphinx-build -W failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    api = (tmp_path / "html" / "api" / "core.html").read_text()
    assert 'id="lightning_mrs.MRSNorm"' in api and 'id="lightning_mrs.from_pretrained"' in api
    # a guide's `page.md#anchor` link became a link to the heading's id on that page
    transformers = (tmp_path / "html" / "transformers.html").read_text()
    assert 'href="swap.html#the-normswap-callback"' in transformers


def test_the_docstring_rule_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    """The conf's check: a public function without ``Example:`` or without a docstring, and public
    data without a ``#:`` comment, each give a warning (an error under -W); a private one none."""
    conf = _conf()
    warned = []
    monkeypatch.setattr(conf, "_log", SimpleNamespace(warning=lambda msg, *args, **kw: warned.append(msg % args)))

    def no_example() -> None:
        """Documented, but shows no use."""

    def no_doc() -> None: ...

    def private() -> None: ...

    data = ("a", "b")
    app = SimpleNamespace(config=SimpleNamespace(_lmrs_public_ids={
        id(no_example): "pkg.no_example", id(no_doc): "pkg.no_doc", id(data): "pkg.DATA"}))
    conf._check_docstring(app, "function", "x.no_example", no_example, {}, [])
    conf._check_docstring(app, "function", "x.no_doc", no_doc, {}, [])
    conf._check_docstring(app, "data", "x.DATA", data, {}, [])
    conf._check_docstring(app, "data", "x.DATA", data, {}, ["documented"])
    conf._check_docstring(app, "function", "x.private", private, {}, [])
    assert warned == ["pkg.no_example: public docstring without an Example: section",
                      "pkg.no_doc: public name without a docstring",
                      "pkg.DATA: public data without a #: comment where it is defined"]


def test_a_public_name_on_no_api_page_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    """The conf's check that every public name is on a page, under any of its names: the
    documented ``lightning_mrs.swap_norms`` covers ``lightning_mrs.swap.swap_norms``; a public
    name documented nowhere is named in a warning."""
    conf = _conf()
    warned = []
    monkeypatch.setattr(conf, "_log", SimpleNamespace(warning=lambda msg, *args, **kw: warned.append(msg % args)))
    public = {"lightning_mrs.swap_norms", "lightning_mrs.swap.swap_norms", "lightning_mrs.mrs_norm"}
    app = SimpleNamespace(config=SimpleNamespace(_lmrs_public=public))
    env = SimpleNamespace(lmrs_documented={"lightning_mrs.swap_norms"})
    conf._check_every_public_name_documented(app, env)
    assert warned == ["lightning_mrs.mrs_norm is public (in __all__) but on no page of docs/api/"]
    env.lmrs_documented.add("lightning_mrs.ops.mrs_norm")  # the function, not the module ops/mrs_norm.py
    warned.clear()
    conf._check_every_public_name_documented(app, env)
    assert warned == []
