"""timm's own model tests, run on swapped models.

The suite is timm's ``tests/test_models.py`` from the source distribution of the installed
timm, fetched at test time (``pip download --no-binary :all: --no-deps timm==<installed>``,
cached in pytest's cache) and run unchanged in a pytest subprocess, once as it is (the
baseline) and once per target with every model passed through ``swap_norms(model, target)``
right after ``create_model`` (``tests/helpers/timm_suite_plugin.py``). The reference is the
unswapped run: a swapped run may fail only where the baseline fails.

Run it with ``python -m pytest tests/peers/test_timm_suite.py -m slow -p no:randomly``
(360 tests a run; the unswapped run took 26 minutes on two shared CPU cores, so the four runs
take about 1.5 hours there; ``docs/development.md``).
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

from helpers.sdist import fetch_sdist

timm = pytest.importorskip("timm")
pytest.importorskip("torchvision")  # the suite's fx tests use torchvision's feature extraction

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

# One small variant per architecture (tiny test_* models where timm has them), chosen to cover
# every norm family a timm model carries: BatchNorm(Act), LayerNorm, LayerNorm2d, GroupNorm,
# RmsNorm (with QK-norms: vit_base_patch16_xp_224), EvoNorm, GRN. test_nfnet has no norm at all:
# the control that a model with nothing to swap runs the same.
MODELS = [
    "resnet18", "convnext_atto", "convnextv2_atto", "vit_tiny_patch16_224", "deit_tiny_patch16_224",
    "swin_tiny_patch4_window7_224", "swinv2_cr_tiny_ns_224", "efficientnet_b0", "regnetx_002",
    "mobilenetv3_small_050", "maxvit_rmlp_pico_rw_256", "coatnet_pico_rw_224", "levit_128s",
    "eva02_tiny_patch14_224", "beit_base_patch16_224", "poolformer_s12", "hiera_tiny_224", "fastvit_t8",
    "edgenext_xx_small", "gcvit_xxtiny", "vit_base_patch16_xp_224", "test_vit4", "test_efficientnet_gn",
    "test_efficientnet_evos", "test_efficientnet_ln", "test_mambaout", "tiny_vit_5m_224", "test_nfnet",
    "xcit_nano_12_p16_224", "repvit_m0_9",
]
# LMRS_TIMM_SUITE_MODELS=a,b,c runs a subset (a quick check); the default is the list above.
MODELS = [m for m in os.environ.get("LMRS_TIMM_SUITE_MODELS", "").split(",") if m] or MODELS
NO_NORMS = {"test_nfnet"} & set(MODELS)
# Models whose every norm the swap refuses by design, each layer named in report.skipped with this
# reason (and warned): EvoNorm has no faithful MRS, RMS or LayerNorm replacement.
ALL_SKIPPED = {m: "EvoNorm learns its own non-linearity" for m in ("test_efficientnet_evos",) if m in MODELS}
RUN_TIMEOUT_S = 1800  # one run of the suite; a hung test is stopped by its own pytest-timeout


def _fetch_suite(cache_dir: Path) -> Path:
    """The ``tests/`` folder of the installed timm's sdist, under ``cache_dir`` (fetched once)."""
    version = timm.__version__
    suite = cache_dir / f"timm-{version}"
    if (suite / "tests" / "test_models.py").is_file():
        return suite
    # Only the tests and the pytest config: without the sdist's timm/ package, the run imports
    # the installed timm (the one whose models are swapped), not the source tree.
    return fetch_sdist("timm", version, cache_dir, lambda name: name.startswith(f"timm-{version}/tests/")
                       or name == f"timm-{version}/pyproject.toml")


@pytest.fixture(scope="module")
def suite(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = getattr(request.config, "cache", None)
    cache_dir = cache.mkdir("timm-sdist") if cache is not None else tmp_path_factory.mktemp("timm-sdist")
    return _fetch_suite(Path(cache_dir))


def _run_suite(suite: Path, target: str, out: Path) -> dict:
    """Run the suite with ``target`` swapped in; return outcomes, swap records and wall time."""
    xml, record = out / f"{target}.xml", out / f"{target}.jsonl"
    env = dict(os.environ, LMRS_TIMM_TARGET=target, LMRS_TIMM_MODELS=",".join(MODELS),
               LMRS_TIMM_RECORD=str(record))
    # This checkout's lightning_mrs and the plugin (tests/helpers) first on the path.
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "pytest", "tests/test_models.py", "-p", "helpers.timm_suite_plugin",
           "-q", "-p", "no:cacheprovider", "-p", "no:randomly", f"--junitxml={xml}",
           "-o", "junit_family=xunit1"]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=suite, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    wall = time.perf_counter() - start
    assert xml.is_file(), f"the timm suite ({target}) wrote no report:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    outcomes = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        bad = case.find("failure")
        bad = case.find("error") if bad is None else bad
        if bad is not None:
            outcomes[case.get("name")] = ("failed", (bad.get("message") or "")[:300])
        elif case.find("skipped") is not None:
            outcomes[case.get("name")] = ("skipped", "")
        else:
            outcomes[case.get("name")] = ("passed", "")
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    return {"outcomes": outcomes, "header": lines[0], "builds": lines[1:], "wall": wall, "stdout": done.stdout}


@pytest.fixture(scope="module")
def baseline(suite: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _run_suite(suite, "none", tmp_path_factory.mktemp("timm-suite"))


def _failed(run: dict) -> set[str]:
    return {name for name, (outcome, _) in run["outcomes"].items() if outcome == "failed"}


def test_the_baseline_runs_the_suite(baseline: dict) -> None:
    """The reference run: the installed timm, every selected model, mostly passing."""
    assert Path(baseline["header"]["timm"]) == Path(timm.__file__)
    built = {b["model"].split(".")[0] for b in baseline["builds"]}
    assert built == set(MODELS), f"never built: {sorted(set(MODELS) - built)}"
    no_norms = {m for m in MODELS if all(b["norms"] == 0 for b in baseline["builds"] if b["model"] == m)}
    assert no_norms == NO_NORMS
    passed = sum(outcome == "passed" for outcome, _ in baseline["outcomes"].values())
    assert passed >= 0.8 * len(baseline["outcomes"]) >= 8 * len(MODELS), (passed, len(baseline["outcomes"]))


@pytest.mark.parametrize("target", ["mrs", "rms", "layer"])
def test_swapped_models_fail_only_where_timm_does(
    target: str, suite: Path, baseline: dict, tmp_path_factory: pytest.TempPathFactory
) -> None:
    run = _run_suite(suite, target, tmp_path_factory.mktemp(f"timm-suite-{target}"))
    print(f"timm suite, {target}: {len(run['outcomes'])} tests in {run['wall']:.0f} s")
    assert Path(run["header"]["lightning_mrs"]).is_relative_to(REPO), run["header"]
    assert run["header"]["target"] == target
    # Not vacuous: the same tests ran, and every model with a norm came back swapped.
    assert set(run["outcomes"]) == set(baseline["outcomes"])
    # A model whose norms all are the target already (LayerNorms under "layer", timm's RmsNorm
    # under "rms": test_vit4) is left as it is; the report lists those norms as "unchanged".
    swapped = {b["model"].split(".")[0] for b in run["builds"] if b["converted"] + b["unchanged"] > 0}
    expected = set(MODELS) - NO_NORMS - set(ALL_SKIPPED)
    assert swapped == expected, f"not swapped: {sorted(expected - swapped)}; swapped though refused: {sorted(swapped - expected)}"
    for b in run["builds"]:
        reason = ALL_SKIPPED.get(b["model"].split(".")[0])
        if reason is not None:
            assert len(b["skipped"]) == b["norms"] > 0 and all(reason in why for why in b["skipped"].values()), b
    silent = {f"{b['test']} {b['model']}: {b['silent']}" for b in run["builds"] if b["silent"]}
    assert not silent, "norm layers left unswapped and unreported:\n" + "\n".join(sorted(silent))
    new = sorted(_failed(run) - _failed(baseline))
    detail = "\n".join(f"{name}: {run['outcomes'][name][1]}" for name in new)
    assert not new, f"{len(new)} tests fail swapped to {target!r} and pass unswapped:\n{detail}"
