"""Model zoo: shapes, reference MACs/params, counter agreement, channel groups, options."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from fedhetero.core.hetero.budget import count_params, fvcore_macs, macs
from reparam.flops import model_macs as hook_macs  # the closed-form (hook) counter
from fedhetero.core.hetero.submodel import extract_state, prefix_spec
from fedhetero.models import build_model, list_models
from fedhetero.models.groups import CLASSES, INPUT, ChannelGroups, scale_channels

NAMES = ["lenet5", "cnn", "vgg11", "resnet18", "googlenet", "logreg"]


def flopcounter_macs(model: nn.Module, shape: tuple[int, ...]) -> int:
    model.eval()
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        model(torch.zeros(1, *shape))
    total = fc.get_total_flops()
    assert total % 2 == 0
    return total // 2


def test_list_models_and_unknown_name() -> None:
    # preact_resnet18 (pre-activation: no conv→norm pairs) is tested in test_groupnorm.py
    assert list_models() == sorted(NAMES + ["preact_resnet18", "resnet18_proj", "svhn_cnn"])
    with pytest.raises(ValueError) as err:
        build_model("alexnet")
    for name in NAMES:
        assert name in str(err.value)
    # aliases and spelling variants resolve
    assert isinstance(build_model("ResNet-18", width=0.0625), type(build_model("resnet18", width=0.0625)))
    assert type(build_model("LeNet_5")).__name__ == "LeNet5"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"norm": "gn"}, "norm"),
        ({"width": 0}, "width"),
        ({"width": -1.0}, "width"),
        ({"in_channels": 0}, "in_channels"),
        ({"num_classes": 0}, "num_classes"),
        ({"init": "xavier"}, "init"),
        ({"conv_bias": "yes"}, "conv_bias"),
    ],
)
def test_bad_arguments_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        build_model("cnn", **kwargs)


def test_input_too_small_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="input_size"):
        build_model("lenet5", input_size=12)
    with pytest.raises(ValueError, match="input_size"):
        build_model("cnn", input_size=8)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("in_channels", [1, 3])
@pytest.mark.parametrize("size", [28, 32])
@pytest.mark.parametrize("width", [0.5, 1.0])
def test_output_shapes(name: str, in_channels: int, size: int, width: float) -> None:
    if name == "googlenet" and not (in_channels == 3 and size == 32 and width == 1.0):
        width = width / 4  # keep the file fast; the full-width GoogLeNet runs once at 3x32x32
    torch.manual_seed(0)
    classes = 7 if size == 28 else 10
    m = build_model(name, num_classes=classes, in_channels=in_channels, input_size=size, width=width).eval()
    batch = 1 if name == "googlenet" and width == 1.0 else 2
    with torch.no_grad():
        y = m(torch.randn(batch, in_channels, size, size))
    assert tuple(y.shape) == (batch, classes)
    assert bool(torch.isfinite(y).all())


@pytest.mark.parametrize(
    "name, kwargs, ref_macs, ref_params",
    [
        ("cnn", {}, 4_548_608, 122_570),
        ("cnn", {"num_classes": 100}, 4_554_368, 128_420),
        ("vgg11", {}, 153_293_824, 9_750_922),
        ("vgg11", {"num_classes": 100}, 153_339_904, None),
        ("lenet5", {}, 651_720, 62_006),
        ("resnet18", {"num_classes": 100, "conv_bias": True, "norm": "bn"}, 555_468_800, None),
    ],
)
def test_reference_values(name: str, kwargs: dict, ref_macs: int, ref_params: int | None) -> None:
    kw = {"norm": "none", **kwargs}
    m = build_model(name, **kw)
    assert macs(m, (3, 32, 32)) == ref_macs
    assert hook_macs(m, (3, 32, 32)) == ref_macs
    if ref_params is not None:
        assert count_params(m) == ref_params


def test_resnet_conv_bias_variant_has_biases_and_bn() -> None:
    m = build_model("resnet18", conv_bias=True)
    convs = [x for x in m.modules() if isinstance(x, nn.Conv2d)]
    assert all(c.bias is not None for c in convs)
    assert sum(isinstance(x, nn.BatchNorm2d) for x in m.modules()) == len(convs)
    plain = build_model("resnet18", norm="none")
    assert not any(isinstance(x, nn.BatchNorm2d) for x in plain.modules())
    assert all(c.bias is not None for c in plain.modules() if isinstance(c, nn.Conv2d))
    bn = build_model("resnet18")
    assert all(c.bias is None for c in bn.modules() if isinstance(c, nn.Conv2d))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", [(1, 32, 32), (3, 28, 28)])
def test_counters_agree(name: str, shape: tuple[int, int, int]) -> None:
    width = 0.0625 if name == "googlenet" else 0.5
    m = build_model(name, in_channels=shape[0], input_size=shape[1], width=width)
    closed = macs(m, shape)
    assert closed > 0
    assert fvcore_macs(m, shape) == closed
    assert hook_macs(m, shape) == closed
    assert flopcounter_macs(m, shape) == closed


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("norm", ["bn", "none"])
def test_channel_groups_cover_the_state_dict(name: str, norm: str) -> None:
    m = build_model(name, width=0.25, norm=norm, num_classes=5, in_channels=1)
    g = m.channel_groups()
    assert isinstance(g, ChannelGroups)
    assert set(g.dims) == set(m.state_dict())
    g.check_state(m.state_dict())
    assert g.sizes[INPUT] == 1 and g.sizes[CLASSES] == 5
    assert g.fixed == frozenset({INPUT, CLASSES})
    assert ChannelGroups.from_dict(g.to_dict()) == g
    # every conv/linear weight has both dims described, BN counters none
    for key, (d0, d1) in g.dims.items():
        if key.endswith("num_batches_tracked"):
            assert (d0, d1) == (None, None)
        elif key.endswith("weight") and m.state_dict()[key].dim() >= 2:
            assert d0 is not None and d1 is not None


def test_channel_groups_without_running_stats() -> None:
    m = build_model("resnet18", width=0.125, track_running_stats=False)
    assert not any(k.endswith("running_mean") for k in m.state_dict())
    g = m.channel_groups()
    assert set(g.dims) == set(m.state_dict())


def test_flatten_repeat_and_residual_ties() -> None:
    cnn = build_model("cnn")
    g = cnn.channel_groups()
    assert g.dims["fc1.weight"][1] == (("conv3", 16),)
    assert build_model("cnn", input_size=28).channel_groups().dims["fc1.weight"][1] == (("conv3", 9),)
    assert build_model("lenet5").channel_groups().dims["fc1.weight"][1] == (("conv2", 25),)
    assert build_model("vgg11").channel_groups().dims["classifier.0.weight"][1] == (("features.11", 1),)
    r = build_model("resnet18", width=0.25).channel_groups()
    assert set(r.producers("layer1")) >= {"conv1.weight", "bn1.weight", "layer1.0.conv2.weight", "layer1.1.bn2.bias"}
    assert set(r.consumers("layer1")) == {
        "layer1.0.conv1.weight", "layer1.1.conv1.weight", "layer2.0.conv1.weight", "layer2.0.downsample.0.weight"
    }
    assert r.consumers("layer4") == ["layer4.1.conv1.weight", "fc.weight"]
    assert "layer2.0.downsample.0.weight" in r.producers("layer2")
    gn = build_model("googlenet", width=0.25).channel_groups()
    assert gn.dims["b3.b1.conv.weight"][1] == (("a3.b1", 1), ("a3.b2.1", 1), ("a3.b3.2", 1), ("a3.b4.1", 1))
    assert gn.dim_length(gn.dims["b3.b1.conv.weight"][1]) == sum(
        scale_channels(c, 0.25) for c in (64, 128, 32, 32)
    )


@pytest.mark.parametrize("name", NAMES)
def test_width_models_match_prefix_slices(name: str) -> None:
    full = build_model(name, width=1.0 if name != "googlenet" else 0.5, in_channels=1, input_size=28)
    for ratio in (0.5, 0.3):
        width = ratio if name != "googlenet" else 0.5 * ratio
        small = build_model(name, width=width, in_channels=1, input_size=28)
        sub = extract_state(full.state_dict(), full.channel_groups(), prefix_spec(full, ratio))
        if name == "googlenet":  # ceil(ceil(c/2)·r) may differ from ceil(c·r/2); compare counts only
            assert set(sub) == set(small.state_dict())
            continue
        assert {k: tuple(v.shape) for k, v in sub.items()} == {
            k: tuple(v.shape) for k, v in small.state_dict().items()
        }


def test_scale_channels_rounding() -> None:
    assert scale_channels(64, 0.5) == 32
    assert scale_channels(64, 0.3) == 20
    assert scale_channels(100, 0.07) == 7  # float noise does not round up
    assert scale_channels(6, 0.0625) == 1
    assert scale_channels(64, 3**0.5) == 111


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_init(name: str) -> None:
    torch.manual_seed(3)
    a = build_model(name, width=0.125).state_dict()
    torch.manual_seed(3)
    b = build_model(name, width=0.125).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    torch.manual_seed(4)
    c = build_model(name, width=0.125).state_dict()
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].is_floating_point() and a[k].numel() > 1)


def test_kaiming_out_init() -> None:
    torch.manual_seed(0)
    m = build_model("vgg11", norm="none", init="kaiming_out")
    conv = m.features[0].conv
    assert bool((conv.bias == 0).all())
    std = float(m.features[4].conv.weight.detach().std())  # 3x3, C_out = 256 -> std sqrt(2/2304)
    assert abs(std - (2 / 2304) ** 0.5) < 0.05 * (2 / 2304) ** 0.5


@pytest.mark.parametrize("name", NAMES)
def test_fx_traceable(name: str) -> None:
    size = 32 if name in ("lenet5", "cnn") else 16
    m = build_model(name, width=0.0625, input_size=size).eval()
    gm = torch.fx.symbolic_trace(m)
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        assert torch.equal(gm(x), m(x))
    # every conv is followed by a BN module call when norm="bn"
    nodes = list(gm.graph.nodes)
    convs = [n for n in nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.Conv2d)]
    for n in convs:
        users = list(n.users)
        assert len(users) == 1 and isinstance(gm.get_submodule(users[0].target), nn.BatchNorm2d)


@pytest.mark.parametrize("shape", [(64, 6, 28, 28), (40, 16, 11, 13), (8, 32, 9, 9), (1, 6, 28, 28)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_fast_pool_equals_max_pool(shape: tuple[int, int, int, int], channels_last: bool) -> None:
    """The zoo's 2x2 pool gives nn.MaxPool2d's values, NaN and infinities included, with and
    without gradient; where no gradient is recorded on a large enough input it takes the strided
    path (no pooling kernel call), else the kernel."""
    from fedhetero.models._common import MaxPool2x2

    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g)
    x.view(-1)[:: 97] = float("nan")
    x.view(-1)[5:: 101] = float("inf")
    x.view(-1)[7:: 103] = float("-inf")
    x = torch.relu(x) if shape[0] == 40 else x  # ties at zero
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    fast, ref = MaxPool2x2(), nn.MaxPool2d(2)
    calls: list[int] = []
    real = torch.nn.functional.max_pool2d
    try:
        torch.nn.functional.max_pool2d = lambda *a, **k: calls.append(1) or real(*a, **k)  # type: ignore[assignment]
        with torch.no_grad():
            out = fast(x)
        strided = not calls
        assert strided == (x.numel() >= MaxPool2x2._MIN_ELEMENTS)
    finally:
        torch.nn.functional.max_pool2d = real  # type: ignore[assignment]
    expected = ref(x)
    assert out.shape == expected.shape
    assert torch.equal(out.isnan(), expected.isnan())
    assert torch.equal(torch.nan_to_num(out), torch.nan_to_num(expected))
    xg, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    fast(xg).nan_to_num().sum().backward()
    ref(xr).nan_to_num().sum().backward()
    assert torch.equal(xg.grad, xr.grad)


def test_register_model_builds_refuses_a_taken_name_and_unregisters():
    from fedhetero.models import register_model, unregister_model

    class Tiny(torch.nn.Module):
        def __init__(self, num_classes: int = 10, **_: object) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, num_classes)

    register_model("tiny_probe", Tiny)
    try:
        assert "tiny_probe" in list_models()
        assert build_model("Tiny-Probe", num_classes=3).fc.out_features == 3
        with pytest.raises(ValueError, match="already the model 'tiny_probe'"):
            register_model("tinyprobe", Tiny)
        with pytest.raises(ValueError, match="already the model 'lenet5'"):
            register_model("lenet", Tiny)
    finally:
        unregister_model("tiny_probe")
    assert "tiny_probe" not in list_models()
    with pytest.raises(ValueError, match="unknown model"):
        build_model("tiny_probe")


def test_every_zoo_model_shares_one_constructor() -> None:
    """One builder: every zoo model is a ``ZooModel`` (the common options validated once, the
    shared attributes set, its own ``build``, then the init), and no model file repeats the option
    block."""
    from pathlib import Path

    import fedhetero.models as zoo
    from fedhetero.models._common import ZooModel

    for name in list_models():
        model = build_model(name, num_classes=3, width=0.5, input_size=32)
        assert isinstance(model, ZooModel), name
        assert (model.num_classes, model.width, model.input_size) == (3, 0.5, 32), name
    folder = Path(zoo.__file__).parent
    repeated = [p.name for p in folder.glob("*.py") if p.name != "_common.py" and "resolve_options(" in p.read_text()]
    assert repeated == []
