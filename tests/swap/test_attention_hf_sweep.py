"""QK-norms over every causal-LM family the installed transformers builds from a small config.

Per family (float64): the rewiring alone (``expose_attention``) keeps the logits; with MRS
QK-norms (``eps=1e-12``) every attention layer either got one (added or swapped) or is listed
in ``report.attention_skipped`` (or its own QK-norm in ``report.skipped``); and where the generic ``q_proj``/``k_proj`` rule hooked a
layer, scaling the rows of one query head leaves the logits unchanged (the norm really is per
head, ahead of everything that uses q). Families that fail a check are printed with the reason.

Run with ``pytest -m slow tests/swap/test_attention_hf_sweep.py -s`` (minutes on 2 cores).
"""

from __future__ import annotations

import copy
import gc
import warnings

import pytest
import torch

from helpers.hf import FAMILIES, tiny_causal_lm, tiny_config, token_batch, transformers
from lightning_mrs import expose_attention, swap_norms
from lightning_mrs.swap.attention_info import is_qk_name
from lightning_mrs.swap.qk_hooks import qk_state


_MAX_PARAMS = 5_000_000  # as the norm sweep: a "small config" that builds more is not tried


def _attention_layers(model: torch.nn.Module) -> set[str]:
    """Innermost modules whose class name ends with "Attention" (independent of the swap)."""
    names = {n for n, m in model.named_modules() if type(m).__name__.endswith("Attention")}
    return {n for n in names if not any(o.startswith(f"{n}.") for o in names)}


@pytest.mark.slow
def test_every_buildable_family_gets_qk_norms_or_says_why():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    transformers.logging.set_verbosity_error()
    cannot, problems, covered, skipped = {}, {}, [], {}
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        gc.collect()  # the wrapped projections hold their attention layer: free each family's cycles
        try:
            with torch.device("meta"):
                size = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(
                    tiny_config(model_type)).parameters())
            if size > _MAX_PARAMS:
                cannot[model_type] = f"{size / 1e6:.0f}M parameters from the small config"
                continue
            model = tiny_causal_lm(model_type).double().eval()
            ids = token_batch()
            with torch.no_grad():
                expected = model(ids).logits
        except Exception as err:  # noqa: BLE001 - reported, not ours
            cannot[model_type] = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:100]}"
            continue
        exposed = copy.deepcopy(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expose_attention(exposed)
            report = swap_norms(model, None, qk_norm="mrs", eps=1e-12)
        with torch.no_grad():
            if not torch.allclose(exposed(ids).logits, expected, atol=1e-10, rtol=0):
                problems[model_type] = "exposed model differs from the original"
                continue
            logits = model(ids).logits
            if not torch.isfinite(logits).all():
                problems[model_type] = "non-finite logits with MRS QK-norms"
                continue
            got = {n.rsplit(".", 1)[0] for n in [*report.qk_added, *report.converted] if is_qk_name(n)}
            skipped_norms = {n.rsplit(".", 1)[0] for n in report.skipped if is_qk_name(n)}
            unlisted = _attention_layers(model) - got - set(report.attention_skipped) - skipped_norms
            if unlisted:
                problems[model_type] = f"attention layers neither given a QK-norm nor listed: {sorted(unlisted)[:3]}"
                continue
            wrapped = [(layer._modules[attr], state.wiring.head_dim) for layer in model.modules()
                       if (state := qk_state(layer)) is not None
                       for attr, split in state.wiring.projections.items() if dict(split).get("q", 0) > 1]
            for proj, d in wrapped:  # rows D..2D: query head 1 (or GPT-NeoX's key head 0), its bias too
                rows = slice(d, 2 * d)
                if type(proj).__name__ == "Conv1D":  # GPT-2: weight (in, out), the outputs are its columns
                    proj.weight[:, rows] *= 5.0
                else:
                    proj.weight[rows] *= 5.0
                if proj.bias is not None:
                    proj.bias[rows] *= 5.0
            if wrapped and not torch.allclose(model(ids).logits, logits, atol=1e-7, rtol=1e-7):
                problems[model_type] = "scaling one query head changes the logits: the norm is not per head there"
                continue
        print(model_type, "ok" if got else "no QK-norm", flush=True)
        if got:
            covered.append(model_type)
        if report.attention_skipped:
            skipped[model_type] = sorted(set(report.attention_skipped.values()))
    print(f"\n{len(covered)} families get MRS QK-norms; {len(skipped)} have attention listed as skipped:")
    for model_type, reasons in skipped.items():
        print(f"  {model_type}: {'; '.join(r[:110] for r in reasons)}")
    print(f"{len(problems)} families fail a check:")
    for model_type, why in problems.items():
        print(f"  {model_type}: {why}")
    print(f"{len(cannot)} families cannot be built small or run here (too big, config or forward errors)")
    assert set(FAMILIES) <= set(covered) and not set(FAMILIES) & set(problems)
    assert not problems
