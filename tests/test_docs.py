"""The documentation holds together: every relative link of README.md and docs/*.md resolves
(anchors included, by GitHub's heading-slug rule), every guide is reachable from the README, the
code's citations of docs/ pages resolve, the README's install-and-test command is what CI runs,
and the README's Python examples run as written."""

from __future__ import annotations

import re
import shlex
from collections import Counter
from pathlib import Path

import pytest

from helpers import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE_DIRS = ("lightning_mrs", "callbacks", "recipes", "tests", "benchmarks")

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_INLINE_CODE = re.compile(r"`+[^`\n]*`+")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.+?)[ \t#]*$", re.M)
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)
# a citation of a docs page in code: docs/<name>.md, optionally with #anchor
_CITATION = re.compile(r"\bdocs/([\w.-]+\.md)(#[\w-]+)?")


def _prose(text: str) -> str:
    """The Markdown without fenced code blocks and inline code spans (links there are not links)."""
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lower-cased, without punctuation (what
    is not a letter, digit, space, ``-`` or ``_``), each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags render as nothing
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of ``page``; a repeated slug gets ``-1``, ``-2``... as on GitHub."""
    seen: Counter[str] = Counter()
    out = set()
    for match in _HEADING.finditer(_FENCE.sub("", page.read_text())):
        base = slug(match.group(2))
        out.add(base if not seen[base] else f"{base}-{seen[base]}")
        seen[base] += 1
    return out


def links(page: Path) -> list[str]:
    """The targets of the Markdown links and images of ``page``, outside code."""
    return _LINK.findall(_prose(page.read_text()))


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _check_target(source: Path, target: str) -> str | None:
    """Why ``target`` (a relative link in ``source``) does not resolve, or None."""
    path, _, anchor = target.partition("#")
    dest = (source.parent / path).resolve() if path else source
    if not dest.exists():
        return f"{_rel(source)}: link {target!r}: no file {path!r}"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return (f"{_rel(source)}: link {target!r}: {_rel(dest)} has no heading "
                f"with anchor #{anchor} (its anchors: {', '.join(sorted(anchors(dest)))})")
    return None


@pytest.mark.parametrize(
    ("heading", "expected"),
    [
        ("Train: CIFAR-100, digits or your own images", "train-cifar-100-digits-or-your-own-images"),
        ("The paper's claims, as the sweeps test them", "the-papers-claims-as-the-sweeps-test-them"),
        ("Phasor attention (QK-norm)", "phasor-attention-qk-norm"),
        ("`swap_norms`: the same engine", "swap_norms-the-same-engine"),
        ("I ♥ unicode", "i--unicode"),
        ("Привет мир", "привет-мир"),
        ("see [the guide](docs/swap.md)", "see-the-guide"),
    ],
)
def test_slug_follows_githubs_rule(heading: str, expected: str) -> None:
    assert slug(heading) == expected


def test_repeated_headings_get_numbered_anchors(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("# Verdicts\n\n```\n# not a heading\n```\n\n## Verdicts\n\n### Verdicts\n")
    assert anchors(page) == {"verdicts", "verdicts-1", "verdicts-2"}


def test_a_broken_link_and_anchor_are_reported(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("# Top\n\n[ok](#top) [gone](missing.md) [bad](#nowhere) `[code](x.md)`\n")
    assert links(page) == ["#top", "missing.md", "#nowhere"]
    problems = [_check_target(page, t) for t in links(page)]
    assert problems[0] is None and "no file 'missing.md'" in problems[1] and "#nowhere" in problems[2]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    problems = [_check_target(page, t) for t in links(page) if not _SCHEME.match(t)]
    assert not [p for p in problems if p], "\n".join(p for p in problems if p)


def test_every_docs_page_is_reachable_from_the_readme() -> None:
    reached, todo = set(), [ROOT / "README.md"]
    while todo:
        page = todo.pop()
        if page in reached:
            continue
        reached.add(page)
        for target in links(page):
            path = target.partition("#")[0]
            dest = (page.parent / path).resolve() if path and not _SCHEME.match(target) else None
            if dest is not None and dest.suffix == ".md" and dest.exists():
                todo.append(dest)
    orphans = sorted(str(p.relative_to(ROOT)) for p in PAGES if p not in reached)
    assert not orphans, f"docs pages no link from README.md leads to: {orphans}"


def test_code_citations_of_docs_resolve() -> None:
    problems = []
    for top in CODE_DIRS:
        for source in sorted((ROOT / top).rglob("*")):
            if source.suffix not in (".py", ".cpp", ".yaml") or source == Path(__file__).resolve():
                continue
            for line_no, line in enumerate(source.read_text().splitlines(), 1):
                for name, anchor in _CITATION.findall(line):
                    page = ROOT / "docs" / name
                    where = f"{source.relative_to(ROOT)}:{line_no}"
                    if not page.exists():
                        problems.append(f"{where}: cites docs/{name}, which does not exist")
                    elif anchor and anchor[1:] not in anchors(page):
                        problems.append(f"{where}: cites docs/{name}{anchor}: no such heading")
    assert not problems, "\n".join(problems)


def _readme_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", (ROOT / "README.md").read_text(), re.M | re.S)


def test_readme_test_command_is_what_ci_runs() -> None:
    """The README's second command installs and tests as ``.ci/run`` does, step by step."""
    ci = [shlex.split(line) for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.startswith(("pip install", "python "))]
    ci = [[w for w in cmd if w != "-q"] for cmd in ci if "--upgrade" not in cmd]
    commands = [line for block in _readme_blocks("bash") for line in block.splitlines()
                if line.startswith("python3 -m venv") and line.endswith("python -m pytest")]
    assert len(commands) == 1, commands
    steps = [shlex.split(step) for step in commands[0].split(" && ")]
    assert [s for s in steps if s[0] in ("pip", "python")] == ci


@pytest.mark.parametrize("index", range(len(_readme_blocks("python"))))
def test_readme_python_example_runs(index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each Python block of the README runs as written, on its own (its imports included)."""
    monkeypatch.chdir(tmp_path)  # the Trainer example writes lightning_logs/ into the working directory
    block = _readme_blocks("python")[index]
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(block, f"README.md python block {index}", "exec"), namespace)
    if "trainer" in namespace:  # the Trainer example: every norm swapped, the monitor wrote its figures
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        from lightning_mrs import MRSNorm2d

        model = namespace["trainer"].lightning_module
        norms = [m for m in model.modules() if "Norm" in type(m).__name__]
        assert norms and all(isinstance(m, MRSNorm2d) for m in norms), {type(m).__name__ for m in norms}
        acc = EventAccumulator(str(next(tmp_path.glob("lightning_logs/version_*"))))
        acc.Reload()
        assert "phasor/all/grad_cv" in acc.Tags()["scalars"], acc.Tags()["scalars"]
