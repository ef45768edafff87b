"""Whole-model round trips on third-party architectures (torchvision, timm) and the model zoo.

expand -> bit-exact (train and eval, running statistics included) -> randomise every BN ->
merge (deploy and host) -> equality (float64 rel_err <= 1e-9, float32 <= 1e-4) -> no BatchNorm
after a conv, parameter count of the folded original -> structure spec rebuilds the same module
tree and loads the state dict strictly. No pretrained weights; 2x3x32x32 inputs.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import reparam
from reparam import DiverseBranchBlock
from reparam.testing import randomize_bn_, rel_err


def _builders(tv, timm_loader):
    return {
        "tv_resnet18": lambda: tv.models.resnet18(num_classes=10),
        "tv_mobilenet_v2": lambda: tv.models.mobilenet_v2(num_classes=10),
        "timm_resnet18": lambda: timm_loader().create_model("resnet18", num_classes=10, pretrained=False),
    }


def _run(model: nn.Module, x: torch.Tensor, train: bool) -> torch.Tensor:
    model.train(train)
    torch.manual_seed(0)  # dropout
    with torch.no_grad():
        return model(x)


def _n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def _running(model: nn.Module) -> dict[str, torch.Tensor]:
    """Running statistics keyed by the host BN path (anchor BNs of blocks included)."""
    out = {}
    for k, v in model.state_dict().items():
        if "running" in k and ".branches." not in k:
            out[k] = v
    for _, blk in reparam.iter_blocks(model):
        if blk.bn_path:
            for k, v in blk.branches["kxk"].bn.state_dict().items():
                if "running" in k:
                    out[f"{blk.bn_path}.{k}"] = v
    return out


CASES = [
    ("tv_resnet18", torch.float64, 1e-9),
    ("tv_mobilenet_v2", torch.float32, 1e-4),
    ("timm_resnet18", torch.float64, 1e-9),
]


def _round_trip(build, dtype: torch.dtype, tol: float, gen: torch.Generator) -> None:
    torch.manual_seed(0)
    model = build().to(dtype)
    randomize_bn_(model, gen)
    x = torch.randn(2, 3, 32, 32, generator=gen, dtype=dtype)

    expanded = reparam.expand(model)
    blocks = dict(reparam.iter_blocks(expanded))
    assert blocks, "no conv was expanded"
    assert all(max(b.geometry.kernel_size) <= 5 for b in blocks.values())

    # 1. expansion is bit-exact in train and eval mode, running statistics included
    for train in (True, False):
        a, b = copy.deepcopy(model), copy.deepcopy(expanded)
        assert torch.equal(_run(a, x, train), _run(b, x, train))
        ra, rb = _running(a), _running(b)
        assert set(ra) == set(rb)
        assert all(torch.equal(ra[k], rb[k]) for k in ra)

    # 2. randomise every BN (new branches' last BN included) and merge
    randomize_bn_(expanded, gen)
    expanded.eval()
    y = _run(expanded, x, False)
    deploy = reparam.merge(expanded)
    host = reparam.merge(expanded, target="host")
    assert rel_err(_run(deploy, x, False), y) <= tol
    assert rel_err(_run(host, x, False), y) <= tol

    # 3. deploy form: no BN after a conv, parameter count of the folded original
    assert not any(isinstance(m, DiverseBranchBlock) for m in deploy.modules())
    assert reparam.find_conv_bn_pairs(deploy).pairs == {}
    assert _n_params(deploy) == _n_params(reparam.merge(copy.deepcopy(model).eval()))

    # 4. host form loads strictly into a freshly built original
    fresh = build().to(dtype)
    fresh.load_state_dict(host.state_dict(), strict=True)
    assert rel_err(_run(fresh, x, False), y) <= tol

    # 5. the structure spec rebuilds the same module tree and key set
    spec = json.loads(json.dumps(reparam.structure(expanded)))
    rebuilt = reparam.build(build().to(dtype), spec)
    assert str(rebuilt) == str(expanded)
    assert list(rebuilt.state_dict()) == list(expanded.state_dict())
    rebuilt.load_state_dict(expanded.state_dict(), strict=True)
    assert torch.equal(_run(rebuilt, x, False), y)


@pytest.mark.parametrize("name, dtype, tol", CASES, ids=[c[0] for c in CASES])
def test_model_round_trip(name, dtype, tol, tv, gen) -> None:
    from reparam._compat import import_timm

    def timm_loader():
        try:
            return import_timm()
        except Exception as exc:  # pragma: no cover - depends on the installed wheels
            pytest.skip(f"timm unavailable: {exc}")

    _round_trip(_builders(tv, timm_loader)[name], dtype, tol, gen)


ZOO = [
    ("lenet5", {}),
    ("cnn", {"norm": "none"}),
    ("vgg11", {"norm": "none", "width": 0.25}),
    ("vgg11", {"width": 0.25}),
    ("resnet18", {"width": 0.25}),
    pytest.param("googlenet", {"width": 0.125}, marks=pytest.mark.slow),
]


def _zoo_id(entry) -> str:
    name, kwargs = entry.values if hasattr(entry, "values") else entry
    return f"{name}-" + "-".join(f"{k}={v}" for k, v in kwargs.items())


@pytest.mark.parametrize("name, kwargs", ZOO, ids=[_zoo_id(e) for e in ZOO])
def test_zoo_round_trip(name, kwargs, gen) -> None:
    """The project's model zoo (FedDUMAP CNN / VGG11 without BN / LeNet5 / CIFAR ResNet-18 / GoogLeNet)."""
    zoo = pytest.importorskip("fedhetero.models")
    _round_trip(lambda: zoo.build_model(name, num_classes=10, **kwargs), torch.float64, 1e-9, gen)


def test_timm_reparameterize_model_merges_our_blocks(tv, timm_module, gen) -> None:
    """timm's --reparam path (timm.utils.reparameterize_model) finds our blocks through
    ``reparameterize()`` (pytorch-image-models#2205) and keeps the function."""
    model = tv.models.resnet18(num_classes=10).double()
    randomize_bn_(model, gen)
    expanded = randomize_bn_(reparam.expand(model), gen).eval()
    x = torch.randn(2, 3, 32, 32, generator=gen, dtype=torch.float64)
    y = _run(expanded, x, False)
    deployed = timm_module.utils.reparameterize_model(expanded)
    assert all(b.is_merged for _, b in reparam.iter_blocks(deployed))
    assert rel_err(_run(deployed, x, False), y) <= 1e-9
    assert reparam.detect_form(deployed.state_dict()) == "deploy"
