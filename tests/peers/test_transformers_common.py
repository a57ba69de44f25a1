"""transformers' own save/load tests, run on swapped Llama, Qwen3 and Gemma 3 models.

The suite is ``ModelTesterMixin`` of transformers' ``tests/test_modeling_common.py``, from the
source distribution of the installed transformers, fetched at test time (``pip download
--no-binary :all: --no-deps transformers==<installed>``, cached in pytest's cache) and imported
unchanged. Our side is ``tests/helpers/hf_suite_cases.py``: model testers after transformers'
own, and one test class per family and variant, whose model classes are built swapped
(``swap_norms``) and load through ``lightning_mrs.from_pretrained``; only the save/load tests
(``hf_suite_cases.SELECTED``) run, in one pytest subprocess. The reference is transformers' own
classes (``plain``): a swapped class may fail only where they fail, or where our loader refuses
by design (``REFUSED``).

The sdist holds only the top-level ``tests/*.py``; ``test_modeling_common.py`` also imports two
sibling modules that it does not ship, so this module writes, at test time and outside the
repository, a package whose path is our stand-ins' folder and then the sdist's ``tests/``:

* ``exporters/test_export.py``: ``ExportTesterMixin``, the base class of ``ModelTesterMixin``
  that adds the ``torch.export`` tests; the stand-in is an empty class (it only satisfies the
  import; no export test is selected);
* ``generation/test_utils.py``: ``GenerationTesterMixin``, imported for the generation tests
  of other test modules; the stand-in is an empty class (it only satisfies the import).

``parameterized`` (imported by the suite) is in the ``dev`` extra.

Run it with ``python -m pytest tests/peers/test_transformers_common.py -m slow -p no:randomly``
(one run of 28 tests x 16 classes: 2.5 to 7.5 minutes on two shared CPU cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from helpers.hf_suite_selected import SELECTED, VARIANTS
from helpers.sdist import fetch_sdist

transformers = pytest.importorskip("transformers")
pytest.importorskip("parameterized")  # the suite imports it (the dev extra)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CASES = REPO / "tests" / "helpers" / "hf_suite_cases.py"
PACKAGE = "lmrs_hf_suite"
FAMILIES = ("Llama", "Qwen3", "Gemma3")
RUN_TIMEOUT_S = 1800
_MISSING = "do not fit the norm layers rebuilt from its lightning_mrs record"
#: tests a swapped class fails by design, and the message it fails with (docs/limits.md):
#: every weight of the checkpoint is gone (test_model_weights_reload_no_missing_tied_weights) or the
#: state_dict is empty (test_can_init_all_missing_weights): a swapped norm whose weights are missing
#: is an error naming it, never a silent re-initialisation (transformers re-initialises them);
#: test_load_with_mismatched_shapes loads the saved directory with transformers' plain
#: ``AutoModel*.from_pretrained`` (not the class's) without ``trust_remote_code=True``, which transformers
#: refuses for a custom model (a swapped model saves as one), with its own message.
REFUSED = {
    "test_model_weights_reload_no_missing_tied_weights": _MISSING,
    "test_can_init_all_missing_weights": _MISSING,
    "test_load_with_mismatched_shapes": "contains custom code which must be executed",
}


def _fetch_suite(cache_dir: Path) -> Path:
    """The ``tests/`` folder of the installed transformers' sdist, under ``cache_dir`` (fetched once)."""
    version = transformers.__version__
    tests = cache_dir / f"transformers-{version}" / "tests"
    if (tests / "test_modeling_common.py").is_file():
        return tests
    # Only the tests: without the sdist's src/, the run imports the installed transformers.
    fetch_sdist("transformers", version, cache_dir, lambda name: name.startswith(f"transformers-{version}/tests/"))
    if not (tests / "test_modeling_common.py").is_file():
        pytest.skip(f"the transformers {version} sdist has no tests/test_modeling_common.py")
    return tests


def _package(root: Path, tests: Path) -> Path:
    """``root/lmrs_hf_suite``: the sdist's ``tests/`` as a package, with the two stand-ins (module doc)."""
    pkg = root / PACKAGE
    for sub, name, cls in (("exporters", "test_export", "ExportTesterMixin"),
                           ("generation", "test_utils", "GenerationTesterMixin")):
        (pkg / sub).mkdir(parents=True, exist_ok=True)
        (pkg / sub / "__init__.py").write_text("")
        (pkg / sub / f"{name}.py").write_text(
            f'"""Stand-in: only satisfies test_modeling_common.py\'s import (not in the sdist)."""\n\n\n'
            f"class {cls}:\n    pass\n")
    # our folder first (the stand-ins), then the sdist's tests/ (test_modeling_common.py itself)
    (pkg / "__init__.py").write_text(f"__path__ = [__path__[0], {str(tests)!r}]\n")
    (root / "pytest.ini").write_text("[pytest]\n")  # not the repository's configuration
    return root


@pytest.fixture(scope="module")
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One run of every class: outcomes by (class, test), the loads recorded, the wall time."""
    cache = getattr(request.config, "cache", None)
    cache_dir = cache.mkdir("transformers-sdist") if cache is not None else tmp_path_factory.mktemp("hf-sdist")
    root = _package(tmp_path_factory.mktemp("hf-suite"), _fetch_suite(Path(cache_dir)))
    xml, record = root / "run.xml", root / "loads.jsonl"
    env = dict(os.environ, LMRS_HF_SUITE=PACKAGE, LMRS_HF_RECORD=str(record))
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "pytest", str(CASES), "-c", str(root / "pytest.ini"), f"--rootdir={root}",
           "--noconftest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-W", "ignore",
           f"--junitxml={xml}", "-o", "junit_family=xunit1"]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    wall = time.perf_counter() - start
    assert xml.is_file(), f"the transformers suite wrote no report:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    outcomes: dict[tuple[str, str], tuple[str, str]] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        key = (case.get("classname", "").rpartition(".")[2], case.get("name", ""))
        bad = case.find("failure")
        bad = case.find("error") if bad is None else bad
        if bad is not None:
            outcomes[key] = ("failed", bad.get("message") or "")
        elif case.find("skipped") is not None:
            outcomes[key] = ("skipped", "")
        else:
            outcomes[key] = ("passed", "")
    loads = [json.loads(line) for line in record.read_text().splitlines()] if record.is_file() else []
    return {"outcomes": outcomes, "loads": loads, "wall": wall, "stdout": done.stdout}


def _class(family: str, variant: str) -> str:
    return f"Test{family}_{variant.replace('-', '_')}"


def _of(run: dict, family: str, variant: str) -> dict[str, tuple[str, str]]:
    cls = _class(family, variant)
    return {test: outcome for (c, test), outcome in run["outcomes"].items() if c == cls}


def _counts(outcomes: dict[str, tuple[str, str]]) -> str:
    return ", ".join(f"{sum(o == k for o, _ in outcomes.values())} {k}" for k in ("passed", "failed", "skipped"))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_plain_classes_run_the_suite(run: dict, family: str) -> None:
    """The reference: transformers' own classes, every selected save/load test, mostly passing."""
    plain = _of(run, family, "plain")
    print(f"{family} plain: {_counts(plain)} ({run['wall']:.0f} s for the whole run)")
    assert set(plain) == set(SELECTED), sorted(set(SELECTED) ^ set(plain))
    passed = sum(outcome == "passed" for outcome, _ in plain.values())
    assert passed >= 12, _counts(plain)


@pytest.mark.parametrize("variant", tuple(VARIANTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_swapped_classes_fail_only_where_transformers_does(run: dict, family: str, variant: str) -> None:
    if variant == "mrs-qk" and family != "Llama":
        pytest.skip("Qwen3 and Gemma 3 have QK-norms: the mrs variant swaps them")
    plain, ours = _of(run, family, "plain"), _of(run, family, variant)
    print(f"{family} {variant}: {_counts(ours)} (plain: {_counts(plain)})")
    assert set(ours) == set(plain)
    passed = {t for t, (o, _) in ours.items() if o == "passed"}
    assert passed >= {t for t, (o, _) in plain.items() if o == "passed"} - set(REFUSED), "fewer passes than plain"
    new = {t: msg for t, (o, msg) in ours.items() if o == "failed" and plain[t][0] != "failed"}
    refused = {t for t, msg in new.items() if variant != "loader" and REFUSED.get(t, "\0") in msg}
    detail = "\n".join(f"{t}: {msg[:400]}" for t, msg in sorted(new.items()) if t not in refused)
    assert set(new) == refused, f"fail as {variant} and pass as transformers' classes:\n{detail}"
    # Not vacuous, and nothing silent: the swapped loads came back swapped, as construction builds them.
    loads = [x for x in run["loads"] if x["test"].split("::")[-2:-1] == [_class(family, variant)]]
    recorded = [x for x in loads if x["recorded"]]
    if variant == "loader":
        assert loads and not recorded, "the loader variant swaps nothing"
    else:
        assert len(recorded) >= 20, len(recorded)
    silent = [f"{x['test']} {x['class']}: {x['differ'][:4]}" for x in recorded if x["differ"]]
    assert not silent, "loaded models whose norm layers are not the recorded swap's:\n" + "\n".join(silent)
