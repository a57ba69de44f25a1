"""The properties of MRSNorm that docs/method.md derives, checked on the implementation."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_mrs import mrs_norm, mrs_scale
from helpers.reference import rms_norm_ref


@pytest.mark.parametrize("channel_dim,spatial", [(-1, False), (1, False), (1, True)])
def test_phase_of_every_phasor_is_preserved(channel_dim, spatial):
    torch.manual_seed(0)
    shape = (3, 10) if channel_dim == -1 else (3, 10, 4, 5)
    x = torch.randn(shape, dtype=torch.float64)
    w = torch.rand(5, dtype=torch.float64) + 0.1  # g_i > 0
    y = mrs_norm(x, w, channel_dim=channel_dim, spatial=spatial)

    def angles(t):
        t = t.movedim(channel_dim, -1)
        return torch.atan2(t[..., 1::2], t[..., 0::2])

    torch.testing.assert_close(angles(y), angles(x), atol=1e-12, rtol=0)


@pytest.mark.parametrize("a", [1e-3, 0.5, 7.0, 1e4])
@pytest.mark.parametrize("channel_dim,spatial", [(-1, False), (1, False), (1, True)])
def test_scale_invariance(a, channel_dim, spatial):
    torch.manual_seed(1)
    shape = (4, 12) if channel_dim == -1 else (2, 12, 3, 3)
    x = torch.randn(shape, dtype=torch.float64)
    eps = 1e-24  # invariance holds up to eps: keep it negligible against (a*x)^2
    y1 = mrs_norm(x, eps=eps, channel_dim=channel_dim, spatial=spatial)
    y2 = mrs_norm(a * x, eps=eps, channel_dim=channel_dim, spatial=spatial)
    torch.testing.assert_close(y1, y2, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("num_channels", [2, 6, 64])
def test_scale_gradient_has_norm_one_over_p_for_every_phasor(num_channels):
    """dS/dz_i = u_i / P: the same norm 1/P for every phasor, whatever its magnitude."""
    torch.manual_seed(2)
    p = num_channels // 2
    x = torch.randn(num_channels, dtype=torch.float64)
    x[:2] *= 1e3  # an outlier phasor
    x[2:4] *= 1e-3 if num_channels > 2 else 1.0  # and a tiny one
    x.requires_grad_()
    mrs_scale(x, eps=1e-18).sum().backward()
    per_phasor = x.grad.reshape(p, 2).norm(dim=-1)  # (P,)
    torch.testing.assert_close(per_phasor, torch.full_like(per_phasor, 1 / p), atol=1e-9, rtol=1e-9)


def test_scale_is_bounded_by_sqrt2_rms():
    torch.manual_seed(3)
    x = torch.randn(200, 32, dtype=torch.float64) * torch.rand(200, 1, dtype=torch.float64) * 10
    s = mrs_scale(x, eps=1e-14).squeeze(-1)  # (200,)
    rms = x.pow(2).mean(-1).sqrt()  # (200,)
    assert (s <= math.sqrt(2) * rms * (1 + 1e-12)).all()


def test_outlier_crushes_other_phasors_less_than_rmsnorm():
    c = 64
    x = torch.ones(c, dtype=torch.float64)
    x[0] = 1e3  # one outlier channel
    y_mrs = mrs_norm(x)
    y_rms = rms_norm_ref(x)
    # the ordinary channels keep far more of their signal under MRS (linear, not quadratic)
    assert (y_mrs[2:] / y_rms[2:]).min() > 3.0
    # and the closed forms: S = (r_0 + (P - 1) sqrt(2)) / P, RMS = sqrt((1e6 + C - 1) / C)
    s = (math.hypot(1e3, 1) + 31 * math.sqrt(2)) / 32
    assert y_mrs[5].item() == pytest.approx(1 / s, rel=1e-6)
    assert y_rms[5].item() == pytest.approx(1 / math.sqrt((1e6 + 63) / 64), rel=1e-6)


def test_radial_direction_is_not_blocked():
    """Unlike z/|z|, the Jacobian keeps a non-zero radial component for each phasor."""
    torch.manual_seed(4)
    x = torch.randn(8, dtype=torch.float64)
    jac = torch.autograd.functional.jacobian(lambda t: mrs_norm(t, eps=1e-14), x)  # (8, 8)
    for i in range(4):
        u = torch.zeros(8, dtype=torch.float64)
        u[2 * i : 2 * i + 2] = x[2 * i : 2 * i + 2] / x[2 * i : 2 * i + 2].norm()
        radial_response = (jac @ u)[2 * i : 2 * i + 2]
        assert radial_response.norm() > 1e-3  # squashing would give exactly 0 here
    # the whole-vector scale direction is the only null direction (scale invariance)
    assert torch.linalg.matrix_rank(jac, atol=1e-9) == 7
