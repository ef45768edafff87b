"""``norm="groupnorm1"`` (GroupNorm(1, C)) across the zoo, the DynaComm CNN and the pre-activation
ResNet-18: shapes, norm layers, parameter and MAC counts, channel groups, forward/backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedhetero.core.hetero.budget import count_params, fvcore_macs, macs
from fedhetero.core.common.config import ModelConfig
from fedhetero.core.hetero.submodel import extract_state, prefix_spec, submodel_from
from fedhetero.models import build_model, canonical_name
from fedhetero.models.groups import CLASSES, INPUT, ChannelGroups
from reparam.flops import model_macs as hook_macs

CONV_NAMES = ["lenet5", "cnn", "vgg11", "resnet18", "preact_resnet18", "googlenet"]


def _small_width(name: str) -> float:
    return 0.0625 if name == "googlenet" else 0.25


def _norms(m: nn.Module) -> tuple[int, int]:
    gn = [x for x in m.modules() if isinstance(x, nn.GroupNorm)]
    bn = [x for x in m.modules() if isinstance(x, nn.modules.batchnorm._BatchNorm)]
    assert all(x.num_groups == 1 for x in gn)
    return len(gn), len(bn)


def test_config_accepts_groupnorm1() -> None:
    assert ModelConfig(norm="groupnorm1").norm == "groupnorm1"


@pytest.mark.parametrize("name", CONV_NAMES)
@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32)])
def test_shapes_groupnorm_only_and_backward(name: str, shape: tuple[int, int, int]) -> None:
    torch.manual_seed(0)
    m = build_model(name, norm="groupnorm1", width=_small_width(name), num_classes=7,
                    in_channels=shape[0], input_size=shape[1])
    gn, bn = _norms(m)
    assert gn > 0 and bn == 0
    convs = [x for x in m.modules() if isinstance(x, nn.Conv2d)]
    assert all(c.bias is None for c in convs)  # a bias only with norm="none" (default conv_bias)
    m.train()
    x = torch.randn(3, *shape)
    y = m(x)
    assert tuple(y.shape) == (3, 7) and bool(torch.isfinite(y).all())
    nn.functional.cross_entropy(y, torch.tensor([0, 1, 2])).backward()
    grads = [p.grad for p in m.parameters()]
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads)
    # GroupNorm has no running statistics: train and eval compute the same function
    m.eval()
    with torch.no_grad():
        assert torch.allclose(m(x), y.detach(), atol=1e-5)


def test_conv_followed_by_groupnorm_in_post_activation_models() -> None:
    m = build_model("resnet18", norm="groupnorm1", width=0.125)
    assert _norms(m) == (sum(isinstance(x, nn.Conv2d) for x in m.modules()), 0)
    assert isinstance(build_model("cnn", norm="groupnorm1").conv1.bn, nn.GroupNorm)


def test_dynacomm_cnn_is_lenet5_with_the_papers_layer_sizes() -> None:
    assert canonical_name("dynacomm_cnn") == "lenet5"
    m = build_model("dynacomm_cnn", norm="groupnorm1")
    assert type(m).__name__ == "LeNet5"
    assert (m.conv1.conv.in_channels, m.conv1.conv.out_channels, m.conv1.conv.kernel_size) == (3, 6, (5, 5))
    assert (m.conv2.conv.out_channels, m.conv2.conv.kernel_size) == (16, (5, 5))
    assert isinstance(m.conv1.bn, nn.GroupNorm) and m.conv1.bn.num_channels == 6
    assert isinstance(m.conv2.bn, nn.GroupNorm) and m.conv2.bn.num_channels == 16
    assert (m.fc1.in_features, m.fc1.out_features, m.fc2.out_features) == (400, 120, 84)
    femnist = build_model("dynacomm_cnn", norm="groupnorm1", in_channels=1, input_size=28, num_classes=62)
    assert femnist.fc1.in_features == 256 and femnist.fc3.out_features == 62
    # conv weights 450 + 2,400; GN affine 2·(6 + 16); FC 48,120 + 10,164 + 850
    assert count_params(m) == 450 + 2400 + 44 + 48120 + 10164 + 850 == 62_028
    assert macs(m, (3, 32, 32)) == 651_720  # norms count 0 MACs: the same as norm="none"


def test_preact_resnet18_structure_params_and_macs() -> None:
    m = build_model("preact_resnet18", norm="groupnorm1", num_classes=100)
    gn, bn = _norms(m)
    assert bn == 0 and gn == 2 * 8 + 1  # two per block, one before the head
    # block: norm1 → relu → conv1 → norm2 → relu → conv2, 1×1 shortcut where the shape changes
    b = m.layer2[0]
    assert b.shortcut is not None and b.shortcut.kernel_size == (1, 1) and b.shortcut.stride == (2, 2)
    assert m.layer1[0].shortcut is None
    convs = sum(p.numel() for x in m.modules() if isinstance(x, nn.Conv2d) for p in x.parameters())
    norms = sum(p.numel() for x in m.modules() if isinstance(x, nn.GroupNorm) for p in x.parameters())
    # the post-activation ResNet-18 has the same convs
    ref_convs = sum(
        p.numel() for x in build_model("resnet18").modules() if isinstance(x, nn.Conv2d) for p in x.parameters()
    )
    assert convs == ref_convs == 11_159_232
    norm1 = [64, 64, 64, 128, 128, 256, 256, 512]  # each block's input channels
    norm2 = [64, 64, 128, 128, 256, 256, 512, 512]  # each block's width
    assert norms == 2 * (sum(norm1) + sum(norm2) + 512) == 7_808  # weight + bias; head norm 512
    assert count_params(m) == convs + norms + 512 * 100 + 100
    assert macs(m, (3, 32, 32)) == 555_417_600 + 512 * 100
    assert hook_macs(m, (3, 32, 32)) == 555_468_800


@pytest.mark.parametrize("norm", ["bn", "groupnorm1", "none"])
def test_preact_resnet18_all_norms(norm: str) -> None:
    torch.manual_seed(0)
    m = build_model("preact-resnet18", norm=norm, width=0.125, input_size=16).eval()
    with torch.no_grad():
        assert tuple(m(torch.randn(2, 3, 16, 16)).shape) == (2, 10)
    gn, bn = _norms(m)
    assert (gn, bn) == {"bn": (0, 17), "groupnorm1": (17, 0), "none": (0, 0)}[norm]
    gm = torch.fx.symbolic_trace(m)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(gm(x), m(x))


@pytest.mark.parametrize("name", CONV_NAMES + ["logreg"])
def test_counters_agree_with_groupnorm(name: str) -> None:
    m = build_model(name, norm="groupnorm1", width=_small_width(name), in_channels=1, input_size=28)
    closed = macs(m, (1, 28, 28))
    assert closed > 0
    assert fvcore_macs(m, (1, 28, 28)) == closed == hook_macs(m, (1, 28, 28))
    assert closed == macs(build_model(name, norm="none", width=_small_width(name), in_channels=1, input_size=28),
                          (1, 28, 28))


@pytest.mark.parametrize(
    "name, norm",
    [(n, "groupnorm1") for n in CONV_NAMES] + [("preact_resnet18", "bn"), ("preact_resnet18", "none")],
)
def test_channel_groups_cover_the_state_dict(name: str, norm: str) -> None:
    m = build_model(name, norm=norm, width=_small_width(name), num_classes=5, in_channels=1)
    g = m.channel_groups()
    assert isinstance(g, ChannelGroups)
    assert set(g.dims) == set(m.state_dict())
    g.check_state(m.state_dict())
    assert g.sizes[INPUT] == 1 and g.sizes[CLASSES] == 5


@pytest.mark.parametrize("name", ["lenet5", "resnet18", "preact_resnet18"])
def test_width_slices_build_groupnorm_submodels(name: str) -> None:
    full = build_model(name, norm="groupnorm1", width=0.5, in_channels=1, input_size=28)
    small = build_model(name, norm="groupnorm1", width=0.25, in_channels=1, input_size=28)
    spec = prefix_spec(full, 0.5)
    sub_state = extract_state(full.state_dict(), full.channel_groups(), spec)
    assert {k: tuple(v.shape) for k, v in sub_state.items()} == {
        k: tuple(v.shape) for k, v in small.state_dict().items()
    }
    sub = submodel_from(full, spec)
    assert tuple(sub(torch.randn(2, 1, 28, 28)).shape) == (2, 10)


@pytest.mark.parametrize("name", ["lenet5", "preact_resnet18"])
def test_deterministic_init(name: str) -> None:
    torch.manual_seed(3)
    a = build_model(name, norm="groupnorm1", width=0.125).state_dict()
    torch.manual_seed(3)
    b = build_model(name, norm="groupnorm1", width=0.125).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_few_sgd_steps_reduce_the_loss() -> None:
    torch.manual_seed(0)
    m = build_model("dynacomm_cnn", norm="groupnorm1", in_channels=1, input_size=28, num_classes=4)
    x, y = torch.randn(16, 1, 28, 28), torch.arange(16) % 4
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    first = None
    for _ in range(30):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        first = float(loss.detach()) if first is None else first
    assert float(loss.detach()) < 0.5 * first


def test_unknown_norm_lists_groupnorm1() -> None:
    with pytest.raises(ValueError, match="groupnorm1"):
        build_model("lenet5", norm="layernorm")


@pytest.mark.parametrize("model", ["lenet5", "preact_resnet18"])  # configs take canonical names
def test_engine_trains_groupnorm_models(tmp_path, model: str) -> None:
    from fedhetero.core.common.config import from_dict
    from fedhetero.core.run.engine import Engine

    cfg = from_dict({
        "seed": 1, "threads": 1,
        "data": {"dataset": "synthetic", "num_clients": 10, "partition": "kshards", "shards_per_client": 1,
                 "min_partition_size": 1},
        "model": {"name": model, "norm": "groupnorm1", "width": 1.0 if model == "lenet5" else 0.125},
        "train": {"rounds": 1, "sample_rate": 0.2, "local_epochs": 1, "local_steps": 2},
        "algorithm": {"name": "dynacomm", "options": {}},
    })
    eng = Engine(cfg, tmp_path / "run", progress=False)
    rows = eng.run().metrics
    assert len(rows) == 1 and rows[0]["loss"] == rows[0]["loss"]  # finite, not NaN
    norms = [m for m in eng.algorithm.global_model.modules() if isinstance(m, nn.GroupNorm)]
    assert norms and not any(isinstance(m, nn.BatchNorm2d) for m in eng.algorithm.global_model.modules())
