"""BN-only identity branches (RepVGG's ``conv_kxk(x) + conv_1x1(x) + bn(x)``) are folded by a deploy
merge: the identity kernel through the BN is added to the conv, the BN slot becomes
``FoldedIdentity`` (returns a zero the model's sum leaves unchanged), so no BatchNorm remains.

timm's ``repvgg_a0`` kept 17 such BatchNorms after ``reparam.merge``. Equivalence: float64 models
with rel_err <= 1e-12, float32 with a tolerance relative to the output scale.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import reparam
from reparam import FoldedIdentity
from reparam.testing import assert_equivalent, perturb_, randomize_bn_, rel_err

F64 = torch.float64


def _bns(model: nn.Module) -> list[str]:
    return [p for p, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


class RepVggLike(nn.Module):
    """Three-branch block in the style of RepVGG, with a drop-path slot on the conv sum."""

    def __init__(self, c: int, groups: int = 1) -> None:
        super().__init__()
        self.identity = nn.BatchNorm2d(c)
        self.kxk = nn.Sequential(nn.Conv2d(c, c, 3, padding=1, groups=groups, bias=False), nn.BatchNorm2d(c))
        self.one = nn.Sequential(nn.Conv2d(c, c, 1, groups=groups, bias=False), nn.BatchNorm2d(c))
        self.drop_path = nn.Identity()

    def forward(self, x):
        identity = self.identity(x)
        x = self.drop_path(self.one(x) + self.kxk(x))
        x += identity
        return torch.relu(x)


class NotAnIdentity(nn.Module):
    """A BN branch whose input also feeds something else than the sum's conv: the conv output is
    used twice, so folding would change the second use."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(c)
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=True)

    def forward(self, x):
        y = self.conv(x)
        return y + self.bn(x) + 0.5 * y


def _net(groups: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        RepVggLike(8, groups), RepVggLike(8, groups), NotAnIdentity(8),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3),
    )


@pytest.mark.parametrize("groups", [1, 2, 8])
def test_identity_branches_are_found_and_folded(groups) -> None:
    gen = torch.Generator().manual_seed(0)
    model = randomize_bn_(_net(groups).to(F64), gen).eval()
    assert reparam.find_identity_branches(model) == {"3.identity": "3.kxk.0", "4.identity": "4.kxk.0"}
    x = torch.randn(2, 3, 9, 9, generator=gen, dtype=F64)

    # never expanded: merge folds the pairs and the identity branches
    merged = reparam.merge(model)
    assert _bns(merged) == ["5.bn"]  # the BN-only branch that is not an identity of a conv stays
    assert isinstance(merged.get_submodule("3.identity"), FoldedIdentity)
    with torch.no_grad():
        assert rel_err(merged(x), model(x)) <= 1e-12

    # expanded, trained (perturbed), merged
    expanded = perturb_(reparam.expand(model), gen).eval()
    spec = reparam.structure(expanded)
    assert spec["identity_bns"] == {
        "3.identity": {"into": "3.kxk.0", "eps": 1e-5, "folded": False},
        "4.identity": {"into": "4.kxk.0", "eps": 1e-5, "folded": False},
    }
    deploy = reparam.merge(expanded)
    assert _bns(deploy) == ["5.bn"]
    assert reparam.structure(deploy)["identity_bns"]["3.identity"]["folded"] is True
    assert assert_equivalent(deploy, expanded, x) <= 1e-12
    # idempotent
    again = reparam.merge(deploy)
    assert assert_equivalent(again, deploy, x) <= 1e-15


def test_state_dict_route_and_build_match_the_module_route() -> None:
    gen = torch.Generator().manual_seed(1)
    model = randomize_bn_(_net().to(F64), gen).eval()
    expanded = perturb_(reparam.expand(model), gen).eval()
    spec = json.loads(json.dumps(reparam.structure(expanded)))
    deploy = reparam.merge(expanded)
    sd = reparam.merge_state_dict(expanded.state_dict(), spec)
    assert set(sd) == set(deploy.state_dict())
    built = reparam.build(copy.deepcopy(model), spec, form="deploy")
    built.load_state_dict(sd, strict=True)
    x = torch.randn(2, 3, 9, 9, generator=gen, dtype=F64)
    assert assert_equivalent(built, deploy, x) <= 1e-12


def test_rep_to_local_takes_the_folded_identity_out_of_the_target() -> None:
    """A local expanded model keeps its identity BN; REP from a deploy global (identity folded into
    the conv) must not count the identity twice."""
    gen = torch.Generator().manual_seed(2)
    model = randomize_bn_(_net().to(F64), gen).eval()
    global_deploy = reparam.merge(perturb_(reparam.expand(model), gen).eval())
    local = perturb_(reparam.expand(model), torch.Generator().manual_seed(9)).eval()
    reparam.rep_to_local(global_deploy, local)
    x = torch.randn(2, 3, 9, 9, generator=gen, dtype=F64)
    assert assert_equivalent(local, global_deploy, x) <= 1e-12


def test_stride_or_channel_change_is_not_an_identity() -> None:
    class Strided(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(8, 8, 3, stride=2, padding=1)
            self.bn = nn.BatchNorm2d(8)
            self.pool = nn.AvgPool2d(2)

        def forward(self, x):
            return self.conv(x) + self.pool(self.bn(x))

    assert reparam.find_identity_branches(Strided().eval()) == {}


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_timm_repvgg_a0_has_no_batchnorm_after_merge(timm_module, dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    model = timm_module.create_model("repvgg_a0", pretrained=False, num_classes=10).to(dtype)
    expanded = perturb_(reparam.expand(model), gen).eval()
    assert len(reparam.structure(expanded)["identity_bns"]) == 17
    merged = reparam.merge(expanded)
    assert _bns(merged) == []
    assert not any(isinstance(m, reparam.DiverseBranchBlock) for m in merged.modules())
    x = torch.randn(2, 3, 64, 64, generator=gen, dtype=dtype)
    tol = 1e-12 if dtype == F64 else 1e-5
    assert assert_equivalent(merged, expanded, x, rtol=tol) <= tol
    # the never-expanded model merges to the same plain form
    plain = reparam.merge(randomize_bn_(copy.deepcopy(model), gen).eval())
    assert _bns(plain) == []
