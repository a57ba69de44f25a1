"""Why the QK-norm stays before the rotary embedding (docs/transformers-attention.md#placement-before-rope).

RoPE (transformers' ``rotate_half``) rotates channel pairs ``(i, i + d/2)``. A norm commutes with
it only if it scales both channels of every rotated pair alike by a factor that the rotation
leaves unchanged: MRSNorm whose phasors *are* RoPE's pairs does (magnitudes are rotation
invariant: the phase preservation of docs/method.md), MRSNorm on adjacent pairs (the method's
pairing) and RMSNorm with per-channel weights do not. So moving a QK-norm after RoPE (e.g. into
transformers' ``AttentionInterface``) would change what the model computes; the swap keeps it
where Qwen3 and Gemma 3 put theirs, before RoPE.
"""

from __future__ import annotations

import pytest
import torch

from helpers.reference import mrs_norm_ref


def _rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """transformers' rotary embedding: ``x * cos + rotate_half(x) * sin`` on ``(..., N, D)``."""
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)  # (N, D): cat(freqs, freqs)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _inputs(d: int = 16, n: int = 7):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, n, d, dtype=torch.float64, generator=g) * 3
    angles = torch.arange(n, dtype=torch.float64)[:, None] * 10000 ** (-torch.arange(d // 2) / (d // 2))  # (N, D/2)
    weight = torch.rand(d // 2, dtype=torch.float64, generator=g) + 0.5
    return x, angles, weight


def test_mrs_on_ropes_pairs_commutes_with_rope():
    x, angles, w = _inputs()
    d = x.shape[-1]
    to_pairs = torch.stack([torch.arange(d // 2), torch.arange(d // 2) + d // 2], dim=1).reshape(-1)  # (i, i + d/2)
    back = torch.argsort(to_pairs)

    def mrs_rope_pairs(t):
        return mrs_norm_ref(t[..., to_pairs], w, 1e-12)[..., back]

    torch.testing.assert_close(mrs_rope_pairs(_rope(x, angles)), _rope(mrs_rope_pairs(x), angles), atol=1e-12, rtol=0)


def test_mrs_on_adjacent_pairs_and_rms_do_not():
    x, angles, w = _inputs()
    after = mrs_norm_ref(_rope(x, angles), w, 1e-12)
    before = _rope(mrs_norm_ref(x, w, 1e-12), angles)
    assert (after - before).abs().max() > 1e-2
    rms_w = w.repeat_interleave(2)

    def rms(t):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True)) * rms_w

    assert (rms(_rope(x, angles)) - _rope(rms(x), angles)).abs().max() > 1e-2


@pytest.mark.parametrize("qk_norm", ["rms", "mrs"])
def test_moving_qwen3s_qk_norms_after_rope_changes_the_model(qk_norm):
    """The same QK-norms applied inside an ``AttentionInterface`` function (after RoPE) instead of
    before it: the logits of a tiny Qwen3 move by tens of percent (printed with ``-s``)."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.qwen3 import modeling_qwen3

    from helpers.hf import tiny_causal_lm, token_batch
    from lightning_mrs import swap_norms

    model = tiny_causal_lm("qwen3").double()
    swap_norms(model, None, qk_norm=qk_norm)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.uniform_(0.5, 2.0, generator=torch.Generator().manual_seed(1))
    ids = token_batch(4, 32)
    with torch.no_grad():
        before = model(ids).logits
    norms = {}
    for layer in model.model.layers:  # the same norms, moved: identity before RoPE, applied in the kernel after it
        attn = layer.self_attn
        norms[id(attn)] = (attn.q_norm, attn.k_norm)
        attn.q_norm, attn.k_norm = torch.nn.Identity(), torch.nn.Identity()

    def after_rope(module, q, k, v, mask, **kwargs):
        q_norm, k_norm = norms[id(module)]
        return modeling_qwen3.eager_attention_forward(module, q_norm(q), k_norm(k), v, mask, **kwargs)

    ALL_ATTENTION_FUNCTIONS.register("lightning_mrs_test_after_rope", after_rope)
    model.config._attn_implementation = "lightning_mrs_test_after_rope"
    with torch.no_grad():
        after = model(ids).logits
    moved = float((after - before).norm() / before.norm())
    print(f"\nQwen3, {qk_norm} QK-norms moved after RoPE: logits move by {moved:.1%}")
    assert moved > 0.05
