"""SaliencyMeter (per-branch gradient saliency): values against hand computation, AMP, skips, changes."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from torch import nn

from reparam.block import DiverseBranchBlock
from reparam.saliency import SaliencyMeter

KINDS = ["kxk", "1x1", "1x1_kxk", "1x1_avg", "identity"]


class Net(nn.Module):
    def __init__(self, kinds=KINDS, channels=4):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        bn = nn.BatchNorm2d(channels)
        with torch.no_grad():
            conv.weight.copy_(torch.randn(conv.weight.shape, generator=g) * 0.3)
        self.block = DiverseBranchBlock.from_conv(conv, bn, branches=kinds)
        self.head = nn.Linear(channels, 3)
        # non-zero branch parameters so every metric is non-trivial
        with torch.no_grad():
            for p in self.block.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.2)

    def forward(self, x):
        return self.head(torch.relu(self.block(x)).mean((2, 3)))


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(6, 4, 5, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g)


def _backward(net, seed, scale=1.0):
    net.zero_grad(set_to_none=True)
    x, y = _batch(seed)
    loss = nn.functional.cross_entropy(net(x), y) * scale
    loss.backward()


def _identity_I(p: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """I1[d, c'] = 1 iff c' == d mod (C/g) for a (D, C/g, 1, 1) weight."""
    eye = torch.zeros_like(p)
    cg = p.shape[1]
    for d in range(p.shape[0]):
        eye[d, d % cg, 0, 0] = 1.0
    return eye


def _effective_params(net, name):
    """(param, theta used in the product) per parameter of the branch, by hand."""
    out = []
    for pname, p in net.block.branches[name].named_parameters():
        theta = p.detach()
        if name == "1x1_kxk" and p.dim() == 4 and p.shape[-2:] == (1, 1) and p.shape[0] == p.shape[1] * 1:
            # identity-based first stage (D == C, dense): effective weight R + I
            theta = theta + _identity_I(p)
        out.append((pname, p, theta))
    return out


def _hand(net, name, metric, conv_only=False, numel=False):
    items = _effective_params(net, name)
    if conv_only:
        conv = [it for it in items if it[1].dim() == 4]
        items = conv or items
    if metric == "synflow":
        v = sum(float((p.grad * t).sum()) for _, p, t in items)
    elif metric == "snip":
        v = sum(float((p.grad * t).abs().sum()) for _, p, t in items)
    else:
        v = math.sqrt(sum(float((p.grad**2).sum()) for _, p, t in items))
    if numel:
        v /= sum(p.numel() for _, p, _ in items)
    return v


def _net():
    return Net().double()


@pytest.mark.parametrize("params,normalize", [("all", None), ("conv_weights", None), ("all", "numel")])
def test_values_match_hand_computation(params, normalize):
    net = _net()
    metrics = ("synflow", "snip", "grad_norm")
    meters = {m: SaliencyMeter(net, metric=m, params=params, normalize=normalize) for m in metrics}
    names = net.block.branch_names
    expect = {(m, n): 0.0 for m in metrics for n in names}
    for step in range(3):
        _backward(net, step)
        for m in metrics:
            meters[m].after_backward()
            for n in names:
                expect[(m, n)] += _hand(net, n, m, params == "conv_weights", normalize == "numel") / 3
    for m in metrics:
        vals = meters[m].values()
        assert set(vals) == {("block", n) for n in names}
        for n in names:
            assert vals[("block", n)] == pytest.approx(expect[(m, n)], rel=1e-12, abs=1e-15), (m, n)
        assert all(c == 3 for c in meters[m].counts().values())
    # the three metrics differ (so each is really checked)
    k = ("block", "1x1")
    assert len({round(meters[m].values()[k], 12) for m in metrics}) == 3


def test_identity_based_stage_uses_effective_weight():
    net = _net()
    meter = SaliencyMeter(net)
    _backward(net, 0)
    meter.after_backward()
    items = _effective_params(net, "1x1_kxk")
    raw = sum(float((p.grad * p.detach()).sum()) for _, p, _ in items)
    eff = _hand(net, "1x1_kxk", "synflow")
    assert abs(eff - raw) > 1e-6  # the identity part matters for this check to mean something
    assert meter.values()[("block", "1x1_kxk")] == pytest.approx(eff, rel=1e-12)


def test_identity_branch_scored_by_bn_with_conv_weights():
    net = _net()
    meter = SaliencyMeter(net, params="conv_weights")
    _backward(net, 1)
    meter.after_backward()
    bn = net.block.branches["identity"]
    hand = sum(float((p.grad * p.detach()).sum()) for p in bn.parameters())
    assert meter.values()[("block", "identity")] == pytest.approx(hand, rel=1e-12)


def test_amp_scaler_paths():
    net_a = _net()
    net_b = copy.deepcopy(net_a)
    net_c = copy.deepcopy(net_a)  # copies before any train-mode forward updates BN statistics
    m_plain = SaliencyMeter(net_a)
    _backward(net_a, 0)
    m_plain.after_backward()
    reference = m_plain.values()

    # real GradScaler on CPU, gradients still scaled -> meter divides by the scale
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    opt = torch.optim.SGD(net_b.parameters(), lr=0.0)
    m = SaliencyMeter(net_b)
    opt.zero_grad()
    x, y = _batch(0)
    scaler.scale(nn.functional.cross_entropy(net_b(x), y)).backward()
    m.after_backward(scaler)
    for k, v in reference.items():
        assert m.values()[k] == pytest.approx(v, rel=1e-10)

    # after unscale_ the gradients are used as they are
    m.reset()
    scaler.unscale_(opt)
    m.after_backward(scaler)
    for k, v in reference.items():
        assert m.values()[k] == pytest.approx(v, rel=1e-10)
    m.reset()
    m.after_backward(scaler, optimizer=opt)
    assert m.values()[("block", "1x1")] == pytest.approx(reference[("block", "1x1")], rel=1e-10)
    scaler.step(opt)
    scaler.update()

    # a minimal fake scaler (only get_scale): always treated as not unscaled
    class Fake:
        def get_scale(self):
            return 8.0

    m3 = SaliencyMeter(net_c)
    _backward(net_c, 0, scale=8.0)
    m3.after_backward(Fake())
    for k, v in reference.items():
        assert m3.values()[k] == pytest.approx(v, rel=1e-10)
    m3.reset()
    m3.after_backward(Fake(), unscaled=True)  # explicit override: no division
    k = ("block", "1x1")
    assert m3.values()[k] == pytest.approx(8.0 * reference[k], rel=1e-10)


def test_non_finite_step_is_skipped_and_means_accumulate():
    net = _net()
    meter = SaliencyMeter(net, metric="synflow")
    _backward(net, 0)
    meter.after_backward()
    first = meter.values()
    _backward(net, 1)
    next(net.block.branches["1x1"].parameters()).grad.view(-1)[0] = float("inf")
    meter.after_backward()
    assert meter.skipped_steps == 1
    assert meter.values() == first
    assert set(meter.counts().values()) == {1}
    _backward(net, 2)
    second = {n: _hand(net, n, "synflow") for n in net.block.branch_names}
    meter.after_backward()
    for n in net.block.branch_names:
        assert meter.values()[("block", n)] == pytest.approx((first[("block", n)] + second[n]) / 2, rel=1e-12)
    meter.reset()
    assert meter.values() == {} and meter.skipped_steps == 0


def _step_reference(net, meter, metric):
    """One step's value per key as the meter defines it, bit for bit: each parameter's product in
    its dtype, summed in float64, a key's sums added from 0 in its parameters' order."""
    out = {}
    for key, t in meter._tracked.items():
        v = torch.zeros((), dtype=torch.float64)
        for p, eff in zip(t.params, t.effective):
            if p.grad is None:
                continue
            theta = p.grad if metric == "grad_norm" else (p.detach() if eff is None else eff().detach())
            q = p.grad * theta
            v = v + (q.abs() if metric == "snip" else q).sum(dtype=torch.float64)
        out[key] = float(v.sqrt() if metric == "grad_norm" else v)
    return out


@pytest.mark.parametrize("metric", ["synflow", "snip", "grad_norm"])
def test_step_values_are_the_defined_sums_bit_for_bit(metric):
    """float32, so the order of the float64 sums shows in the bits; after a structure change and
    with some gradients missing."""
    net = Net()
    meter = SaliencyMeter(net, metric=metric)
    for step, change in enumerate((False, True)):
        if change:
            net.block.remove_branch("1x1_avg")
            net.block.add_branch("kx1")
        fresh = SaliencyMeter(net, metric=metric)
        net.zero_grad(set_to_none=True)
        x, y = _batch(step)
        nn.functional.cross_entropy(net(x.float()), y).backward()
        if change:  # a branch without gradients this step: its parameters are left out
            for p in net.block.branches["1x1"].parameters():
                p.grad = None
        expect = _step_reference(net, fresh, metric)
        fresh.after_backward()
        meter.after_backward()
        got = fresh.values()
        assert got == expect
        if change:
            assert got[("block", "1x1")] == 0.0 and meter.counts()[("block", "kx1")] == 1


def test_structure_changes_are_followed():
    net = _net()
    meter = SaliencyMeter(net)
    _backward(net, 0)
    meter.after_backward()
    net.block.remove_branch("1x1_avg")
    net.block.add_branch("1xk")
    meter.refresh()
    vals = meter.values()
    assert ("block", "1x1_avg") not in vals
    assert ("block", "1xk") not in vals  # new branch starts empty
    assert meter.counts()[("block", "1xk")] == 0
    _backward(net, 1)
    meter.after_backward()
    counts = meter.counts()
    assert counts[("block", "1xk")] == 1 and counts[("block", "1x1")] == 2
    # automatic detection without refresh()
    net.block.add_branch("kx1")
    _backward(net, 2)
    meter.after_backward()
    assert meter.counts()[("block", "kx1")] == 1


def test_state_dict_round_trip_and_json():
    net = _net()
    meter = SaliencyMeter(net, metric="snip")
    for s in range(2):
        _backward(net, s)
        meter.after_backward()
    state = json.loads(json.dumps(meter.state_dict()))
    other = SaliencyMeter(net, metric="snip")
    other.load_state_dict(state)
    assert other.values() == pytest.approx(meter.values())
    assert other.counts() == meter.counts()
    with pytest.raises(ValueError, match="metric"):
        SaliencyMeter(net, metric="synflow").load_state_dict(state)
    with pytest.raises(TypeError, match="state"):
        other.load_state_dict({"x": 1})


def test_random_metric_and_bad_arguments():
    net = _net()
    meter = SaliencyMeter(net, metric="random", generator=torch.Generator().manual_seed(3))
    _backward(net, 0)
    meter.after_backward()
    assert all(0.0 <= v <= 1.0 for v in meter.values().values())
    with pytest.raises(ValueError, match="metric"):
        SaliencyMeter(net, metric="taylor")
    with pytest.raises(ValueError, match="params"):
        SaliencyMeter(net, params="bn")
    with pytest.raises(ValueError, match="normalize"):
        SaliencyMeter(net, normalize="l2")
    with pytest.raises(TypeError, match="model"):
        SaliencyMeter("net")


def test_model_without_blocks_tracks_nothing():
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.LazyLinear(2))
    m(torch.randn(1, 3, 5, 5)).sum().backward()
    meter = SaliencyMeter(m)
    meter.after_backward()
    assert meter.values() == {}


def test_follows_dtype_change_after_creation():
    net = Net()  # float32
    meter = SaliencyMeter(net)
    net.double()
    _backward(net, 0)
    meter.after_backward()
    for n in net.block.branch_names:
        assert meter.values()[("block", n)] == pytest.approx(_hand(net, n, "synflow"), rel=1e-12), n


@pytest.mark.parametrize("metric, normalize", [("synflow", None), ("snip", "numel"), ("grad_norm", None)])
def test_values_computed_elsewhere_accumulate_as_recorded_ones(metric, normalize):
    """``tracked()`` names what each key's value is computed from (an identity-based 1×1 stage at
    its effective weight ``R + I``) and ``accumulate`` adds such values as ``after_backward`` adds
    its own: a meter fed the per-step values computed from them, summed over the steps, reads the
    same values as one that recorded the steps (float64)."""
    net = Net().double()
    recorded = SaliencyMeter(net, metric=metric, normalize=normalize)
    fed = SaliencyMeter(net, metric=metric, normalize=normalize)
    tracked = fed.tracked()
    assert [k for k, _ in tracked] == list(recorded.values() or recorded.counts())
    assert any(eff is not None for _, items in tracked for _, eff in items)  # the 1x1_kxk identity stage
    total = torch.zeros(len(tracked), dtype=torch.float64)
    for seed in range(3):
        _backward(net, seed)
        recorded.after_backward()
        step = []
        for _, items in tracked:
            v = torch.zeros((), dtype=torch.float64)
            for p, eff in items:
                theta = (eff() if eff is not None else p).detach()
                prod = p.grad * p.grad if metric == "grad_norm" else p.grad * theta
                v = v + (prod.abs() if metric == "snip" else prod).sum(dtype=torch.float64)
            numel = max(sum(p.numel() for p, _ in items), 1)
            step.append((v.sqrt() if metric == "grad_norm" else v) / (numel if normalize == "numel" else 1))
        total += torch.stack(step)
    fed.accumulate(total, 3)
    want, got = recorded.values(), fed.values()
    assert want.keys() == got.keys() and fed.counts() == recorded.counts()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-12, abs=1e-15)
    with pytest.raises(ValueError, match="one per tracked key"):
        fed.accumulate(torch.zeros(len(tracked) + 1, dtype=torch.float64), 1)


@pytest.mark.parametrize("metric, normalize", [("synflow", None), ("snip", "numel"), ("grad_norm", None)])
def test_stacked_values_of_copies_equal_each_copys_own(metric, normalize):
    """``stacked_values``: the values of C copies of a model at once, from their gradients and
    parameters stacked along a first axis (a batched cohort's), equal each copy's own meter's
    (float64)."""
    nets = [Net().double() for _ in range(2)]
    with torch.no_grad():
        for p in nets[1].parameters():
            p.mul_(1.3)
    meters = [SaliencyMeter(n, metric=metric, normalize=normalize) for n in nets]
    for k, (net, meter) in enumerate(zip(nets, meters)):
        _backward(net, k)
        meter.after_backward()
    per_copy = [[(p, eff) for _, items in m.tracked() for p, eff in items] for m in meters]
    grads = [torch.stack([pc[j][0].grad for pc in per_copy]) for j in range(len(per_copy[0]))]
    thetas = [torch.stack([(pc[j][1]() if pc[j][1] is not None else pc[j][0]).detach() for pc in per_copy])
              for j in range(len(per_copy[0]))]
    got = meters[0].stacked_values(grads, None if metric == "grad_norm" else thetas)
    for row, meter in zip(got, meters):
        want = torch.tensor(list(meter.values().values()), dtype=torch.float64)
        assert torch.allclose(row, want, rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError, match="one per tracked parameter"):
        meters[0].stacked_values(grads[:-1], None)
    with pytest.raises(ValueError, match="random"):
        SaliencyMeter(nets[0], metric="random").stacked_values(grads, thetas)
