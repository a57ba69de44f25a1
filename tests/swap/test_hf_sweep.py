"""Every causal-LM family the installed transformers can build from a small config: its norms
are all recognised or reported, and where they are all RMS (or all LayerNorm) the swap to that
kind reproduces the logits. Families that cannot be built small are listed, not hidden.

Run with ``pytest -m slow tests/swap/test_hf_sweep.py -s`` (a few minutes on 2 cores).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from helpers.hf import FAMILIES, tiny_causal_lm, tiny_config, token_batch, transformers
from lightning_mrs import from_pretrained, norm_spec, swap_norms
from lightning_mrs.swap.probe import looks_like_norm

_MAX_PARAMS = 5_000_000  # a "small config" that still builds more than this is too big to try here


def _build(model_type: str) -> tuple[nn.Module | None, str | None]:
    try:
        with torch.device("meta"):
            meta = transformers.AutoModelForCausalLM.from_config(tiny_config(model_type))
        size = sum(p.numel() for p in meta.parameters())
        if size > _MAX_PARAMS:
            return None, f"{size / 1e6:.0f}M parameters from the small config"
        return tiny_causal_lm(model_type), None
    except Exception as err:  # noqa: BLE001 - the sweep reports every failure to build
        return None, f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:120]}"


@pytest.mark.slow
def test_every_buildable_family_is_swapped_or_reported():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    transformers.logging.set_verbosity_error()
    cannot, found, reproduced = {}, {}, []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        model, why = _build(model_type)
        if model is None:
            cannot[model_type] = why
            continue
        norm_like = {n for n, m in model.named_modules()
                     if norm_spec(m) is not None or (not m._modules and looks_like_norm(m))}
        specs = {n: norm_spec(m) for n, m in model.named_modules() if n in norm_like}
        kinds = {(s.formula.kind if s.formula is not None else s.kind) for s in specs.values() if s is not None}
        tokens = token_batch()
        try:
            with torch.no_grad():
                expected = model(tokens).logits
        except Exception as err:  # noqa: BLE001 - the family's own forward: reported, not ours
            cannot[model_type] = f"its forward fails before any swap: {type(err).__name__}: {str(err)[:100]}"
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = swap_norms(model, "rms" if kinds == {"rms"} else "layer")
        listed = set(report.converted) | set(report.unchanged) | set(report.skipped) | set(report.aliases)
        assert listed == norm_like, model_type  # never silent: every norm is converted or has a reason
        found[model_type] = (len(report.converted) + len(report.unchanged), dict(report.skipped))
        with torch.no_grad():
            logits = model(tokens).logits  # the swapped model runs, whatever it was
        assert torch.isfinite(logits).all(), model_type
        if kinds in ({"rms"}, {"layer"}) and not report.skipped:
            torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4, msg=model_type)
            reproduced.append(model_type)
    print(f"\n{len(found)} families built and swapped, {len(reproduced)} reproduce their logits exactly")
    for model_type, (swapped, skipped) in found.items():
        if skipped:
            reasons = sorted(set(skipped.values()))
            print(f"  {model_type}: {swapped} swapped, {len(skipped)} skipped: {'; '.join(r[:100] for r in reasons)}")
    print(f"{len(cannot)} families cannot be built from a small config here:")
    for model_type, why in cannot.items():
        print(f"  {model_type}: {why}")
    assert set(FAMILIES) <= set(reproduced)


def _holds_what_the_report_says(model: nn.Module, report) -> list[str]:
    """Report equals model, independently of the swap's own check: each converted layer is of the
    class its label names, each added QK-norm is in the forward (scaling its weight moves the logits)."""
    modules = dict(model.named_modules())
    wrong = [n for n, (_, label) in report.changes.items()
             if type(modules[n]).__name__ != label.split("(")[0].replace("+act", "") and
             not (label.startswith("RMSNorm(offset") and type(modules[n]).__name__ == "OffsetRMSNorm")]
    tokens = token_batch()
    with torch.no_grad():
        before = model(tokens).logits
        for name in report.qk_added:
            modules[name].weight.mul_(2.0 + torch.rand_like(modules[name].weight))
        if report.qk_added and torch.allclose(model(tokens).logits, before, atol=1e-6):
            wrong.append("scaling the added QK-norms changes nothing: they are not in the forward")
    return wrong


@pytest.mark.slow
def test_every_family_holds_what_the_report_says_and_round_trips(tmp_path):
    """MRS body and QK-norms on every buildable family: the model holds what the report lists, and
    save_pretrained + lightning_mrs.from_pretrained reproduce its logits bit for bit."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    transformers.logging.set_verbosity_error()
    cannot, problems, round_trips = {}, {}, []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        model, why = _build(model_type)
        if model is None:
            cannot[model_type] = why
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                report = swap_norms(model, "mrs", qk_norm="mrs", eps=1e-6)
                wrong = _holds_what_the_report_says(model, report)
            except Exception as err:  # noqa: BLE001 - a family whose forward fails is reported below
                cannot[model_type] = f"{type(err).__name__}: {str(err).splitlines()[0][:100] if str(err) else ''}"
                continue
        if wrong:
            problems[model_type] = "; ".join(wrong[:3])
            continue
        path = tmp_path / model_type
        try:
            model.save_pretrained(path)
        except Exception as err:  # noqa: BLE001 - transformers' own save of this family
            cannot[model_type] = f"save_pretrained fails: {type(err).__name__}: {str(err)[:80]}"
            continue
        again = from_pretrained(path, attn_implementation=model.config._attn_implementation)
        tokens = token_batch()
        with torch.no_grad():
            if not torch.equal(again.eval()(tokens).logits, model.eval()(tokens).logits):
                problems[model_type] = "the reloaded model's logits differ"
                continue
        round_trips.append(model_type)
    print(f"\n{len(round_trips)} families hold what the report says and round-trip exactly")
    print(f"{len(problems)} families fail a check:")
    for model_type, why in problems.items():
        print(f"  {model_type}: {why}")
    print(f"{len(cannot)} families cannot be built, swapped or saved here")
    assert not problems and set(FAMILIES) <= set(round_trips)


@pytest.mark.slow
def test_every_known_class_agrees_with_the_probe():
    """The classes of lightning_mrs.swap.hf.KNOWN_NORMS, found in the installed transformers,
    are probed to their listed formula (a changed transformers class shows up here)."""
    import importlib
    import pkgutil

    import transformers.models

    from lightning_mrs.swap.hf import KNOWN_NORMS

    families = {m.name.replace("_", ""): m.name for m in pkgutil.iter_modules(transformers.models.__path__)}
    checked = []
    for name, ((kind, weight), _) in KNOWN_NORMS.items():
        family = name.removesuffix("RMSNorm").removesuffix("LayerNorm1P").removesuffix("LayerNorm")
        package = families.get(family.lower().replace("_", ""))
        module = importlib.import_module(f"transformers.models.{package}.modeling_{package}") if package else None
        cls = getattr(module, name, None)
        if cls is None:
            continue  # not in this transformers version
        spec = norm_spec(cls(32))
        assert spec.unsupported is None and (spec.formula.kind, spec.formula.weight) == (kind, weight), name
        checked.append(name)
    print(f"\n{len(checked)} of {len(KNOWN_NORMS)} known classes found and confirmed")
    assert "LlamaRMSNorm" in checked and "GemmaRMSNorm" in checked
