"""The project's import graph: no cycle anywhere, and a core that needs only torch.

Every ``import`` of a project module (the package, its callbacks, the recipes) is collected from
the source, module-level and function-level alike (a lazy import that closes a cycle is still a
cycle); the callbacks folder is read as ``lightning_mrs.callbacks``, the name it installs under.
"""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import ROOT

SOURCES = {"lightning_mrs": ROOT / "lightning_mrs", "lightning_mrs.callbacks": ROOT / "callbacks",
           "recipes": ROOT / "recipes"}


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def _imports(path: Path, module: str, known: set[str]) -> set[str]:
    """The project modules ``module`` imports (``from pkg import sub`` counts as ``sub``)."""
    is_package = path.name == "__init__.py"
    base = module if is_package else module.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import
                anchor = base.rsplit(".", node.level - 1)[0] if node.level > 1 else base
                origin = f"{anchor}.{node.module}" if node.module else anchor
            else:
                origin = node.module or ""
            for alias in node.names:
                sub = f"{origin}.{alias.name}"
                targets.add(sub if sub in known else origin)
    return {t for t in targets if t in known and t != module}


def _roots(path: Path) -> set[str]:
    """The top-level packages a source file imports (absolute imports, any depth in the file)."""
    tree = ast.parse(path.read_text())
    roots = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    return roots | {(node.module or "").split(".")[0] for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and not node.level}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, set(modules)) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle, or ``[]``: a depth-first search for a back edge."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = 2
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_the_graph_is_read_from_every_module() -> None:
    graph = _graph()
    assert "lightning_mrs.ops.library" in graph and "lightning_mrs.callbacks.norm_swap" in graph
    assert "lightning_mrs.ops.reference" in graph["lightning_mrs.ops.library"]
    assert "recipes.sweeps.claims.engine" in graph["recipes.sweeps.kinds.norm"]  # the recipes, subpackages too
    assert "recipes.sweeps.records" in graph["recipes.sweeps.claims.engine"]
    assert "recipes.vision.classifier" in graph["recipes.cifar100"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the search works


def test_no_import_cycle_anywhere() -> None:
    # a package's __init__ re-exporting its modules is not a cycle unless a module imports it back
    assert _cycle(_graph()) == []


def test_no_recipe_module_imports_an_entry_script() -> None:
    # the scripts a user runs are only that: what two of them share lives in recipes/common, text, vision
    entries = {"recipes.cifar100", "recipes.lm", "recipes.stress", "recipes.export_hf"}
    assert entries <= set(_modules())
    importers = {name: sorted(targets & entries) for name, targets in _graph().items() if targets & entries}
    assert importers == {}


def test_the_core_imports_no_lightning() -> None:
    for name, path in _modules().items():
        if name.startswith(("lightning_mrs.callbacks", "recipes")):
            continue
        assert not _roots(path) & {"lightning", "pytorch_lightning", "torchmetrics"}, name


def test_lightning_mrs_never_imports_transformers() -> None:
    """Importing the core and swapping a model leave transformers unloaded (the optional ``[hf]``
    extra: HF norm classes are recognised by name and probing); no module of the package, the
    callbacks included, imports it. (Lightning's torchmetrics imports transformers when it is
    installed, so importing the callbacks loads it; that is not ours.)"""
    import subprocess
    import sys

    code = (
        "import sys, torch; import lightning_mrs; from lightning_mrs import swap_norms\n"
        "swap_norms(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)), 'mrs')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout
    for name, path in _modules().items():
        if name.startswith("recipes"):  # the LM recipe builds transformers models: it needs the [hf] extra
            continue
        assert "transformers" not in _roots(path), name
