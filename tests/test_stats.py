"""lightning_mrs.stats against hand computations and float64 loop references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_mrs.stats import (
    ALL_STAT_NAMES,
    RATIO_CAP,
    STAT_NAMES,
    aggregate_stats,
    layer_stats,
    phasor_grad_rms,
    phasor_sums,
    slot_size,
    weight_grad_stats,
)

TOL = {  # (atol, rtol) of the sums, relative to the float64 reference
    torch.float64: (1e-12, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-5, 1e-5),  # inputs are exactly representable after rounding: sums in fp32
    torch.bfloat16: (1e-5, 1e-5),
}


def stat(stats: torch.Tensor, name: str) -> float:
    return stats[STAT_NAMES.index(name)].item()


def reference_sums(x: torch.Tensor, g: torch.Tensor, channel_dim: int) -> torch.Tensor:
    """Per-phasor sums by explicit loops in float64 (independent of the vectorised code)."""
    cd = channel_dim % x.ndim
    xs = x.double().movedim(cd, -1).reshape(-1, x.shape[cd]).tolist()
    gs = g.double().movedim(cd, -1).reshape(-1, g.shape[cd]).tolist()
    p = x.shape[cd] // 2
    grad_sq, radial_sq, act = [0.0] * p, [0.0] * p, [0.0] * p
    nonfinite = 0
    for xrow, grow in zip(xs, gs):
        for i in range(p):
            ge, go = grow[2 * i], grow[2 * i + 1]
            nonfinite += (not math.isfinite(ge)) + (not math.isfinite(go))
            ge = ge if math.isfinite(ge) else 0.0
            go = go if math.isfinite(go) else 0.0
            xe, xo = xrow[2 * i], xrow[2 * i + 1]
            r = math.hypot(xe, xo)
            grad_sq[i] += ge * ge + go * go
            if r > 0:
                radial_sq[i] += ((ge * xe + go * xo) / r) ** 2
            act[i] += r
    return torch.tensor(grad_sq + radial_sq + act + [len(xs), nonfinite], dtype=torch.float64)


def test_hand_computation_one_layer() -> None:
    # two samples of a 4-channel (2-phasor) channels-last layer, numbers chosen to be exact
    x = torch.tensor([[3.0, 4.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    g = torch.tensor([[3.0, 4.0, 0.0, 2.0], [1.0, 0.0, 0.0, 3.0]])
    sums = phasor_sums(x, g, channel_dim=-1)
    # phasor 0: |g|^2 = 25 + 1 = 26; radial: g.u = (9+16)/5 = 5 -> 25, (0)/2 -> 0 ; act 5 + 2
    # phasor 1: |g|^2 = 4 + 9 = 13; radial: (0*1 + 2*0)/1 = 0, zero input phasor -> 0 ; act 1 + 0
    expected = torch.tensor([26.0, 13.0, 25.0, 0.0, 7.0, 1.0, 2.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(sums.double(), expected)

    stats, g_rms = layer_stats(sums, 2, starved_threshold=0.1)
    torch.testing.assert_close(g_rms, torch.tensor([math.sqrt(13.0), math.sqrt(6.5)], dtype=torch.float64))
    g0, g1 = math.sqrt(13.0), math.sqrt(6.5)
    mean = (g0 + g1) / 2
    assert stat(stats, "grad_mean") == pytest.approx(mean)
    assert stat(stats, "grad_cv") == pytest.approx(abs(g0 - g1) / 2 / mean)  # population std
    assert stat(stats, "grad_max_ratio") == pytest.approx(g0 / mean)  # median of two = their mean
    assert stat(stats, "grad_p50") == pytest.approx(mean)
    assert stat(stats, "grad_p05") == pytest.approx(g1 + 0.05 * (g0 - g1))
    assert stat(stats, "grad_p95") == pytest.approx(g1 + 0.95 * (g0 - g1))
    assert stat(stats, "starved_frac") == 0.0
    assert stat(stats, "radial_frac") == pytest.approx(25.0 / 39.0)
    assert stat(stats, "act_outlier_ratio") == pytest.approx(3.5 / 2.0)  # A = (3.5, 0.5), mean 2
    assert stat(stats, "nonfinite") == 0.0
    assert stat(stats, "count") == 2.0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "shape,channel_dim",
    [((3, 6, 5, 7), 1), ((2, 5, 4), -1), ((1, 2), -1), ((6,), -1), ((2, 10, 3), 1), ((3, 4, 1, 2, 3), 1)],
)
def test_sums_match_float64_loops(shape: tuple[int, ...], channel_dim: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen).to(dtype)
    g = (torch.randn(shape, generator=gen) * 1e-2).to(dtype)
    sums = phasor_sums(x, g, channel_dim)
    assert sums.shape == (slot_size(shape[channel_dim] // 2),)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(sums.double(), reference_sums(x, g, channel_dim), atol=atol, rtol=rtol)


def test_sums_channels_last_memory_format() -> None:
    x = torch.randn(2, 8, 5, 3).to(memory_format=torch.channels_last)
    g = torch.randn(2, 8, 5, 3).to(memory_format=torch.channels_last)
    torch.testing.assert_close(phasor_sums(x, g, 1).double(), reference_sums(x, g, 1), atol=1e-5, rtol=1e-5)


def test_nonfinite_entries_counted_and_excluded() -> None:
    x = torch.randn(4, 6, 3)
    g = torch.randn(4, 6, 3)
    g[0, 1, 2] = float("nan")
    g[3, 4, 0] = float("inf")
    g[2, 5, 1] = float("-inf")
    sums = phasor_sums(x, g, 1)
    ref = reference_sums(x, g, 1)
    torch.testing.assert_close(sums.double(), ref, atol=1e-5, rtol=1e-5)
    stats, g_rms = layer_stats(sums, 3)
    assert stat(stats, "nonfinite") == 3.0
    assert torch.isfinite(stats).all() and torch.isfinite(g_rms).all()


def test_layer_stats_match_numpy_reference() -> None:
    gen = torch.Generator().manual_seed(7)
    p, n = 9, 11
    x = torch.randn(n, 2 * p, generator=gen) * torch.linspace(0.1, 5.0, 2 * p)
    g = torch.randn(n, 2 * p, generator=gen) * torch.linspace(2.0, 0.01, 2 * p)
    ref = reference_sums(x, g, -1).numpy()
    divisor = 8.0
    g_ref = np.sqrt(ref[:p] / n) / divisor
    med = np.median(g_ref)
    act = ref[2 * p : 3 * p] / n
    stats, g_rms = layer_stats(phasor_sums(x, g, -1), p, grad_divisor=divisor, starved_threshold=0.3)
    np.testing.assert_allclose(g_rms.numpy(), g_ref, rtol=1e-5)
    expected = {
        "grad_mean": g_ref.mean(),
        "grad_cv": g_ref.std() / g_ref.mean(),
        "grad_max_ratio": g_ref.max() / med,
        "grad_p05": np.quantile(g_ref, 0.05),
        "grad_p50": med,
        "grad_p95": np.quantile(g_ref, 0.95),
        "starved_frac": np.mean(g_ref < 0.3 * med),
        "radial_frac": ref[p : 2 * p].sum() / ref[:p].sum(),
        "act_outlier_ratio": act.max() / act.mean(),
        "nonfinite": 0.0,
        "count": float(n),
    }
    got = dict(zip(STAT_NAMES, stats.tolist()))
    assert 0 < expected["starved_frac"] < 1  # the data do exercise starvation
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=1e-5), name


def test_scale_invariant_figures_and_unscaled_mean() -> None:
    """Dividing by the GradScaler scale recovers the true level; the shape figures ignore it."""
    x, g = torch.randn(5, 8, 3), torch.randn(5, 8, 3)
    plain, _ = layer_stats(phasor_sums(x, g, 1), 4)
    scaled, _ = layer_stats(phasor_sums(x, g * 1024.0, 1), 4, grad_divisor=1024.0)
    torch.testing.assert_close(scaled, plain)


def test_radial_frac_extremes() -> None:
    x = torch.randn(6, 4)
    radial_only = x * torch.rand(6, 2).repeat_interleave(2, dim=1)  # g_i parallel to x_i
    even, odd = x[:, 0::2], x[:, 1::2]
    tangential = torch.stack([-odd, even], dim=-1).flatten(1)  # g_i perpendicular to x_i
    assert stat(layer_stats(phasor_sums(x, radial_only, -1), 2)[0], "radial_frac") == pytest.approx(1.0)
    assert stat(layer_stats(phasor_sums(x, tangential, -1), 2)[0], "radial_frac") == pytest.approx(0.0, abs=1e-6)


def test_zeros_give_neutral_finite_values() -> None:
    x = torch.zeros(3, 4)
    g = torch.zeros(3, 4)
    stats, g_rms = layer_stats(phasor_sums(x, g, -1), 2)
    got = dict(zip(STAT_NAMES, stats.tolist()))
    assert torch.isfinite(stats).all()
    assert got["grad_mean"] == 0 and got["grad_cv"] == 0 and got["grad_max_ratio"] == 1
    assert got["radial_frac"] == 0 and got["act_outlier_ratio"] == 1 and got["starved_frac"] == 0
    # empty sums (a layer never reached by the gradient)
    empty, _ = layer_stats(torch.zeros(slot_size(3), dtype=torch.float64), 3)
    assert torch.isfinite(empty).all() and stat(empty, "count") == 0


def test_zero_median_and_starved_phasors() -> None:
    # 3 of 4 phasors get no gradient: median 0, the ratio is capped, all 3 are starved
    x = torch.ones(2, 8)
    g = torch.zeros(2, 8)
    g[:, 0] = 1.0
    stats, _ = layer_stats(phasor_sums(x, g, -1), 4)
    assert stat(stats, "grad_max_ratio") == RATIO_CAP
    assert stat(stats, "starved_frac") == 0.75


def test_overflowing_sums_saturate_not_nan() -> None:
    x = torch.randn(2, 4)
    g = torch.full((2, 4), 3e30)  # finite in fp32, square overflows
    stats, g_rms = layer_stats(phasor_sums(x, g, -1), 2)
    assert torch.isfinite(stats).all() and torch.isfinite(g_rms).all()


def test_weight_grad_stats() -> None:
    w = torch.tensor([1.0, -2.0, 3.0, float("nan")])
    stats, nonfinite = weight_grad_stats(w)
    a = np.array([1.0, 2.0, 3.0])
    np.testing.assert_allclose(stats.numpy(), [a.mean(), a.std() / a.mean()])
    assert nonfinite.item() == 1.0


def test_aggregate_stats() -> None:
    gen = torch.Generator().manual_seed(3)
    rows, nph = [], [2, 5, 3]
    for p in nph:
        x, g = torch.randn(4, 2 * p, generator=gen), torch.randn(4, 2 * p, generator=gen)
        g[:, :2] *= 1e-4  # one starved phasor per layer
        rows.append(layer_stats(phasor_sums(x, g, -1), p)[0])
    rows.append(layer_stats(torch.zeros(slot_size(4), dtype=torch.float64), 4)[0])  # no gradient
    table = torch.stack(rows)
    agg = dict(zip(ALL_STAT_NAMES, aggregate_stats(table, torch.tensor(nph + [4])).tolist()))
    live = table[:3]
    col = {n: live[:, STAT_NAMES.index(n)] for n in STAT_NAMES}
    assert agg["layers"] == 3
    assert agg["grad_mean"] == pytest.approx(col["grad_mean"].mean().item())
    assert agg["grad_cv"] == pytest.approx(col["grad_cv"].mean().item())
    assert agg["grad_cv_max"] == pytest.approx(col["grad_cv"].max().item())
    assert agg["grad_max_ratio"] == pytest.approx(col["grad_max_ratio"].max().item())
    assert agg["starved_frac"] == pytest.approx(3 / 10)
    assert agg["radial_frac"] == pytest.approx(col["radial_frac"].mean().item())
    assert agg["act_outlier_ratio"] == pytest.approx(col["act_outlier_ratio"].max().item())


def test_phasor_grad_rms_divisor_and_bad_input() -> None:
    sums = phasor_sums(torch.ones(4, 2), torch.full((4, 2), 3.0), -1)
    assert phasor_grad_rms(sums, 1, grad_divisor=2.0).item() == pytest.approx(math.sqrt(18.0) / 2)
    with pytest.raises(ValueError, match="even"):
        phasor_sums(torch.ones(2, 3), torch.ones(2, 3), -1)
    with pytest.raises(ValueError, match="shapes differ"):
        phasor_sums(torch.ones(2, 4), torch.ones(2, 2), -1)
    with pytest.raises(ValueError, match="out of range"):
        phasor_sums(torch.ones(2, 4), torch.ones(2, 4), 2)
    with pytest.raises(ValueError, match="packed sums"):
        layer_stats(torch.zeros(5), 2)
