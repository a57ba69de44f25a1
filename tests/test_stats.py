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
    WEIGHT_STAT_NAMES,
    PhasorSums,
    aggregate_stats,
    layer_stats,
    phasor_sums,
    weight_grad_stats,
)

TOL = {  # (atol, rtol) of the sums, relative to the float64 reference
    torch.float64: (1e-12, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-5, 1e-5),  # inputs are exactly representable after rounding: sums in fp32
    torch.bfloat16: (1e-5, 1e-5),
}


def stat(stats: dict[str, torch.Tensor], name: str) -> float:
    return stats[name].item()


def as_float64(sums: PhasorSums) -> dict[str, torch.Tensor]:
    return {k: v.double() for k, v in sums.as_dict().items()}


def reference_sums(x: torch.Tensor, g: torch.Tensor, channel_dim: int) -> dict[str, torch.Tensor]:
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
    f64 = torch.float64
    return {
        "grad_sq": torch.tensor(grad_sq, dtype=f64), "radial_sq": torch.tensor(radial_sq, dtype=f64),
        "act_abs": torch.tensor(act, dtype=f64), "count": torch.tensor(float(len(xs)), dtype=f64),
        "nonfinite": torch.tensor(float(nonfinite), dtype=f64),
    }


def test_hand_computation_one_layer() -> None:
    # two samples of a 4-channel (2-phasor) channels-last layer, numbers chosen to be exact
    x = torch.tensor([[3.0, 4.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    g = torch.tensor([[3.0, 4.0, 0.0, 2.0], [1.0, 0.0, 0.0, 3.0]])
    sums = phasor_sums(x, g, channel_dim=-1)
    # phasor 0: |g|^2 = 25 + 1 = 26; radial: g.u = (9+16)/5 = 5 -> 25, (0)/2 -> 0 ; act 5 + 2
    # phasor 1: |g|^2 = 4 + 9 = 13; radial: (0*1 + 2*0)/1 = 0, zero input phasor -> 0 ; act 1 + 0
    f64 = torch.float64
    expected = {
        "grad_sq": torch.tensor([26.0, 13.0], dtype=f64), "radial_sq": torch.tensor([25.0, 0.0], dtype=f64),
        "act_abs": torch.tensor([7.0, 1.0], dtype=f64), "count": torch.tensor(2.0, dtype=f64),
        "nonfinite": torch.tensor(0.0, dtype=f64),
    }
    torch.testing.assert_close(as_float64(sums), expected)

    stats, g_rms = layer_stats(sums, starved_threshold=0.1)
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
    assert stat(stats, "finite") == 8.0  # 2 samples x 4 channels
    assert set(stats) == set(STAT_NAMES)


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
    assert sums.num_phasors == shape[channel_dim] // 2
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(as_float64(sums), reference_sums(x, g, channel_dim), atol=atol, rtol=rtol)


def test_sums_channels_last_memory_format() -> None:
    x = torch.randn(2, 8, 5, 3).to(memory_format=torch.channels_last)
    g = torch.randn(2, 8, 5, 3).to(memory_format=torch.channels_last)
    torch.testing.assert_close(as_float64(phasor_sums(x, g, 1)), reference_sums(x, g, 1), atol=1e-5, rtol=1e-5)


def test_nonfinite_entries_counted_and_excluded() -> None:
    x = torch.randn(4, 6, 3)
    g = torch.randn(4, 6, 3)
    g[0, 1, 2] = float("nan")
    g[3, 4, 0] = float("inf")
    g[2, 5, 1] = float("-inf")
    sums = phasor_sums(x, g, 1)
    ref = reference_sums(x, g, 1)
    torch.testing.assert_close(as_float64(sums), ref, atol=1e-5, rtol=1e-5)
    stats, g_rms = layer_stats(sums)
    assert stat(stats, "nonfinite") == 3.0 and stat(stats, "finite") == 4 * 6 * 3 - 3
    assert all(v.isfinite() for v in stats.values()) and torch.isfinite(g_rms).all()


def test_all_nonfinite_gradient_has_no_finite_entry() -> None:
    """Every entry NaN/Inf: ``finite == 0`` marks the (neutral) gradient figures as meaningless."""
    x = torch.randn(3, 4, 2)
    g = torch.full((3, 4, 2), float("nan"))
    g[0, 0, 0] = float("inf")
    stats, _ = layer_stats(phasor_sums(x, g, 1))
    assert stat(stats, "nonfinite") == 24.0 and stat(stats, "finite") == 0.0 and stat(stats, "count") == 6.0


def test_layer_stats_match_numpy_reference() -> None:
    gen = torch.Generator().manual_seed(7)
    p, n = 9, 11
    x = torch.randn(n, 2 * p, generator=gen) * torch.linspace(0.1, 5.0, 2 * p)
    g = torch.randn(n, 2 * p, generator=gen) * torch.linspace(2.0, 0.01, 2 * p)
    ref = {k: v.numpy() for k, v in reference_sums(x, g, -1).items()}
    divisor = 8.0
    g_ref = np.sqrt(ref["grad_sq"] / n) / divisor
    med = np.median(g_ref)
    act = ref["act_abs"] / n
    stats, g_rms = layer_stats(phasor_sums(x, g, -1), grad_divisor=divisor, starved_threshold=0.3)
    np.testing.assert_allclose(g_rms.numpy(), g_ref, rtol=1e-5)
    expected = {
        "grad_mean": g_ref.mean(),
        "grad_cv": g_ref.std() / g_ref.mean(),
        "grad_max_ratio": g_ref.max() / med,
        "grad_p05": np.quantile(g_ref, 0.05),
        "grad_p50": med,
        "grad_p95": np.quantile(g_ref, 0.95),
        "starved_frac": np.mean(g_ref < 0.3 * med),
        "radial_frac": ref["radial_sq"].sum() / ref["grad_sq"].sum(),
        "act_outlier_ratio": act.max() / act.mean(),
        "nonfinite": 0.0,
        "finite": float(n * 2 * p),
        "count": float(n),
    }
    got = {k: v.item() for k, v in stats.items()}
    assert 0 < expected["starved_frac"] < 1  # the data do exercise starvation
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=1e-5), name


def test_scale_invariant_figures_and_unscaled_mean() -> None:
    """Dividing by the GradScaler scale recovers the true level; the shape figures ignore it."""
    x, g = torch.randn(5, 8, 3), torch.randn(5, 8, 3)
    plain, _ = layer_stats(phasor_sums(x, g, 1))
    scaled, _ = layer_stats(phasor_sums(x, g * 1024.0, 1), grad_divisor=1024.0)
    torch.testing.assert_close(scaled, plain)


def test_radial_frac_extremes() -> None:
    x = torch.randn(6, 4)
    radial_only = x * torch.rand(6, 2).repeat_interleave(2, dim=1)  # g_i parallel to x_i
    even, odd = x[:, 0::2], x[:, 1::2]
    tangential = torch.stack([-odd, even], dim=-1).flatten(1)  # g_i perpendicular to x_i
    assert stat(layer_stats(phasor_sums(x, radial_only, -1))[0], "radial_frac") == pytest.approx(1.0)
    assert stat(layer_stats(phasor_sums(x, tangential, -1))[0], "radial_frac") == pytest.approx(0.0, abs=1e-6)


def test_zeros_give_neutral_finite_values() -> None:
    x = torch.zeros(3, 4)
    g = torch.zeros(3, 4)
    stats, g_rms = layer_stats(phasor_sums(x, g, -1))
    got = {k: v.item() for k, v in stats.items()}
    assert all(math.isfinite(v) for v in got.values())
    assert got["grad_mean"] == 0 and got["grad_cv"] == 0 and got["grad_max_ratio"] == 1
    assert got["radial_frac"] == 0 and got["act_outlier_ratio"] == 1 and got["starved_frac"] == 0
    # empty sums (a layer never reached by the gradient)
    empty, _ = layer_stats(PhasorSums.zeros(3))
    assert all(v.isfinite() for v in empty.values()) and stat(empty, "count") == 0 and stat(empty, "finite") == 0


def test_zero_median_and_starved_phasors() -> None:
    # 3 of 4 phasors get no gradient: median 0, the ratio is capped, all 3 are starved
    x = torch.ones(2, 8)
    g = torch.zeros(2, 8)
    g[:, 0] = 1.0
    stats, _ = layer_stats(phasor_sums(x, g, -1))
    assert stat(stats, "grad_max_ratio") == RATIO_CAP
    assert stat(stats, "starved_frac") == 0.75


def test_overflowing_sums_saturate_not_nan() -> None:
    x = torch.randn(2, 4)
    g = torch.full((2, 4), 3e30)  # finite in fp32, square overflows
    stats, g_rms = layer_stats(phasor_sums(x, g, -1))
    assert all(v.isfinite() for v in stats.values()) and torch.isfinite(g_rms).all()


def test_weight_grad_stats() -> None:
    w = torch.tensor([1.0, -2.0, 3.0, float("nan")])
    stats = {k: v.item() for k, v in weight_grad_stats(w).items()}
    a = np.array([1.0, 2.0, 3.0])
    assert tuple(stats) == WEIGHT_STAT_NAMES
    np.testing.assert_allclose([stats["wgrad_mean"], stats["wgrad_cv"]], [a.mean(), a.std() / a.mean()])
    assert stats["wgrad_nonfinite"] == 1.0 and stats["wgrad_finite"] == 3.0
    assert weight_grad_stats(torch.full((3,), float("inf")))["wgrad_finite"].item() == 0.0


def test_aggregate_stats() -> None:
    gen = torch.Generator().manual_seed(3)
    rows, nph = [], [2, 5, 3]
    for p in nph:
        x, g = torch.randn(4, 2 * p, generator=gen), torch.randn(4, 2 * p, generator=gen)
        g[:, :2] *= 1e-4  # one starved phasor per layer
        rows.append(layer_stats(phasor_sums(x, g, -1))[0])
    rows.append(layer_stats(PhasorSums.zeros(4))[0])  # no gradient
    nan_sums = phasor_sums(torch.randn(4, 6), torch.full((4, 6), float("nan")), -1)
    rows.append(layer_stats(nan_sums)[0])  # every gradient entry NaN: only its count goes in
    agg = {k: v.item() for k, v in aggregate_stats(rows, nph + [4, 3]).items()}
    assert tuple(agg) == ALL_STAT_NAMES
    col = {n: torch.stack([r[n] for r in rows[:3]]) for n in STAT_NAMES}
    assert agg["layers"] == 3
    assert agg["grad_mean"] == pytest.approx(col["grad_mean"].mean().item())
    assert agg["grad_cv"] == pytest.approx(col["grad_cv"].mean().item())
    assert agg["grad_cv_max"] == pytest.approx(col["grad_cv"].max().item())
    assert agg["grad_max_ratio"] == pytest.approx(col["grad_max_ratio"].max().item())
    assert agg["starved_frac"] == pytest.approx(3 / 10)
    assert agg["radial_frac"] == pytest.approx(col["radial_frac"].mean().item())
    assert agg["act_outlier_ratio"] == pytest.approx(col["act_outlier_ratio"].max().item())
    assert agg["nonfinite"] == 24.0
    with pytest.raises(ValueError, match="3 rows but 2 phasor counts"):
        aggregate_stats(rows[:3], nph[:2])


def test_phasor_sums_add_and_validate() -> None:
    x1, g1, x2, g2 = (torch.randn(3, 8, 2) for _ in range(4))
    both = phasor_sums(torch.cat([x1, x2]), torch.cat([g1, g2]), 1)
    added = phasor_sums(x1, g1, 1) + phasor_sums(x2, g2, 1)  # sums over a split batch add up
    torch.testing.assert_close(added.as_dict(), both.as_dict())
    assert (PhasorSums.zeros(4) + added.to(torch.float64)).count.item() == 12
    with pytest.raises(ValueError, match=r"grad_sq \(3,\), radial_sq \(2,\)"):
        PhasorSums(torch.zeros(3), torch.zeros(2), torch.zeros(3), torch.zeros(()), torch.zeros(()))


def test_apply_flat_runs_once_and_restores_names() -> None:
    """The monitor's one-collective / one-copy helper (torch only, lives with the capture)."""
    from lightning_mrs.callbacks.capture import apply_flat

    named = {("a", "v"): torch.arange(3.0), ("b", "s"): torch.tensor(5.0), ("c", "m"): torch.ones(2, 2)}
    calls = []

    def fn(flat: torch.Tensor) -> torch.Tensor:
        calls.append(flat.shape)
        return flat * 10

    out = apply_flat(named, fn, torch.float64)
    assert calls == [torch.Size([8])]
    assert list(out) == list(named)
    for key, v in named.items():
        torch.testing.assert_close(out[key], v.double() * 10)
    assert apply_flat({}, fn) == {}


def test_grad_divisor_and_bad_input() -> None:
    sums = phasor_sums(torch.ones(4, 2), torch.full((4, 2), 3.0), -1)
    assert layer_stats(sums, grad_divisor=2.0)[1].item() == pytest.approx(math.sqrt(18.0) / 2)  # G_0
    with pytest.raises(ValueError, match="even"):
        phasor_sums(torch.ones(2, 3), torch.ones(2, 3), -1)
    with pytest.raises(ValueError, match="shapes differ"):
        phasor_sums(torch.ones(2, 4), torch.ones(2, 2), -1)
    with pytest.raises(ValueError, match="out of range"):
        phasor_sums(torch.ones(2, 4), torch.ones(2, 4), 2)
