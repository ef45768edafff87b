"""Channel-group sub-models: specs, extraction, physical sub-models, scatter/finalize."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from torch import nn

from fedhetero.core.hetero.budget import macs
from fedhetero.core.hetero.submodel import (
    CLASSES,
    SubmodelAggregator,
    SubmodelSpec,
    extract_state,
    finalize,
    full_spec,
    gather,
    init_buffers,
    keep_count,
    masked_state,
    prefix_spec,
    random_spec,
    rolling_spec,
    scatter,
    scatter_add_,
    submodel_from,
)
from fedhetero.models import build_model
from fedhetero.models.groups import ChannelGroups

NAMES = ["lenet5", "cnn", "vgg11", "resnet18", "googlenet"]
WIDTH = {"lenet5": 1.0, "cnn": 0.5, "vgg11": 0.125, "resnet18": 0.25, "googlenet": 0.0625}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max().detach() / b.abs().max().detach())


def randomized(name: str, **kw) -> nn.Module:
    torch.manual_seed(0)
    m = build_model(name, width=WIDTH[name], **kw).double()
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.weight.normal_()
                mod.bias.normal_()
                mod.running_mean.normal_()
                mod.running_var.uniform_(0.5, 2.0)
                mod.num_batches_tracked.fill_(7)
    return m.eval()


# ------------------------------------------------------------------ specs
def test_keep_count_rule() -> None:
    assert keep_count(64, 0.5) == 32
    assert keep_count(10, 0.25) == 3
    assert keep_count(3, 0.01) == 1
    assert keep_count(7, 1.0) == 7
    for bad in (0, 1.5, -0.1, True):
        with pytest.raises(ValueError, match="ratio"):
            keep_count(8, bad)


def test_prefix_spec() -> None:
    m = build_model("cnn")
    spec = prefix_spec(m, 0.3)
    assert torch.equal(spec.kept("conv1"), torch.arange(10))  # ceil(32 * 0.3)
    assert torch.equal(spec.kept("conv2"), torch.arange(20))
    assert spec.is_full("input") and spec.is_full(CLASSES)
    assert spec.sizes["fc1"] == 20 and not spec.is_full()
    assert full_spec(m).is_full()
    assert prefix_spec(m, 1.0) == full_spec(m)


def test_rolling_spec_wraps_and_cycles() -> None:
    m = build_model("cnn")
    spec = rolling_spec(m, 0.25, 30)  # conv1 has 32 channels, k = 8
    assert spec.kept("conv1").tolist() == [0, 1, 2, 3, 4, 5, 30, 31]
    assert spec.kept("conv2").tolist() == list(range(30, 46))  # 64 channels, k = 16
    assert torch.equal(rolling_spec(m, 0.25, -2).kept("conv1"), spec.kept("conv1"))  # -2 = 30 mod 32
    assert rolling_spec(m, 0.25, 0) == prefix_spec(m, 0.25)
    assert rolling_spec(m, 0.25, 64) == prefix_spec(m, 0.25)
    # over C consecutive offsets every channel of a group is covered exactly k times
    counts = torch.zeros(32, dtype=torch.long)
    for t in range(32):
        counts[rolling_spec(m, 0.25, -t).kept("conv1")] += 1
    assert bool((counts == 8).all())
    with pytest.raises(ValueError, match="offset"):
        rolling_spec(m, 0.5, 1.5)  # type: ignore[arg-type]


def test_random_spec_per_group_and_reproducible() -> None:
    m = build_model("resnet18", width=0.25)
    a = random_spec(m, 0.5, torch.Generator().manual_seed(5))
    b = random_spec(m, 0.5, torch.Generator().manual_seed(5))
    c = random_spec(m, 0.5, np.random.default_rng(5))
    d = random_spec(m, 0.5, np.random.default_rng(5))
    assert a == b and c == d and a != c
    for g, n in m.channel_groups().sizes.items():
        k = a.kept(g)
        assert k.numel() == (n if g in ("input", CLASSES) else keep_count(n, 0.5))
        assert torch.equal(k, torch.sort(k).values) and k.unique().numel() == k.numel()
    with pytest.raises(TypeError, match="generator"):
        random_spec(m, 0.5, 3)  # type: ignore[arg-type]


def test_spec_validation_errors() -> None:
    m = build_model("cnn", width=0.25)
    with pytest.raises(ValueError, match="unknown channel groups"):
        SubmodelSpec(m, {"nope": [0]})
    with pytest.raises(ValueError, match="fixed"):
        SubmodelSpec(m, {CLASSES: [0, 1]})
    with pytest.raises(ValueError, match="duplicates"):
        SubmodelSpec(m, {"conv1": [0, 0]})
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        SubmodelSpec(m, {"conv1": [0, 8]})
    with pytest.raises(ValueError, match="at least one"):
        SubmodelSpec(m, {"conv1": []})
    # unsorted input is sorted
    assert SubmodelSpec(m, {"conv1": [5, 1, 3]}).kept("conv1").tolist() == [1, 3, 5]


def test_spec_serialisation_round_trip() -> None:
    m = build_model("googlenet", width=0.125)
    spec = random_spec(m, 0.4, torch.Generator().manual_seed(1))
    again = SubmodelSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again == spec
    buf = io.BytesIO()
    torch.save(spec.state_dict(), buf)
    buf.seek(0)
    assert SubmodelSpec.from_dict(torch.load(buf, weights_only=True)) == spec


def test_compose_sub_of_sub() -> None:
    m = build_model("cnn", width=0.5)
    first = rolling_spec(m, 0.5, 3)
    sub = submodel_from(m, first)
    second = SubmodelSpec(sub, {"conv2": [0, 2, 4], "fc1": [1]})
    total = first.compose(second)
    assert total.kept("conv2").tolist() == first.kept("conv2")[[0, 2, 4]].tolist()
    assert total.kept("fc1").tolist() == [int(first.kept("fc1")[1])]
    # extracting in two steps == extracting with the composed spec
    two_step = extract_state(sub.state_dict(), second)
    assert all(torch.equal(two_step[k], v) for k, v in extract_state(m.state_dict(), total).items())


# ------------------------------------------------------------------ extraction and sub-models
@pytest.mark.parametrize("name", NAMES)
def test_submodel_equals_masked_parent(name: str) -> None:
    size = 8 if name in ("googlenet", "resnet18", "vgg11") else 32  # keep float64 convs cheap
    m = randomized(name, input_size=size)
    x = torch.randn(2, 3, size, size, dtype=torch.float64)
    specs = [
        prefix_spec(m, 0.5),
        rolling_spec(m, 0.3, 5),
        random_spec(m, 0.6, torch.Generator().manual_seed(2)),
    ]
    if name == "googlenet":
        specs = specs[1:]
    for spec in specs:
        sub = submodel_from(m, spec)
        state = sub.state_dict()
        expected = extract_state(m.state_dict(), m.channel_groups(), spec)
        assert list(state) == list(m.state_dict())
        assert all(torch.equal(state[k], expected[k]) for k in state)  # BN stats copied too
        assert sub.channel_groups().sizes == spec.sizes
        ref = build_model(name, width=WIDTH[name], input_size=size).double().eval()
        ref.load_state_dict(masked_state(m.state_dict(), spec))
        with torch.no_grad():
            assert rel_err(sub(x), ref(x)) <= 1e-10
        assert macs(sub, (3, size, size)) < macs(m, (3, size, size))
    # the parent is untouched
    assert m.channel_groups() == specs[0].groups


def test_masked_train_mode_also_matches() -> None:
    m = randomized("resnet18", input_size=16).train()
    spec = random_spec(m, 0.5, torch.Generator().manual_seed(9))
    sub = submodel_from(m, spec).train()
    ref = build_model("resnet18", width=WIDTH["resnet18"], input_size=16).double().train()
    ref.load_state_dict(masked_state(m.state_dict(), spec))
    x = torch.randn(4, 3, 16, 16, dtype=torch.float64)
    assert rel_err(sub(x), ref(x)) <= 1e-10


def test_googlenet_concat_indices_are_piecewise() -> None:
    m = build_model("googlenet", width=0.25)
    g = m.channel_groups()
    spec = random_spec(m, 0.5, torch.Generator().manual_seed(0))
    sizes = [g.sizes[n] for n in ("a3.b1", "a3.b2.1", "a3.b3.2", "a3.b4.1")]
    offsets = np.cumsum([0] + sizes[:-1]).tolist()
    cols = torch.cat(
        [off + spec.kept(n) for off, n in zip(offsets, ("a3.b1", "a3.b2.1", "a3.b3.2", "a3.b4.1"))]
    )
    w = m.state_dict()["b3.b1.conv.weight"]
    sub = extract_state(m.state_dict(), spec)["b3.b1.conv.weight"]
    assert torch.equal(sub, w[spec.kept("b3.b1")][:, cols])


def test_flatten_linear_columns_follow_channels() -> None:
    m = build_model("cnn", width=0.25)
    spec = SubmodelSpec(m, {"conv3": [1, 4], "fc1": [0, 3]})
    w = m.state_dict()["fc1.weight"]  # (16, 16 * 16)
    cols = torch.cat([torch.arange(16, 32), torch.arange(64, 80)])
    assert torch.equal(extract_state(m.state_dict(), spec)["fc1.weight"], w[[0, 3]][:, cols])


def test_extract_state_checks_and_call_forms() -> None:
    m = build_model("lenet5")
    spec = prefix_spec(m, 0.5)
    a = extract_state(m.state_dict(), spec)
    b = extract_state(m.state_dict(), m.channel_groups(), spec)
    c = extract_state(m.state_dict(), m, spec)
    assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)
    assert all(a[k].data_ptr() != v.data_ptr() for k, v in m.state_dict().items())  # copies
    other = build_model("lenet5", width=0.5)
    with pytest.raises(ValueError, match="do not match"):
        extract_state(m.state_dict(), other.channel_groups(), spec)
    with pytest.raises(ValueError, match="shape"):
        extract_state(other.state_dict(), spec)


# ------------------------------------------------------------------ aggregation
def tiny_groups() -> ChannelGroups:
    """conv (4 <- 2 input), bias; linear (3 classes <- 4 channels x 2 positions), bias; counter."""
    return ChannelGroups(
        sizes={"input": 2, "c": 4, "classes": 3},
        dims={
            "conv.weight": ((("c", 1),), (("input", 1),)),
            "conv.bias": ((("c", 1),), None),
            "fc.weight": ((("classes", 1),), (("c", 2),)),
            "fc.bias": ((("classes", 1),), None),
            "bn.num_batches_tracked": (None, None),
        },
    )


def tiny_state(fill: float) -> dict[str, torch.Tensor]:
    return {
        "conv.weight": torch.full((4, 2, 1, 1), fill),
        "conv.bias": torch.full((4,), fill),
        "fc.weight": torch.full((3, 8), fill),
        "fc.bias": torch.full((3,), fill),
        "bn.num_batches_tracked": torch.tensor(int(fill), dtype=torch.long),
    }


def test_scatter_hand_made_means_and_untouched_coordinates() -> None:
    g = tiny_groups()
    old = tiny_state(-9.0)
    a = SubmodelSpec(g, {"c": [0, 1]})
    b = SubmodelSpec(g, {"c": [1, 2]})
    sub_a = {
        "conv.weight": torch.tensor([1.0, 2.0, 3.0, 4.0]).view(2, 2, 1, 1),
        "conv.bias": torch.tensor([10.0, 20.0]),
        "fc.weight": torch.arange(12, dtype=torch.float32).view(3, 4),
        "fc.bias": torch.tensor([1.0, 1.0, 1.0]),
        "bn.num_batches_tracked": torch.tensor(4),
    }
    sub_b = {
        "conv.weight": torch.tensor([5.0, 6.0, 7.0, 8.0]).view(2, 2, 1, 1),
        "conv.bias": torch.tensor([30.0, 40.0]),
        "fc.weight": 100 + torch.arange(12, dtype=torch.float32).view(3, 4),
        "fc.bias": torch.tensor([3.0, 3.0, 3.0]),
        "bn.num_batches_tracked": torch.tensor(7),
    }
    s, c = init_buffers(old)
    scatter_add_(s, c, sub_a, a)
    scatter_add_(s, c, sub_b, b)
    new = finalize(old, s, c)
    # conv rows: channel 0 only a, channel 1 both, channel 2 only b, channel 3 nobody
    assert new["conv.weight"].view(4, 2).tolist() == [[1, 2], [4, 5], [7, 8], [-9, -9]]
    assert new["conv.bias"].tolist() == [10, 25, 40, -9]
    # fc columns: channel j owns columns 2j, 2j+1
    expect = torch.full((3, 8), -9.0)
    for r in range(3):
        expect[r, 0:2] = sub_a["fc.weight"][r, 0:2]
        expect[r, 2:4] = (sub_a["fc.weight"][r, 2:4] + sub_b["fc.weight"][r, 0:2]) / 2
        expect[r, 4:6] = sub_b["fc.weight"][r, 2:4]
    assert torch.equal(new["fc.weight"], expect)
    assert new["fc.bias"].tolist() == [2, 2, 2]
    assert int(new["bn.num_batches_tracked"]) == 6 and new["bn.num_batches_tracked"].dtype == torch.long
    assert c["conv.bias"].tolist() == [1, 2, 1, 0]


def test_weighted_means_and_label_masking() -> None:
    g = tiny_groups()
    old = tiny_state(-1.0)
    spec = full_spec(g)
    agg = SubmodelAggregator(old, g)
    agg.add(tiny_state(2.0), spec, 1.0, labels=[0, 2])
    agg.add(tiny_state(5.0), None, 3.0, labels=[2])
    new = agg.result()
    assert new["conv.bias"].tolist() == [(2 + 15) / 4] * 4
    # class 0: only first client; class 1: nobody (old kept); class 2: both, weighted
    assert new["fc.bias"].tolist() == [2.0, -1.0, (2 + 15) / 4]
    assert new["fc.weight"][1].tolist() == [-1.0] * 8
    assert new["fc.weight"][0].tolist() == [2.0] * 8
    with pytest.raises(ValueError, match="labels"):
        agg.add(tiny_state(1.0), spec, labels=[3])


def test_width_half_client_leaves_outer_channels_bit_identical() -> None:
    m = randomized("resnet18")
    old = m.state_dict()
    spec = prefix_spec(m, 0.5)
    sub = {k: v + 1.0 if v.is_floating_point() else v for k, v in extract_state(old, spec).items()}
    s, c = init_buffers(old)
    scatter_add_(s, c, sub, spec)
    new = finalize(old, s, c)
    back = gather(new, spec)
    assert all(torch.equal(back[k], sub[k]) for k in sub)
    w_old, w_new = old["layer2.0.conv1.weight"], new["layer2.0.conv1.weight"]
    k, j = spec.sizes["layer2.0.conv1"], spec.sizes["layer1"]
    assert (k, j) == (16, 8)
    assert torch.equal(w_new[k:], w_old[k:]) and torch.equal(w_new[:, j:], w_old[:, j:])
    assert bool((w_new[:k, :j] == w_old[:k, :j] + 1).all())
    assert torch.equal(new["fc.weight"][:, 64:], old["fc.weight"][:, 64:])
    assert bool((new["fc.weight"][:, :64] == old["fc.weight"][:, :64] + 1).all())


@pytest.mark.parametrize("name", ["cnn", "googlenet"])
def test_two_clients_match_elementwise_means(name: str) -> None:
    m = randomized(name)
    old = m.state_dict()
    specs = [prefix_spec(m, 0.5), random_spec(m, 0.5, torch.Generator().manual_seed(4))]
    subs = []
    for i, spec in enumerate(specs):
        torch.manual_seed(10 + i)
        sub = extract_state(old, spec)
        subs.append({k: torch.randn_like(v) if v.is_floating_point() else v for k, v in sub.items()})
    agg = SubmodelAggregator(old)
    for spec, sub in zip(specs, subs):
        agg.add(sub, spec)
    new = agg.result()
    # reference: scatter each client into a NaN-filled copy and take a nan-mean per element
    stacks = {k: [] for k in old}
    for spec, sub in zip(specs, subs):
        filled = {k: torch.full_like(v, float("nan"), dtype=torch.float64) for k, v in old.items()}
        placed = scatter(filled, {k: v.double() for k, v in sub.items()}, spec)
        for k in old:
            stacks[k].append(placed[k])
    for k, v in old.items():
        if not v.is_floating_point():
            continue
        st = torch.stack(stacks[k])
        cnt = (~st.isnan()).sum(0)
        mean = torch.nan_to_num(st, nan=0.0).sum(0) / cnt.clamp(min=1)
        ref = torch.where(cnt > 0, mean.to(v.dtype), v)
        assert torch.equal(new[k], ref), k


@pytest.mark.parametrize("name", ["vgg11", "resnet18", "googlenet"])
def test_gather_scatter_round_trip(name: str) -> None:
    m = randomized(name)
    g = m.state_dict()
    spec = random_spec(m, 0.5, torch.Generator().manual_seed(3))
    assert all(torch.equal(a, b) for a, b in zip(scatter(g, gather(g, spec), spec).values(), g.values()))
    sub = {k: torch.randn_like(v) if v.is_floating_point() else v + 1 for k, v in gather(g, spec).items()}
    back = gather(scatter(g, sub, spec), spec)
    assert all(torch.equal(back[k], sub[k]) for k in sub)
    # inplace writes into the given tensors
    h = {k: v.clone() for k, v in g.items()}
    scatter(h, sub, spec, inplace=True)
    assert all(torch.equal(a, b) for a, b in zip(gather(h, spec).values(), sub.values()))


def test_scatter_rejects_wrong_shapes() -> None:
    m = build_model("cnn", width=0.25)
    spec = prefix_spec(m, 0.5)
    sub = extract_state(m.state_dict(), spec)
    sub["conv2.conv.weight"] = sub["conv2.conv.weight"][:-1]
    s, c = init_buffers(m.state_dict())
    with pytest.raises(ValueError, match="conv2.conv.weight"):
        scatter_add_(s, c, sub, spec)
