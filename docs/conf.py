"""Sphinx configuration of the lightning-mrs site: the Markdown guides (MyST) and the API reference
(autodoc + napoleon, Google-style docstrings). Build: ``sphinx-build -W -b html docs docs/_build/html``
(docs/development.md#the-documentation-site); ``tests/test_docs_site.py`` runs it."""

from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path

from sphinx.util import logging

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # lightning_mrs and the recipes package, from this checkout

from lightning_mrs import __version__  # noqa: E402

project = "lightning-mrs"
author = "the lightning-mrs authors"
copyright = "the lightning-mrs authors, Apache-2.0"
release = version = __version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
# No intersphinx: the site builds offline (CI and the tests have no network), and intersphinx
# would fetch python's and torch's inventories on every build.
# Not nitpicky (-n): a cross-reference that does not resolve renders as code, not as an error.
# With -n this site gives 153 warnings: about 90 are torch and stdlib types in the signatures
# (torch.Tensor, nn.Module, torch.device...), which only intersphinx (the network) resolves; the
# rest name internal modules and private classes (lightning_mrs.swap.probe, recipes.text.data...)
# that are deliberately not API pages. Links between pages and headings are checked regardless.

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# MyST: `page.md#anchor` links resolve to heading anchors as GitHub writes them (the README and
# the guides link that way; tests/test_docs.py checks the same slugs), down to level 4.
myst_heading_anchors = 4
myst_enable_extensions = ["dollarmath"]

# autodoc + napoleon: Google style, members in source order, type hints in the description.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"show-inheritance": False}
# Lightning and transformers are imported by the callbacks' and the recipes' modules; both are in
# the [dev] extra, so nothing is mocked: a page that cannot import its module fails the build.

html_theme = "furo"
html_title = f"lightning-mrs {release}"

_log = logging.getLogger("lightning_mrs.docs")
_PUBLIC = ("lightning_mrs", "lightning_mrs.swap", "lightning_mrs.ops", "lightning_mrs.callbacks")


def _public_names() -> set[str]:
    """``module.name`` of every name in a public package's ``__all__`` (the API promise)."""
    import importlib

    out = set()
    for module in _PUBLIC:
        out.update(f"{module}.{name}" for name in importlib.import_module(module).__all__)
    return out


def _check_docstring(app, what, name, obj, options, lines) -> None:
    """Warn (an error under ``-W``) when a public class or function has no docstring or no
    ``Example:`` section, or public data no ``#:`` comment: the project's rule, which autodoc alone
    does not enforce. Public means in a public package's ``__all__``, under any of its names."""
    public = app.config._lmrs_public_ids.get(id(obj))
    if public is None:
        return
    if inspect.isclass(obj) or inspect.isroutine(obj):
        doc = inspect.getdoc(obj) or ""
        if not doc.strip():
            _log.warning("%s: public name without a docstring", public, type="lightning_mrs", subtype="docstring")
        elif "Example:" not in doc and "Examples:" not in doc:
            _log.warning("%s: public docstring without an Example: section", public,
                         type="lightning_mrs", subtype="example")
    elif not any(line.strip() for line in lines):
        _log.warning("%s: public data without a #: comment where it is defined", public,
                     type="lightning_mrs", subtype="docstring")


def _literal_blocks(app, what, name, obj, options, lines) -> None:
    """The recipes' module docstrings are their ``--help`` prose, written as plain text: a line
    ending in ``:`` before an indented block of commands. Make that block a literal block (``::``),
    as reStructuredText wants, instead of a block quote that breaks at the first continuation
    line. Only the recipes' modules: the library's docstrings are written as reStructuredText."""
    if what != "module" or not name.startswith("recipes."):
        return
    indent = lambda line: len(line) - len(line.lstrip())  # noqa: E731
    for i, line in enumerate(lines[:-2]):
        following = next((later for later in lines[i + 1:] if later.strip()), "")
        if (line.rstrip().endswith(":") and not line.rstrip().endswith("::") and not lines[i + 1].strip()
                and indent(following) > indent(line)):
            lines[i] = line.rstrip() + ":"


def _note_documented(app, what, name, obj, options, lines) -> None:
    app.env.lmrs_documented = getattr(app.env, "lmrs_documented", set()) | {name}


def _resolve(name: str):
    """The object ``name`` names, by attribute first (``lightning_mrs.mrs_norm`` is the function,
    not the module ``lightning_mrs/ops/mrs_norm.py``), importing a submodule only where needed."""
    import importlib

    head, *rest = name.split(".")
    obj = importlib.import_module(head)
    path = head
    for attr in rest:
        path = f"{path}.{attr}"
        try:
            obj = getattr(obj, attr) if hasattr(obj, attr) else importlib.import_module(path)
        except ImportError:
            return None
    return obj


def _check_every_public_name_documented(app, env) -> None:
    """Every name of a public ``__all__`` is on an API page (under any of its names)."""
    documented = {id(_resolve(n)) for n in getattr(env, "lmrs_documented", set())}
    for name in sorted(app.config._lmrs_public):
        if id(_resolve(name)) not in documented:
            _log.warning("%s is public (in __all__) but on no page of docs/api/", name,
                         type="lightning_mrs", subtype="undocumented")


def setup(app):
    app.config._lmrs_public = _public_names()
    app.config._lmrs_public_ids = {id(_resolve(name)): name for name in sorted(app.config._lmrs_public)}
    app.connect("autodoc-process-docstring", _check_docstring)
    app.connect("autodoc-process-docstring", _literal_blocks)
    app.connect("autodoc-process-docstring", _note_documented)
    app.connect("env-check-consistency", _check_every_public_name_documented)
