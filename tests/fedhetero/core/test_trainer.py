"""The shared trainer (``ClientContext.train``) and its options against plain torch SGD: momentum and
Nesterov, persistent optimizer state through the client state, gradient clipping, learning-rate
schedules, a fixed number of local steps, and the option checks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedhetero.core.exchange.types import ClientInfo
from fedhetero.algorithms.classic.fedavg import FedAvg
from fedhetero.core.common.options import ConfigError
from fedhetero.core.exchange.types import OPTIMIZER_STATE_KEY
from fedhetero.core.local.context import client_context
from fedhetero.core.run.backend import run_task
from _util import equal_states, global_state, local_cfg, run_engine


_cfg = local_cfg
_run = run_engine
_state = global_state
_assert_equal_states = equal_states


# ---------------------------------------------------------------------------- trainer options
def _digits_ctx(**train):
    cfg = _cfg("fedavg", train={"local_epochs": 2, "batch_size": 32, **train})
    return client_context(cfg)


def _info(ctx, cid: int, rnd: int) -> ClientInfo:
    return ClientInfo(cid=cid, tier="small", ratio=1.0, budget_macs=1.0, num_samples=len(ctx.data.client_indices[cid]), round=rnd)


def _manual_rounds(ctx, state0, cid, rounds, make_opt, persistent, clip=None, epochs=2):
    """The reference loop: plain torch SGD over the client's seeded batches."""
    with ctx.seeded("init", 0):
        model = ctx.build_model()
    model.load_state_dict(state0)
    model.train()
    opt = None
    for rnd in range(1, rounds + 1):
        ctx.round = rnd
        if opt is None or not persistent:
            opt = make_opt(model.parameters(), rnd)
        for e in range(epochs):
            for x, y in ctx.client_batches(cid, e):
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x), y).backward()
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(list(model.parameters()), clip)
                opt.step()
    return model.state_dict()


def _trainer_rounds(ctx, state0, cid, rounds):
    """FedAvg's client half run through run_task for ``rounds`` rounds of one client (the server
    sends back what the client uploaded), with the client state going round."""
    state, private = state0, None
    for rnd in range(1, rounds + 1):
        info = _info(ctx, cid, rnd)
        task = FedAvg.task(ctx, info, {"state": state})
        out = run_task(lambda: FedAvg(), ctx, task, private)
        assert out.error is None, out.detail
        state = out.result.state
        if out.result.client_state is not None:
            private = out.result.client_state
    return state, private


def _initial_state(ctx):
    with ctx.seeded("init", 1):
        return {k: v.clone() for k, v in ctx.build_model().state_dict().items()}


@pytest.mark.parametrize(
    "train, nesterov, persistent, momentum",
    [
        ({}, False, False, 0.9),  # the default: a fresh buffer every round
        ({"nesterov": True}, True, False, 0.9),
        ({"optimizer_state": "persistent"}, False, True, 0.9),
        ({"optimizer_state": "persistent", "nesterov": True}, True, True, 0.9),
        ({"optimizer_state": "none"}, False, False, 0.0),
    ],
)
def test_trainer_matches_torch_sgd(train, nesterov, persistent, momentum):
    ctx = _digits_ctx(**train)
    t = ctx.cfg.train
    state0 = _initial_state(ctx)
    got, private = _trainer_rounds(ctx, state0, cid=2, rounds=2)

    def make_opt(params, rnd):
        return torch.optim.SGD(params, lr=t.lr, momentum=momentum, weight_decay=t.weight_decay, nesterov=nesterov)

    expected = _manual_rounds(ctx, state0, 2, 2, make_opt, persistent)
    _assert_equal_states(got, expected)
    if persistent:
        bufs = private[OPTIMIZER_STATE_KEY]
        assert set(bufs) == {n for n, p in ctx.build_model().named_parameters()}
    else:
        assert private is None


def test_persistent_momentum_round_trip_through_client_state():
    ctx = _digits_ctx(optimizer_state="persistent")
    model = ctx.build_model()
    bufs = {n: torch.full_like(p, 0.25) for n, p in model.named_parameters()}
    bufs["fc3.weight"] = torch.zeros(3, 3)  # a shape that no longer fits: a fresh buffer
    with ctx.client_scope(_info(ctx, 0, 1), optimizer_state=bufs):
        opt = ctx.make_optimizer(model)
        loaded = {n: opt.state[p].get("momentum_buffer") for n, p in model.named_parameters()}
        assert loaded["fc3.weight"] is None
        assert all(torch.equal(loaded[n], bufs[n]) for n in bufs if n != "fc3.weight")
        assert ctx.optimizer_state() is not None
    # the client half never sees the key; what it returns gets the new buffers added
    seen = []

    class Probe(FedAvg):
        def client_update(self, ctx, task, state):
            seen.append(state)
            out = super().client_update(ctx, task, state)
            out.client_state = {"mine": torch.tensor(1)}
            return out

    task = FedAvg.task(ctx, _info(ctx, 0, 1), {"state": _initial_state(ctx)})
    out = run_task(lambda: Probe(), ctx, task, {"mine": torch.tensor(0), OPTIMIZER_STATE_KEY: bufs})
    assert out.error is None, out.detail
    assert set(seen[0]) == {"mine"}
    assert set(out.result.client_state) == {"mine", OPTIMIZER_STATE_KEY}
    assert not torch.equal(out.result.client_state[OPTIMIZER_STATE_KEY]["fc1.weight"], bufs["fc1.weight"])
    # only the algorithm's key: the other modes store nothing extra
    plain = _digits_ctx()
    out = run_task(lambda: Probe(), plain, FedAvg.task(plain, _info(plain, 0, 1), {"state": _initial_state(plain)}), None)
    assert set(out.result.client_state) == {"mine"}


def test_persistent_optimizer_state_in_a_run(tmp_path):
    eng, res = _run(tmp_path, _cfg("fedavg", rounds=3, train={"optimizer_state": "persistent"}), "p")
    trained = {c["cid"] for r in res.metrics for c in r["clients"]}
    for cid in trained:
        st = eng.store.get(cid, before_round=10)
        assert OPTIMIZER_STATE_KEY in st and "fc1.weight" in st[OPTIMIZER_STATE_KEY]
    # it changes the numbers (a client sampled twice starts with its old buffer)
    base, _ = _run(tmp_path, _cfg("fedavg", rounds=3), "r")
    assert not torch.equal(_state(base)["fc1.weight"], _state(eng)["fc1.weight"])


def test_gradient_clipping_bounds_the_norm():
    clip = 0.05
    ctx = _digits_ctx(clip_grad_norm=clip)
    state0 = _initial_state(ctx)
    raw, stepped = [], []

    def norm(model):
        return float(torch.norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])))

    class Recording(torch.optim.SGD):
        def step(self, closure=None):
            stepped.append(float(torch.norm(torch.stack([p.grad.norm() for g in self.param_groups for p in g["params"] if p.grad is not None]))))
            return super().step(closure)

    model = ctx.build_model()
    model.load_state_dict(state0)
    info = _info(ctx, 1, 1)
    with ctx.client_scope(info):
        opt = Recording(model.parameters(), lr=ctx.cfg.train.lr)
        ctx.train(model, info, 2, optimizer=opt, after_backward=lambda m: raw.append(norm(m)))
    assert max(raw) > clip and len(stepped) == len(raw)
    assert max(stepped) <= clip * (1 + 1e-5)
    # the same as torch's clip_grad_norm_ in a plain loop
    got, _ = _trainer_rounds(ctx, state0, cid=1, rounds=1)
    t = ctx.cfg.train
    expected = _manual_rounds(
        ctx, state0, 1, 1, lambda ps, r: torch.optim.SGD(ps, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay), False, clip=clip
    )
    _assert_equal_states(got, expected)


def test_learning_rate_schedules():
    const = _digits_ctx(lr=0.1)
    assert [const.lr_at(r) for r in (1, 2, 3)] == [0.1, 0.1, 0.1]
    cos = _digits_ctx(lr=0.1, lr_min=0.001, lr_schedule="cosine")  # rounds = 3
    assert cos.lr_at(1) == pytest.approx(0.1)
    assert cos.lr_at(2) == pytest.approx(0.001 + 0.099 * 0.5 * (1 + math.cos(math.pi / 3)))  # 0.07525
    assert cos.lr_at(3) == pytest.approx(0.001 + 0.099 * 0.5 * (1 + math.cos(2 * math.pi / 3)))  # 0.02575
    poly = _digits_ctx(lr=0.03, lr_min=0.027, lr_schedule="polynomial", lr_power=0.9)
    assert poly.lr_at(1) == pytest.approx(0.03)
    assert poly.lr_at(2) == pytest.approx(0.027 + 0.003 * (2 / 3) ** 0.9)
    assert poly.lr_at(3) == pytest.approx(0.027 + 0.003 * (1 / 3) ** 0.9)
    # the FedDU family's device decay, η_t = η_0·0.99^(t−1), for any method
    expo = _digits_ctx(lr=0.05, lr_schedule="exponential", lr_decay=0.99)
    assert [expo.lr_at(r) for r in (1, 2, 3)] == pytest.approx([0.05, 0.05 * 0.99, 0.05 * 0.99**2], rel=1e-15)
    # torch's CosineAnnealingLR stepped once per round gives the same values
    w = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([w], lr=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=3, eta_min=0.001)
    for r in (1, 2, 3):
        assert opt.param_groups[0]["lr"] == pytest.approx(cos.lr_at(r), rel=1e-12)
        opt.step()
        sched.step()
    # the client's optimizer takes the rate of its round
    model = cos.build_model()
    for r in (1, 3):
        with cos.client_scope(_info(cos, 0, r)):
            assert cos.make_optimizer(model).param_groups[0]["lr"] == pytest.approx(cos.lr_at(r))
    with pytest.raises(ConfigError, match="train.lr_min"):
        _cfg(train={"lr": 0.1, "lr_min": 0.2})
    with pytest.raises(ConfigError, match="train.lr_schedule"):
        _cfg(train={"lr_schedule": "step"})
    with pytest.raises(ConfigError, match="train.lr_power"):
        _cfg(train={"lr_power": 0})


def test_local_steps_count_and_cycle_through_the_batches():
    ctx = _digits_ctx(local_steps=11, batch_size=64)
    cid = 4
    per_pass = math.ceil(len(ctx.data.client_indices[cid]) / 64)
    assert per_pass < 11  # the steps run over more than one pass
    state0 = _initial_state(ctx)
    t = ctx.cfg.train
    epochs_seen = []
    model = ctx.build_model()
    model.load_state_dict(state0)
    info = _info(ctx, cid, 1)
    with ctx.client_scope(info):
        rep = ctx.train(model, info, t.local_epochs, on_epoch_end=lambda e, m, o: epochs_seen.append(e))
    assert rep["steps"] == 11 and epochs_seen == [0, 1]
    # reference: steps 0..10 take batch s mod B of pass s div B
    with ctx.seeded("init", 0):
        ref = ctx.build_model()
    ref.load_state_dict(state0)
    ref.train()
    ctx.round = 1
    opt = torch.optim.SGD(ref.parameters(), lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
    batches = [b for p in range(math.ceil(11 / per_pass)) for b in ctx.client_batches(cid, p)]
    assert len(batches) >= 11
    for x, y in batches[:11]:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ref(x), y).backward()
        opt.step()
    _assert_equal_states(model.state_dict(), ref.state_dict())
    # a local round split by epochs over two calls takes the same steps (⌊11·1/2⌋ = 5, then 6)
    split = ctx.build_model()
    split.load_state_dict(state0)
    with ctx.client_scope(info):
        opt = ctx.make_optimizer(split)
        r1 = ctx.train(split, info, 1, optimizer=opt)
        r2 = ctx.train(split, info, 1, optimizer=opt, first_epoch=1)
    assert (r1["steps"], r2["steps"]) == (5, 6)
    _assert_equal_states(split.state_dict(), model.state_dict())
    # fewer steps than epochs: some epochs are empty, the total is still local_steps
    few = _digits_ctx(local_steps=1, local_epochs=3)
    m = few.build_model()
    with few.client_scope(_info(few, 0, 1)):
        assert few.train(m, _info(few, 0, 1), 3)["steps"] == 1
    with pytest.raises(ConfigError, match="train.local_steps"):
        _cfg(train={"local_steps": 0})


def test_trainer_options_are_validated():
    with pytest.raises(ConfigError, match="train.nesterov"):
        _cfg(train={"nesterov": True, "momentum": 0.0})
    with pytest.raises(ConfigError, match="train.nesterov"):
        _cfg(train={"nesterov": True, "optimizer_state": "none"})
    with pytest.raises(ConfigError, match="train.clip_grad_norm"):
        _cfg(train={"clip_grad_norm": 0})
    with pytest.raises(ConfigError, match="train.optimizer_state"):
        _cfg(train={"optimizer_state": "keep"})
    assert _cfg(train={"clip_grad_norm": 10}).train.clip_grad_norm == 10.0
