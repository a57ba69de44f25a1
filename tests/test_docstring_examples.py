"""Every public name's ``Example:`` runs as written: the docstring examples of each public
package's ``__all__`` (the API reference shows them, docs/api/) are run as doctests, in the
namespace of the module that defines the name."""

from __future__ import annotations

import doctest
import importlib
import inspect
import sys

import pytest

PACKAGES = ("lightning_mrs", "lightning_mrs.swap", "lightning_mrs.ops", "lightning_mrs.callbacks")


def _public() -> dict[str, object]:
    """One entry per public class or function (a name re-exported twice is run once)."""
    seen, out = set(), {}
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            obj = getattr(module, name)
            if (inspect.isclass(obj) or inspect.isroutine(obj)) and id(obj) not in seen:
                seen.add(id(obj))
                out[f"{package}.{name}"] = obj
    return out


PUBLIC = _public()


def test_the_public_api_is_found() -> None:
    assert {"lightning_mrs.MRSNorm", "lightning_mrs.swap_norms", "lightning_mrs.callbacks.NormSwap"} <= set(PUBLIC)


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_docstring_example_runs(name: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # an example that trains writes lightning_logs/ here
    obj = PUBLIC[name]
    globs = dict(vars(sys.modules[obj.__module__]))
    tests = doctest.DocTestFinder(recurse=False).find(obj, name, globs=globs)
    examples = [t for t in tests if t.examples]
    assert examples, f"{name}: no doctest example in its docstring"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in examples:
        runner.run(test)
    assert runner.failures == 0, f"{name}: {runner.failures} of {runner.tries} doctest lines failed (output above)"
