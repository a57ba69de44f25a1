"""The norm registry: every norm class of the zoo maps to the right kind and channel dim."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_mrs.swap.layers as swap_layers
from lightning_mrs import MRSNorm, MRSNorm2d
from lightning_mrs.swap.registry import NormSpec, iter_norm_layers, norm_spec, register_norm

timm_layers = pytest.importorskip("timm.layers")
from timm.layers import norm as tn, norm_act as ta  # noqa: E402
from torchvision.models.convnext import LayerNorm2d as TVLayerNorm2d  # noqa: E402
from torchvision.ops.misc import FrozenBatchNorm2d  # noqa: E402

C = 6
# (factory, kind, channel_dim, spatial, fused_act)
CASES = [
    (lambda: nn.BatchNorm1d(C), "batch", 1, None, False),
    (lambda: nn.BatchNorm2d(C), "batch", 1, None, False),
    (lambda: nn.BatchNorm3d(C), "batch", 1, None, False),
    (lambda: nn.SyncBatchNorm(C), "batch", 1, None, False),
    (lambda: nn.GroupNorm(3, C), "group", 1, True, False),
    (lambda: nn.InstanceNorm1d(C), "instance", 1, True, False),
    (lambda: nn.InstanceNorm2d(C, affine=True), "instance", 1, True, False),
    (lambda: nn.InstanceNorm3d(C), "instance", 1, True, False),
    (lambda: nn.LayerNorm(C), "layer", -1, None, False),
    (lambda: nn.RMSNorm(C), "rms", -1, None, False),
    (lambda: FrozenBatchNorm2d(C), "batch", 1, None, False),
    (lambda: TVLayerNorm2d(C), "layer2d", 1, False, False),
    (lambda: tn.LayerNorm(C), "layer", -1, None, False),
    (lambda: tn.LayerNormFp32(C), "layer", -1, None, False),
    (lambda: tn.LayerNorm2d(C), "layer2d", 1, False, False),
    (lambda: tn.LayerNorm2dFp32(C), "layer2d", 1, False, False),
    (lambda: tn.RmsNorm(C), "rms", -1, None, False),
    (lambda: tn.RmsNormFp32(C), "rms", -1, None, False),
    (lambda: tn.RmsNorm2d(C), "rms2d", 1, False, False),
    (lambda: tn.RmsNorm2dFp32(C), "rms2d", 1, False, False),
    (lambda: tn.SimpleNorm(C), "simple", -1, None, False),
    (lambda: tn.SimpleNorm2d(C), "simple2d", 1, False, False),
    (lambda: tn.GroupNorm(C, num_groups=3), "group", 1, True, False),
    (lambda: tn.GroupNorm1(C), "group", 1, True, False),
    (lambda: ta.BatchNormAct2d(C), "batch", 1, None, True),
    (lambda: ta.FrozenBatchNormAct2d(C), "batch", 1, None, True),
    (lambda: ta.GroupNormAct(C, num_groups=3), "group", 1, True, True),
    (lambda: ta.GroupNorm1Act(C), "group", 1, True, True),
    (lambda: ta.LayerNormAct(C), "layer", -1, None, True),
    (lambda: ta.LayerNormAct2d(C), "layer2d", 1, False, True),
    (lambda: ta.RmsNormAct(C), "rms", -1, None, True),
    (lambda: ta.RmsNormAct2d(C), "rms2d", 1, False, True),
    (lambda: MRSNorm(C), "mrs", -1, None, False),
    (lambda: MRSNorm2d(C, spatial=True), "mrs", 1, True, False),
    (lambda: MRSNorm2d(C, spatial=False), "mrs", 1, False, False),
    (lambda: swap_layers.LayerNorm2d(C), "layer2d", 1, False, False),
    (lambda: swap_layers.RMSNorm2d(C, spatial=True), "rms2d", 1, True, False),
]


@pytest.mark.parametrize("factory,kind,channel_dim,spatial,fused", CASES)
def test_spec_of_known_norms(factory, kind, channel_dim, spatial, fused):
    module = factory()
    spec = norm_spec(module)
    assert spec == NormSpec(kind, C, channel_dim, spatial, fused, None), type(module).__qualname__


@pytest.mark.parametrize("factory,kind,channel_dim,spatial,fused", CASES)
def test_channel_dim_matches_the_layers_own_behaviour(factory, kind, channel_dim, spatial, fused):
    """The layer itself accepts C at ``channel_dim`` and rejects C at the other end."""
    module = factory().double().eval()
    if isinstance(module, nn.SyncBatchNorm):
        pytest.skip("SyncBatchNorm needs a process group to run")
    name = type(module).__name__
    ndim = 3 if name.endswith("1d") else 5 if name.endswith("3d") else 4
    other = (5, 4, 3)[: ndim - 2]
    shape = (2, C, *other) if channel_dim == 1 else (2, *other, C)
    x = torch.randn(shape, dtype=torch.float64)
    assert module(x).shape == x.shape
    if kind == "instance" and not module.affine:
        return  # torch's affine-free InstanceNorm only warns about the channel count
    wrong = torch.randn((2, *other, C) if channel_dim == 1 else (2, C, *other), dtype=torch.float64)
    with pytest.raises((RuntimeError, ValueError)):
        module(wrong)


def test_timm_layernorm2d_is_channels_first_although_a_layernorm():
    assert isinstance(tn.LayerNorm2d(C), nn.LayerNorm)
    assert norm_spec(tn.LayerNorm2d(C)).channel_dim == 1
    assert norm_spec(TVLayerNorm2d(C)).channel_dim == 1


def test_not_norms():
    for module in (nn.Linear(4, 4), nn.Conv2d(3, 4, 1), nn.ReLU(), nn.Identity(), swap_layers.NormAct(MRSNorm(4))):
        assert norm_spec(module) is None


def test_unsupported_norms_carry_a_reason():
    from timm.layers.evo_norm import EvoNorm2dS0
    from timm.layers.filter_response_norm import FilterResponseNormTlu2d
    from timm.layers.grn import GlobalResponseNorm

    for module, kind in [
        (EvoNorm2dS0(8, groups=2), "evo"),
        (FilterResponseNormTlu2d(8), "frn"),
        (GlobalResponseNorm(8), "grn"),
        (nn.LocalResponseNorm(2), "lrn"),
        (nn.LazyBatchNorm2d(), "lazy"),
    ]:
        spec = norm_spec(module)
        assert spec is not None and spec.kind == kind and spec.unsupported, module
    multi = norm_spec(nn.LayerNorm([4, 6]))
    assert multi.kind == "layer" and "multi-dim" in multi.unsupported and multi.num_channels == 6


def test_subclass_inherits_unless_it_overrides_forward():
    class NoBias(tn.LayerNorm2d):  # like timm metaformer's LayerNorm2dNoBias
        pass

    class Permuting(nn.LayerNorm):
        def forward(self, x):
            return super().forward(x.movedim(1, -1)).movedim(-1, 1)

    assert norm_spec(NoBias(C)).kind == "layer2d" and norm_spec(NoBias(C)).channel_dim == 1
    spec = norm_spec(Permuting(C))
    assert spec.kind == "custom" and "register_norm" in spec.unsupported
    register_norm(Permuting, "layer2d", 1, spatial=False)
    assert norm_spec(Permuting(C)) == NormSpec("layer2d", C, 1, False, False, None)


def test_register_norm_validates():
    with pytest.raises(ValueError, match="valid"):
        register_norm(nn.Linear, "bogus", 1)
    with pytest.raises(ValueError, match="channel_dim"):
        register_norm(nn.Linear, "layer", 2)
    with pytest.raises(TypeError):
        register_norm(object, "layer", 1)


def test_iter_norm_layers_names_each_shared_instance_once():
    shared = nn.BatchNorm2d(4)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), shared, nn.Sequential(shared, nn.GroupNorm(2, 4)), nn.ReLU())
    got = [(name, type(m).__name__, spec.kind) for name, m, spec in iter_norm_layers(model)]
    assert got == [("1", "BatchNorm2d", "batch"), ("2.1", "GroupNorm", "group")]
    assert [n for n, _, _ in iter_norm_layers(nn.LayerNorm(4))] == [""]


# ------------------------------------------------------------ who writes the registry
PACKAGE_DIRS = ("lightning_mrs", "callbacks", "recipes")
OWN_LAYERS = {"MRSNorm", "MRSNorm2d", "LayerNorm2d", "RMSNorm2d", "OffsetRMSNorm", "RMSNormHalf", "MRSNormHalf",
              "RMSNormHalfSafe", "MRSNormHalfSafe", "DyT", "DyT2d", "Derf", "Derf2d"}


def test_the_projects_own_layers_go_through_register_norm():
    import ast

    from helpers import ROOT

    # nothing but the registry module touches its private table
    users = sorted(str(p.relative_to(ROOT)) for d in PACKAGE_DIRS for p in (ROOT / d).rglob("*.py")
                   if "_REGISTRY" in p.read_text())
    assert users == ["lightning_mrs/swap/registry.py"]
    tree = ast.parse((ROOT / "lightning_mrs/swap/registry.py").read_text())
    # ... and within it, only register_norm assigns entries; the builtins only setdefault (a user's entry wins)
    for func in [n for n in tree.body if isinstance(n, ast.FunctionDef)]:
        for node in ast.walk(func):
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
                assert func.name == "register_norm" and ast.unparse(node.value) == "_REGISTRY", ast.unparse(node)
            if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "_REGISTRY":
                assert node.attr == "get" or (node.attr == "setdefault" and func.name in ("_add", "_load_builtins"))
    module_level = [ast.unparse(n) for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert not [line for line in module_level if "_REGISTRY" in line and not line.startswith("_REGISTRY: dict")]
    registered = {n.value.args[0].id for n in tree.body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)
                  and ast.unparse(n.value.func) == "register_norm"}
    assert registered == OWN_LAYERS
    for cls in (MRSNorm, MRSNorm2d, swap_layers.LayerNorm2d, swap_layers.RMSNorm2d):  # and they are known
        assert norm_spec(cls(4)) is not None and norm_spec(cls(4)).unsupported is None


_USER_WINS = """
import json
from torch import nn
from timm.layers import norm as tn
from lightning_mrs import norm_spec, register_norm

out = {}
# before the builtins load (they load on the first lookup)
register_norm(nn.GroupNorm, "layer2d", 1, spatial=False)
out["before"] = norm_spec(nn.GroupNorm(2, 4)).kind
# after they loaded: timm's LayerNorm2d has its own builtin entry
out["builtin"] = norm_spec(tn.LayerNorm2d(4)).kind
register_norm(tn.LayerNorm2d, "rms2d", 1, spatial=True)
out["after"] = [norm_spec(tn.LayerNorm2d(4)).kind, norm_spec(tn.LayerNorm2d(4)).spatial]
out["subclass"] = norm_spec(type("Sub", (tn.LayerNorm2d,), {})(4)).kind
print(json.dumps(out))
"""


def test_a_users_entry_for_a_builtin_class_wins_before_and_after_the_builtins_load():
    import json
    import subprocess
    import sys

    from helpers import ROOT

    # a fresh process: the builtins must not have loaded yet
    proc = subprocess.run([sys.executable, "-c", _USER_WINS], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"before": "layer2d", "builtin": "layer2d", "after": ["rms2d", True], "subclass": "rms2d"}
