"""``MRSNorm`` / ``MRSNorm2d``: drop-in modules over the functional op - their results, their
signature and errors, and the export paths (``torch.export``, ``torch.jit.trace``,
``torch.jit.script``). Every layout, dtype and backend of the modules is in
``ops/test_layout_matrix.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_mrs import MRSNorm, MRSNorm2d
from helpers.checks import norm_model
from helpers.reference import mrs_norm_ref


@pytest.mark.parametrize("shape", [(5, 8), (2, 7, 64), (3, 4, 5, 6)])
def test_mrsnorm_matches_reference_float64(shape: tuple[int, ...]) -> None:
    norm = MRSNorm(shape[-1], dtype=torch.float64)
    with torch.no_grad():
        norm.weight.uniform_(-2, 2)
    x = torch.randn(shape, dtype=torch.float64)
    torch.testing.assert_close(norm(x), mrs_norm_ref(x, norm.weight.detach()), atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("shape", [(2, 6), (2, 6, 11), (3, 8, 5, 7), (2, 4, 3, 5, 2)])
@pytest.mark.parametrize("spatial", [False, True])
def test_mrsnorm2d_matches_reference_float64(shape: tuple[int, ...], spatial: bool) -> None:
    norm = MRSNorm2d(shape[1], spatial=spatial, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.uniform_(-2, 2)
    x = torch.randn(shape, dtype=torch.float64)
    ref = mrs_norm_ref(x, norm.weight.detach(), channel_dim=1, spatial=spatial)
    torch.testing.assert_close(norm(x), ref, atol=1e-9, rtol=1e-9)


def test_mrsnorm2d_equals_mrsnorm_on_permuted_input() -> None:
    x = torch.randn(2, 8, 3, 5)
    a, b = MRSNorm2d(8), MRSNorm(8)
    with torch.no_grad():
        a.weight.normal_()
        b.weight.copy_(a.weight)
    torch.testing.assert_close(a(x), b(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2))


def test_drop_in_for_layernorm_in_a_transformer_block() -> None:
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    layer.norm1, layer.norm2 = MRSNorm(32), MRSNorm(32)
    x = torch.randn(2, 9, 32)
    layer(x).sum().backward()
    assert layer.norm1.weight.grad is not None and torch.isfinite(layer.norm1.weight.grad).all()


@pytest.mark.parametrize("cls", [MRSNorm, MRSNorm2d])
def test_signature_parameters_and_state_dict(cls: type[nn.Module]) -> None:
    norm = cls(16, eps=1e-5, affine=True, device="cpu", dtype=torch.float64)
    assert norm.weight.shape == (8,) and norm.weight.dtype == torch.float64  # one weight per phasor
    assert list(norm.state_dict()) == ["weight"]
    assert norm.num_channels == 16 and norm.num_phasors == 8 and norm.eps == 1e-5
    with torch.no_grad():
        norm.weight.fill_(3.0)
    norm.reset_parameters()
    assert torch.equal(norm.weight, torch.ones(8, dtype=torch.float64))
    assert "16, eps=1e-05, affine=True" in repr(norm)
    plain = cls(16, affine=False)
    assert plain.weight is None and list(plain.state_dict()) == []
    assert "spatial=True" in repr(MRSNorm2d(4, spatial=True))


def test_meta_device_construction_then_materialised() -> None:
    norm = MRSNorm2d(64, device="meta")
    assert norm.weight.is_meta
    norm.to_empty(device="cpu")
    norm.reset_parameters()
    x = torch.randn(2, 64, 3, 3)
    torch.testing.assert_close(norm(x).double(), mrs_norm_ref(x, channel_dim=1), atol=2e-5, rtol=2e-5)


def test_meta_module_refuses_a_real_input_in_forward() -> None:
    # regression: it used to run without its weight and fail only in the backward
    norm = MRSNorm2d(8, spatial=True, device="meta")
    with pytest.raises(RuntimeError, match=r"MRSNorm2d\(8\): the weight is on the meta device"):
        norm(torch.randn(2, 8, 3, 3))


@pytest.mark.parametrize("cls", [MRSNorm, MRSNorm2d])
@pytest.mark.parametrize("c", [1, 3, 127])
def test_odd_channel_count_explains_the_pairing(cls: type[nn.Module], c: int) -> None:
    with pytest.raises(ValueError, match=rf"{cls.__name__}\({c}\).*pairs.*even"):
        cls(c)


@pytest.mark.parametrize("bad", [0, -4, 2.0, True])
def test_invalid_channel_count(bad: object) -> None:
    with pytest.raises(ValueError, match="num_channels"):
        MRSNorm(bad)


def test_channel_mismatch_names_both_sizes() -> None:
    with pytest.raises(ValueError, match=r"64.*\(2, 3, 32\)"):
        MRSNorm(64)(torch.randn(2, 3, 32))
    with pytest.raises(ValueError, match=r"\(N, 64, \*spatial\).*\(2, 32, 4, 4\)"):
        MRSNorm2d(64)(torch.randn(2, 32, 4, 4))


def test_non_floating_input_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"MRSNorm\(4\) expects a floating-point tensor"):
        MRSNorm(4)(torch.ones(2, 4, dtype=torch.int32))


# --- export ---------------------------------------------------------------------------------
def test_torch_export_runs_the_formula() -> None:
    model = norm_model().eval()
    x = torch.randn(4, 3, 6, 6)
    exported = torch.export.export(model, (x,))
    torch.testing.assert_close(exported.module()(x), model(x), atol=1e-6, rtol=1e-6)


# the TorchScript API is deprecated in favour of torch.export (FutureWarning) and tracing warns
# on the modules' shape checks (static here: the checks hold for every traced input)
@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::torch.jit.TracerWarning")
def test_torch_jit_trace_save_and_load(tmp_path: Path) -> None:
    model = norm_model().eval()
    x = torch.randn(4, 3, 6, 6)
    torch.jit.save(torch.jit.trace(model, x), tmp_path / "model.pt")
    loaded = torch.jit.load(tmp_path / "model.pt")
    torch.testing.assert_close(loaded(x), model(x), atol=1e-6, rtol=1e-6)
    other = torch.randn(2, 3, 6, 6)  # another batch size: the trace recorded no fixed batch
    torch.testing.assert_close(loaded(other), model(other), atol=1e-6, rtol=1e-6)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_torch_jit_script_save_and_load(tmp_path: Path) -> None:
    model = nn.Sequential(norm_model(), nn.Unflatten(1, (2, 8)), MRSNorm2d(2, affine=False, spatial=True)).eval()
    x = torch.randn(4, 3, 6, 6)
    torch.jit.save(torch.jit.script(model), tmp_path / "model.pt")
    loaded = torch.jit.load(tmp_path / "model.pt")
    torch.testing.assert_close(loaded(x), model(x), atol=1e-6, rtol=1e-6)
