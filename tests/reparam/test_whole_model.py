"""Whole-model API: expand, merge, structure/build, state dicts, rep_to_local, the report of every
conv left plain, BatchNorms with a built-in activation. Equality: bit-exact for expansion, float64 rel_err <= 1e-10 for merges."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import reparam
from reparam import DiverseBranchBlock
from reparam.errors import NotMergeableError, ReparamError, ReparamModeError
from reparam.testing import randomize_bn_, rel_err

F64 = torch.float64


class Net(nn.Module):
    """Dense, grouped, depthwise, 1x1 and bias-only convs; a residual add; a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn0 = nn.BatchNorm2d(8)
        self.body = nn.Sequential(
            nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 16, 3, 2, 1, groups=2, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        )
        self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False)
        self.dw_bn = nn.BatchNorm2d(16)
        self.proj = nn.Conv2d(16, 8, 1, bias=False)
        self.proj_bn = nn.BatchNorm2d(8)
        self.head_conv = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        x = F.relu(self.bn0(self.stem(x)))
        x = self.body(x)
        x = F.relu(self.dw_bn(self.dw(x)) + x)
        x = self.proj_bn(self.proj(x))
        x = F.relu(self.head_conv(x))
        return self.fc(x.mean((2, 3)))


class Untraceable(Net):
    """Same network with data-dependent control flow: torch.fx cannot trace it."""

    def forward(self, x):
        if x.sum() > -1e30:
            return super().forward(x)
        return x  # pragma: no cover


def make(cls=Net, gen=None) -> nn.Module:
    torch.manual_seed(0)
    m = cls().double()
    randomize_bn_(m, gen or torch.Generator().manual_seed(0))
    return m


def inputs(gen, n=2, hw=(10, 9)):
    return torch.randn(n, 3, *hw, generator=gen, dtype=F64)


def perturb_(model, gen):
    randomize_bn_(model, gen)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, reparam.IdentityBasedConv1x1):
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen, dtype=m.weight.dtype) * 0.2)
    return model


def assert_bit_exact(a: nn.Module, b: nn.Module, x) -> None:
    for train in (True, False):
        ma, mb = copy.deepcopy(a).train(train), copy.deepcopy(b).train(train)
        for _ in range(2):
            assert torch.equal(ma(x), mb(x))
        sa = {k: v for k, v in ma.state_dict().items() if "running" in k}
        flat_b = {}
        for _path, blk in reparam.iter_blocks(mb):
            if blk.bn_path:
                for k, v in blk.branches["kxk"].bn.state_dict().items():
                    flat_b[f"{blk.bn_path}.{k}"] = v
        for k, v in mb.state_dict().items():
            if "running" in k and ".branches." not in k:
                flat_b[k] = v
        for k, v in sa.items():
            assert torch.equal(v, flat_b[k]), k


# ------------------------------------------------------------------------------------------ expand


@pytest.mark.parametrize("cls", [Net, Untraceable])
def test_expand_is_bit_exact_and_pairs_follow_dataflow(cls, gen) -> None:
    model = make(cls)
    scan = reparam.find_conv_bn_pairs(model, example_input=inputs(gen))
    assert scan.method == ("fx" if cls is Net else "probe")
    assert scan.convs == {
        "stem": "bn0", "body.0": "body.1", "body.3": "body.4", "dw": "dw_bn", "proj": "proj_bn", "head_conv": None
    }
    x = inputs(gen)
    expanded = reparam.expand(model, example_input=x)
    blocks = dict(reparam.iter_blocks(expanded))
    assert set(blocks) == {"stem", "body.0", "body.3", "dw", "head_conv"}
    assert isinstance(expanded.bn0, nn.Identity) and isinstance(expanded.body[1], nn.Identity)
    assert isinstance(expanded.proj, nn.Conv2d) and isinstance(expanded.proj_bn, nn.BatchNorm2d)  # 1x1: default filter
    assert blocks["head_conv"].mode == "conv" and blocks["stem"].mode == "conv_bn"
    assert blocks["stem"].bn_path == "bn0" and blocks["dw"].branch_names == ["kxk", "1x1_kxk", "1x1_avg", "identity"]
    assert_bit_exact(model, expanded, x)
    assert isinstance(model.stem, nn.Conv2d)  # the input model is untouched (deep copy)


class Shuffled(nn.Module):
    """BNs registered in an order that does not match the data flow (DyRep's convert_to_dbb pairs
    a conv with the next BatchNorm sibling)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_a = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn_b = nn.BatchNorm2d(4)
        self.conv_b = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn_a = nn.BatchNorm2d(4)
        self.conv_c = nn.Conv2d(4, 4, 3, padding=1, bias=False)  # output used twice: no pair
        self.bn_c = nn.BatchNorm2d(4)

    def forward(self, x):
        x = F.relu(self.bn_a(self.conv_a(x)))
        x = F.relu(self.bn_b(self.conv_b(x)))
        y = self.conv_c(x)
        return self.bn_c(y) + y


def test_pairs_follow_dataflow_not_registration_order(gen) -> None:
    model = Shuffled().double()
    randomize_bn_(model, gen)
    x = torch.randn(2, 4, 7, 7, generator=gen, dtype=F64)
    expanded = reparam.expand(model)
    blocks = dict(reparam.iter_blocks(expanded))
    assert blocks["conv_a"].bn_path == "bn_a" and blocks["conv_b"].bn_path == "bn_b"
    assert "conv_c" not in blocks  # no bias and its output has two consumers: left and reported
    assert "conv_c" in reparam.structure(expanded)["skipped"]
    assert isinstance(expanded.bn_c, nn.BatchNorm2d)
    assert_bit_exact(model, expanded, x)


def test_plan_mapping_callable_and_globs(gen) -> None:
    model = make()
    x = inputs(gen)
    e1 = reparam.expand(model, plan={"stem": ["kxk", "1x1"], "proj": ["kxk", "1x1_kxk"]})
    blocks = dict(reparam.iter_blocks(e1))
    assert set(blocks) == {"stem", "proj"}
    assert blocks["stem"].branch_names == ["kxk", "1x1"] and blocks["proj"].branch_names == ["kxk", "1x1_kxk"]
    assert_bit_exact(model, e1, x)
    seen = []

    def plan(path, conv, bn):
        seen.append((path, bn is not None))
        return "all" if path.startswith("body") else None

    e2 = reparam.expand(model, plan=plan)
    assert set(dict(reparam.iter_blocks(e2))) == {"body.0", "body.3"}
    assert ("head_conv", False) in seen and ("stem", True) in seen
    e3 = reparam.expand(model, include="body.*", exclude=["body.3"])
    assert set(dict(reparam.iter_blocks(e3))) == {"body.0"}
    with pytest.raises(ReparamError, match="not plain Conv2d"):
        reparam.expand(model, plan={"nope": ["kxk"]})
    with pytest.raises(TypeError):
        reparam.expand(model, plan=3)


def test_unexpandable_convs_are_reported_or_raise_when_requested(gen) -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1)).double()
    expanded = reparam.expand(model)
    spec = reparam.structure(expanded)
    assert list(spec["blocks"]) == ["2"]
    assert "bias" in spec["skipped"]["0"]
    with pytest.raises(NotMergeableError, match="0:.*bias"):
        reparam.expand(model, plan={"0": None, "2": None} | {"0": ["kxk", "1x1"]})
    allowed = reparam.expand(model, allow_new_bias=True)
    assert set(dict(reparam.iter_blocks(allowed))) == {"0", "2"}
    x = torch.randn(2, 3, 6, 6, generator=gen, dtype=F64)
    assert_bit_exact(model, allowed, x)


def test_expand_inplace_and_second_expand_is_noop(gen) -> None:
    model = make()
    same = reparam.expand(model, inplace=True)
    assert same is model and isinstance(model.stem, DiverseBranchBlock)
    before = copy.deepcopy(model)
    again = reparam.expand(model)
    assert str(again) == str(before)
    assert [p for p, _ in reparam.iter_blocks(again)] == [p for p, _ in reparam.iter_blocks(before)]


def test_calibrated_expansion_of_bias_convs(gen) -> None:
    model = nn.Sequential(
        nn.Conv2d(3, 8, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(8 * 4 * 4, 3),
    ).double()
    batches = [torch.randn(4, 3, 12, 12, generator=gen, dtype=F64) for _ in range(2)]
    expanded = reparam.expand(model, anchor_norm="calibrated", calibration_input=batches)
    blocks = dict(reparam.iter_blocks(expanded))
    assert set(blocks) == {"0", "3"} and all(b.anchor_norm == "calibrated" for b in blocks.values())
    x = torch.randn(2, 3, 12, 12, generator=gen, dtype=F64)
    expanded.eval()
    with torch.no_grad():
        assert rel_err(expanded(x), model(x)) <= 1e-10
    with pytest.raises(ReparamError, match="calibration_input"):
        reparam.expand(model, anchor_norm="calibrated")


# ------------------------------------------------------------------------------------------ merge


def _n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def _bn_after_conv(model: nn.Module) -> list[str]:
    return list(reparam.find_conv_bn_pairs(model).pairs)


def test_merge_deploy_and_host_targets(gen) -> None:
    model = make()
    x = inputs(gen)
    expanded = perturb_(reparam.expand(model), gen).eval()
    with torch.no_grad():
        y = expanded(x)
    deploy = reparam.merge(expanded)
    assert not any(isinstance(m, DiverseBranchBlock) for m in deploy.modules())
    assert _bn_after_conv(deploy) == [] and not any(isinstance(m, nn.BatchNorm2d) for m in deploy.modules())
    assert _n_params(deploy) == _n_params(reparam.merge(model.eval()))
    host = reparam.merge(expanded, target="host")
    assert set(host.state_dict()) == set(model.state_dict())
    fresh = Net().double()
    fresh.load_state_dict(host.state_dict(), strict=True)
    fresh.eval()
    with torch.no_grad():
        assert rel_err(deploy(x), y) <= 1e-10
        assert rel_err(host(x), y) <= 1e-10
        assert rel_err(fresh(x), y) <= 1e-10
        assert expanded(x).shape == y.shape and torch.equal(expanded(x), y)  # the input is untouched
    # idempotent, and a merged model keeps its flags
    again = reparam.merge(deploy)
    assert str(again) == str(deploy)
    with torch.no_grad():
        assert torch.equal(again(x), deploy(x))
    assert not deploy.training


def test_merge_requires_eval_mode(gen) -> None:
    expanded = reparam.expand(make()).train()
    with pytest.raises(ReparamModeError, match="eval"):
        reparam.merge(expanded)
    merged = reparam.merge(expanded, require_eval=False)
    assert merged.training
    with pytest.raises(ReparamError, match="target"):
        reparam.merge(expanded.eval(), target="plain")


def test_merge_inplace_and_timm_style_reparameterize(gen) -> None:
    model = make()
    x = inputs(gen)
    expanded = perturb_(reparam.expand(model), gen).eval()
    with torch.no_grad():
        y = expanded(x)
    alias = copy.deepcopy(expanded)
    for m in alias.modules():  # what timm.utils.reparameterize_model does
        if hasattr(m, "reparameterize"):
            m.reparameterize()
    merged = reparam.merge(expanded, inplace=True)
    assert merged is expanded
    with torch.no_grad():
        assert rel_err(merged(x), y) <= 1e-10
        assert rel_err(alias(x), y) <= 1e-10
    deploy = reparam.merge(alias)  # deployed blocks merge too
    assert not any(isinstance(m, DiverseBranchBlock) for m in deploy.modules())
    with torch.no_grad():
        assert rel_err(deploy(x), y) <= 1e-10


# ------------------------------------------------------------------------------------------ structure


def test_structure_build_round_trip(gen) -> None:
    model = make()
    expanded = reparam.expand(model, plan=lambda p, c, b: "all" if max(c.kernel_size) > 1 else ["kxk", "1x1_kxk"])
    dict(reparam.iter_blocks(expanded))["stem"].grow_nested("kxk", ["1x1"])
    perturb_(expanded, gen)
    spec = reparam.structure(expanded)
    spec = json.loads(json.dumps(spec))
    assert spec["format"] == "reparam.ModelSpec" and spec["version"] == 1
    assert spec["blocks"]["stem"]["nested"]["kxk"]["branches"] == {"kxk": {}, "1x1": {}}
    rebuilt = reparam.build(Net().double(), spec)
    assert str(rebuilt) == str(expanded)
    assert list(rebuilt.state_dict()) == list(expanded.state_dict())
    rebuilt.load_state_dict(expanded.state_dict(), strict=True)
    x = inputs(gen)
    for train in (False, True):
        with torch.no_grad():
            assert torch.equal(copy.deepcopy(rebuilt).train(train)(x), copy.deepcopy(expanded).train(train)(x))
    assert reparam.structure(rebuilt) == spec
    with pytest.raises(ReparamError, match="already"):
        reparam.build(rebuilt, spec)
    with pytest.raises(ReparamError, match="format"):
        reparam.build(Net(), {"blocks": {}})


def test_deploy_checkpoint_loads_into_deploy_built_model(gen) -> None:
    expanded = perturb_(reparam.expand(make()), gen).eval()
    spec = reparam.structure(expanded)
    deploy = reparam.merge(expanded)
    built = reparam.build(Net().double(), spec, form="deploy")
    built.load_state_dict(deploy.state_dict(), strict=True)
    x = inputs(gen)
    with torch.no_grad():
        assert torch.equal(built.eval()(x), deploy(x))


def test_merge_state_dict_detect_form_and_prefixes(gen) -> None:
    model = make()
    model.proj_bn.eps = 1e-3  # an unexpanded pair with a non-default eps: recorded in the spec
    expanded = perturb_(reparam.expand(model), gen).eval()
    spec = reparam.structure(expanded)
    assert spec["pair_eps"] == {"proj_bn": 1e-3}
    sd = {f"module._orig_mod.{k}": v for k, v in expanded.state_dict().items()}
    assert reparam.detect_form(sd) == "train"
    deploy_sd = reparam.merge_state_dict(sd, spec, target="deploy")
    host_sd = reparam.merge_state_dict(sd, spec, target="host")
    deploy = reparam.merge(expanded)
    host = reparam.merge(expanded, target="host")
    assert set(deploy_sd) == set(deploy.state_dict()) and set(host_sd) == set(host.state_dict())
    for k, v in deploy.state_dict().items():
        assert rel_err(deploy_sd[k], v) <= 1e-12, k
    for k, v in host.state_dict().items():
        assert rel_err(host_sd[k].to(F64), v.to(F64)) <= 1e-12, k
    assert reparam.detect_form(deploy_sd, spec) == "deploy"
    assert reparam.detect_form(host_sd, spec) == "plain"
    assert reparam.strip_prefixes({"module.a": 1, "module.b": 2}) == {"a": 1, "b": 2}
    assert reparam.strip_prefixes({"module.a": 1, "b": 2}) == {"module.a": 1, "b": 2}


# ------------------------------------------------------------------------------------------ rep_to_local


def test_rep_to_local_matches_global_and_keeps_local_branches(gen) -> None:
    plain = make()
    x = inputs(gen)
    # a "global" model: trained differently, merged to deploy form
    other = perturb_(reparam.expand(plain, branches="all"), torch.Generator().manual_seed(99)).eval()
    global_model = reparam.merge(other)
    # a local model with its own structure and branch statistics, built from the deploy form
    local = reparam.expand(global_model, plan=lambda p, c, b: ["kxk", "1x1", "1x1_kxk"] if p != "dw" else None)
    perturb_(local, gen)
    keep = {k: v.clone() for k, v in local.state_dict().items() if ".branches." in k and ".branches.kxk." not in k}
    change = reparam.rep_to_local(global_model, local)
    assert change.added == [] and change.removed == [] and change.overwritten
    for k, v in local.state_dict().items():
        if k in keep:
            assert torch.equal(v, keep[k]), k
    local.eval()
    with torch.no_grad():
        assert rel_err(local(x), global_model(x)) <= 1e-10
    # a state dict with a DDP prefix works the same; train-form globals are refused
    reparam.rep_to_local({f"module.{k}": v for k, v in global_model.state_dict().items()}, local)
    with pytest.raises(ReparamError, match="train form"):
        reparam.rep_to_local(other, local)


def test_rep_to_local_from_host_form_adopts_bn_statistics(gen) -> None:
    plain = make()
    x = inputs(gen)
    global_host = reparam.merge(perturb_(reparam.expand(plain), torch.Generator().manual_seed(5)).eval(), target="host")
    local = perturb_(reparam.expand(plain, branches=["kxk", "1x1_kxk"]), gen)
    reparam.rep_to_local(global_host, local, anchor_stats="adopt")
    stem = dict(reparam.iter_blocks(local))["stem"]
    assert torch.equal(stem.branches["kxk"].bn.running_var, global_host.bn0.running_var)
    local.eval()
    with torch.no_grad():
        assert rel_err(local(x), global_host(x)) <= 1e-10


def test_rep_to_local_unfolds_into_unexpanded_local_pairs(gen) -> None:
    plain = make()
    x = inputs(gen)
    global_model = reparam.merge(perturb_(reparam.expand(plain), torch.Generator().manual_seed(3)).eval())
    local = perturb_(reparam.expand(plain, include="body.*"), gen)  # stem, dw, proj keep their BNs
    assert isinstance(local.bn0, nn.BatchNorm2d)
    stats = local.bn0.running_var.clone()
    reparam.rep_to_local(global_model, local)
    assert torch.equal(local.bn0.running_var, stats)
    local.eval()
    with torch.no_grad():
        assert rel_err(local(x), global_model(x)) <= 1e-10


def test_expand_bare_conv_and_sequential(gen) -> None:
    conv = nn.Conv2d(4, 4, 3, padding=1).double()
    block = reparam.expand(conv)
    assert isinstance(block, DiverseBranchBlock) and block.mode == "conv" and isinstance(conv, nn.Conv2d)
    x = torch.randn(2, 4, 6, 6, generator=gen, dtype=F64)
    assert torch.equal(block(x), conv(x))
    seq = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU()).double()
    randomize_bn_(seq, gen)
    expanded = reparam.expand(seq)
    assert isinstance(expanded[0], DiverseBranchBlock) and isinstance(expanded[1], nn.Identity)
    assert_bit_exact(seq, expanded, x)


# ------------------------------------------------------------------------------ every plain conv is reported


class ConvNeXtLike(nn.Module):
    """ConvNeXt's block shape: a 7x7 depthwise conv, a norm, 1x1 convs; plus a 3x3 stem."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.stem_bn = nn.BatchNorm2d(8)
        self.dw = nn.Conv2d(8, 8, 7, padding=3, groups=8)
        self.bn = nn.BatchNorm2d(8)
        self.pw1 = nn.Conv2d(8, 16, 1)
        self.pw2 = nn.Conv2d(16, 8, 1)

    def forward(self, x):
        x = self.stem_bn(self.stem(x))
        return x + self.pw2(F.gelu(self.pw1(self.bn(self.dw(x)))))


def test_every_conv_left_plain_is_listed_with_its_reason(gen) -> None:
    model = ConvNeXtLike().double()
    expanded = reparam.expand(model)
    spec = reparam.structure(expanded)
    assert set(spec["blocks"]) == {"stem"}
    assert set(spec["skipped"]) == {"dw", "pw1", "pw2"}
    assert "7x7 kernel" in spec["skipped"]["dw"] and "up to 5x5" in spec["skipped"]["dw"]
    assert "1x1 kernel" in spec["skipped"]["pw1"]
    convs = {p for p, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    assert convs == set(spec["blocks"]) | set(spec["skipped"])
    # filters and plans report too
    spec = reparam.structure(reparam.expand(model, exclude="stem"))
    assert "exclude" in spec["skipped"]["stem"]
    spec = reparam.structure(reparam.expand(model, include="dw*"))
    assert "include" in spec["skipped"]["stem"] and "7x7 kernel" in spec["skipped"]["dw"]
    spec = reparam.structure(reparam.expand(model, plan={"dw": ["kxk", "1x1"]}))
    assert set(spec["blocks"]) == {"dw"} and spec["skipped"]["stem"] == "not named in the plan"
    spec = reparam.structure(reparam.expand(model, plan=lambda path, conv, bn: None))
    assert set(spec["skipped"]) == convs and "returned None" in spec["skipped"]["stem"]
    # an explicitly planned large kernel is expanded (and merges exactly)
    big = reparam.expand(model, plan={"dw": ["kxk", "1x1", "identity"]})
    randomize_bn_(big, gen)
    x = torch.randn(2, 3, 9, 9, generator=gen, dtype=F64)
    assert reparam.testing.assert_equivalent(reparam.merge(big.eval()), big, x) <= 1e-12


class BatchNormAct2d(nn.BatchNorm2d):
    """What timm's norm+activation layer looks like: a BatchNorm subclass with ``drop`` and ``act``."""

    def __init__(self, n: int, act: bool) -> None:
        super().__init__(n)
        self.drop = nn.Identity()
        self.act = nn.ReLU() if act else nn.Identity()

    def forward(self, x):
        return self.act(self.drop(super().forward(x)))


def test_a_batchnorm_with_an_activation_inside_is_never_folded(gen) -> None:
    """Folding conv + BatchNormAct2d(ReLU) into one conv dropped the ReLU (timm regnet, cspnet,
    efficientnet merged with rel_err ~1). Such a layer now pairs with its conv: the block absorbs the
    BN, the activation stays after it (a NormActTail at the BN's path), and a host merge puts it back
    into the BN; a norm+activation layer with identity act is a plain BN."""
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), BatchNormAct2d(8, act=True),
        nn.Conv2d(8, 8, 3, padding=1, bias=False), BatchNormAct2d(8, act=False),
    ).double()
    randomize_bn_(model, gen)
    scan = reparam.find_conv_bn_pairs(model)
    assert scan.pairs == {"0": "1", "2": "3"} and scan.norm_act == {"1"}
    expanded = reparam.expand(model)
    spec = reparam.structure(expanded)
    assert set(spec["blocks"]) == {"0", "2"} and not spec["skipped"] and spec["pairs"] == {}
    assert isinstance(expanded[1], reparam.NormActTail) and isinstance(expanded[1].act, nn.ReLU)
    x = torch.randn(2, 3, 8, 8, generator=gen, dtype=F64)
    assert_bit_exact(model, expanded, x)
    randomize_bn_(expanded, gen)
    merged = reparam.merge(expanded.eval())
    assert not [m for m in merged.modules() if isinstance(m, nn.BatchNorm2d)]
    assert isinstance(merged[1], reparam.NormActTail)
    assert reparam.testing.assert_equivalent(merged, expanded, x) <= 1e-12
    host = reparam.merge(expanded, target="host")
    assert type(host[1]) is BatchNormAct2d and isinstance(host[1].act, nn.ReLU)
    model.load_state_dict(host.state_dict(), strict=True)
    assert reparam.testing.assert_equivalent(host, expanded, x) <= 1e-12
    with pytest.raises(NotMergeableError, match="act=ReLU"):
        DiverseBranchBlock.from_conv(nn.Conv2d(3, 8, 3, padding=1, bias=False), BatchNormAct2d(8, act=True))


def test_timm_models_with_norm_act_layers_merge_exactly(timm_module, gen) -> None:
    for name in ("regnetx_002", "efficientnet_b0"):
        model = timm_module.create_model(name, pretrained=False, num_classes=10).double()
        expanded = reparam.testing.perturb_(reparam.expand(model, allow_new_bias=True), gen).eval()
        assert dict(reparam.iter_blocks(expanded)), name
        x = torch.randn(2, 3, 32, 32, generator=gen, dtype=F64)
        assert reparam.testing.assert_equivalent(reparam.merge(expanded), expanded, x) <= 1e-12, name
