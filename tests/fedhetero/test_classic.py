"""The classic FL methods (FedProx, SCAFFOLD, FedDyn, FedNova) and the shared trainer's options
(Nesterov, clipping, learning-rate schedules, local steps, persistent optimizer state).

Exact reductions (FedProx μ=0 and FedNova with equal work are FedAvg bit for bit), closed forms on
a quadratic toy problem (SCAFFOLD reaches the global optimum where FedAvg stalls at its drift
bias), resume, and the process back end's numbers against local."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fedhetero.models.registry
from fedhetero.algorithms import build_algorithm
from fedhetero.algorithms.base import ClientInfo, ClientResult, state_bytes
from fedhetero.algorithms.fedavg import FedAvg
from fedhetero.algorithms.feddyn import FedDyn, FedDynOptions
from fedhetero.algorithms.fednova import FedNova, normalizing_factor
from fedhetero.config import ConfigError, from_dict
from fedhetero.context import OPTIMIZER_STATE_KEY, Context, client_context
from fedhetero.data import ArrayDataset, FederatedData
from fedhetero.engine import Engine
from fedhetero.engines import run_task
from _util import strip_wall

METHODS = ["fedprox", "scaffold", "feddyn", "fednova"]


def _cfg(name="fedavg", rounds=3, options=None, train=None, data=None, **top):
    return from_dict(
        {
            "seed": 3,
            "threads": 1,
            "data": {"num_clients": 8, **(data or {})},
            "train": {"rounds": rounds, "sample_rate": 0.5, "local_epochs": 1, "checkpoint_every": 1, **(train or {})},
            "algorithm": {"name": name, "options": options or {}},
            **top,
        }
    )


def _run(tmp_path: Path, cfg, tag: str, **kw):
    eng = Engine(cfg, tmp_path / tag, progress=False, **kw)
    return eng, eng.run()




def _state(eng: Engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in eng.algorithm.global_model.state_dict().items()}


def _assert_equal_states(a, b) -> None:
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ---------------------------------------------------------------------------- exact reductions


def test_fedprox_with_mu_zero_is_fedavg_bit_for_bit(tmp_path):
    a, ra = _run(tmp_path, _cfg("fedavg"), "avg")
    b, rb = _run(tmp_path, _cfg("fedprox", options={"mu": 0.0}), "prox")
    _assert_equal_states(_state(a), _state(b))
    assert [r["accuracy"] for r in ra.metrics] == [r["accuracy"] for r in rb.metrics]
    # and the proximal term does change the numbers when μ > 0
    c, _ = _run(tmp_path, _cfg("fedprox", options={"mu": 0.5}), "prox_on")
    assert not torch.equal(_state(a)["fc1.weight"], _state(c)["fc1.weight"])


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_fednova_with_equal_local_steps_is_fedavg_bit_for_bit(tmp_path, momentum):
    """Equal τ_i give equal a_i, so c_i = τ_eff/a_i = 1 and the normalised step is the weighted
    average itself (the server computes it as Σ p_i c_i y_i, the same sums as FedAvg)."""
    train = {"local_steps": 7, "momentum": momentum}
    a, _ = _run(tmp_path, _cfg("fedavg", train=train), "avg")
    b, rb = _run(tmp_path, _cfg("fednova", train=train), "nova")
    _assert_equal_states(_state(a), _state(b))
    assert {c["steps"] for r in rb.metrics for c in r["clients"]} == {7}


def test_fednova_normalised_update_for_unequal_steps():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    alg = FedNova()
    alg.global_model = model
    x = {k: v.clone() for k, v in model.state_dict().items()}

    class Stub:
        def aggregation_weights(self, updates):
            return [float(u.num_samples) for u in updates]

    steps, rho, ns = [3, 10, 25], 0.9, [50, 20, 30]
    results = []
    for i, (tau, n) in enumerate(zip(steps, ns)):
        y = {k: (v + torch.randn_like(v) if v.is_floating_point() else v + i + 1) for k, v in x.items()}
        results.append(ClientResult(cid=i, num_samples=n, state=y, payload={"a": normalizing_factor(tau, rho), "tau": tau}))
    alg.aggregate(Stub(), results)
    got = model.state_dict()
    p = np.array(ns, dtype=np.float64) / sum(ns)
    a = np.array([(t - rho * (1 - rho**t) / (1 - rho)) / (1 - rho) for t in steps])
    tau_eff = float((p * a).sum())
    for key in ("0.weight", "0.bias", "2.weight", "2.bias"):
        x64 = x[key].double()
        d = sum(pi * (x64 - r.state[key].double()) / ai for pi, r, ai in zip(p, results, a))
        expected = x64 - tau_eff * d
        assert torch.allclose(got[key].double(), expected, rtol=0, atol=1e-6), key
        # not FedAvg: the client with more steps no longer dominates
        fedavg = sum(pi * r.state[key].double() for pi, r in zip(p, results))
        assert not torch.allclose(got[key].double(), fedavg, atol=1e-3)
    # BatchNorm statistics are averaged; the integer counter is the first client's
    avg_mean = sum(pi * r.state["1.running_mean"].double() for pi, r in zip(p, results))
    assert torch.allclose(got["1.running_mean"].double(), avg_mean, atol=1e-6)
    assert torch.equal(got["1.num_batches_tracked"], results[0].state["1.num_batches_tracked"])


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("tau", [1, 4, 13])
def test_fednova_factor_is_the_total_weight_of_the_gradients(tau, nesterov):
    """With a constant gradient g, τ SGD steps move the weights by η·a·g: a = ‖a_i‖₁."""
    rho, lr = 0.9, 0.01
    w = nn.Parameter(torch.zeros(1, dtype=torch.float64))
    opt = torch.optim.SGD([w], lr=lr, momentum=rho, nesterov=nesterov)
    for _ in range(tau):
        opt.zero_grad()
        w.sum().backward()  # gradient 1
        opt.step()
    assert normalizing_factor(tau, rho, nesterov) == pytest.approx(-float(w.detach()) / lr, rel=1e-12)
    assert normalizing_factor(tau, 0.0) == tau


def test_fednova_reports_unequal_steps_per_client(tmp_path):
    _, res = _run(tmp_path, _cfg("fednova", rounds=1, train={"local_epochs": 2, "batch_size": 16}), "nova")
    clients = res.metrics[0]["clients"]
    for c in clients:
        assert c["steps"] == 2 * math.ceil(c["num_samples"] / 16)
        assert c["a"] == pytest.approx(normalizing_factor(c["steps"], 0.9))
    assert len({c["steps"] for c in clients}) > 1


def test_feddyn_alpha_to_zero_limit(tmp_path):
    """α → 0: the client half is FedAvg's bit for bit, but the server's h/α does not vanish, so
    one round with full participation gives 2·θ̄ − θ⁰ where FedAvg gives θ̄."""
    kw = {"rounds": 1, "train": {"sample_rate": 1.0}, "data": {"num_clients": 5}}
    init = Engine(_cfg("fedavg", **kw), tmp_path / "init", progress=False)
    init._setup()
    theta0 = _state(init)
    params = {n for n, _ in init.algorithm.global_model.named_parameters()}
    init.backend.close()
    a, ra = _run(tmp_path, _cfg("fedavg", **kw), "avg")
    b, rb = _run(tmp_path, _cfg("feddyn", options={"alpha": 1e-30}, **kw), "dyn")
    # client halves: identical uploads (each client's loss, steps, MACs and bytes are FedAvg's)
    assert ra.metrics[0]["clients"] == rb.metrics[0]["clients"]
    avg, dyn = _state(a), _state(b)
    for k, v in dyn.items():
        if k in params:
            expected = 2 * avg[k].double() - theta0[k].double()
            assert torch.allclose(v.double(), expected, rtol=0, atol=1e-6), k
        else:  # BatchNorm statistics: FedAvg's average
            assert torch.equal(v, avg[k]), k


def _as_dict(cfg):
    from fedhetero.config import to_dict

    return to_dict(cfg)


def test_feddyn_server_update_closed_form():
    torch.manual_seed(1)
    model = nn.Linear(3, 2)
    alg = FedDyn(FedDynOptions(alpha=0.3))
    alg.global_model = model
    alg.h = {k: torch.zeros_like(v) for k, v in model.named_parameters()}

    class Stub:
        class cfg:
            class train:
                aggregation = "samples"

        class data:
            client_indices = [np.arange(n) for n in (10, 30, 20, 40)]  # 100 samples in all

        def aggregation_weights(self, updates):
            return [float(u.num_samples) for u in updates]

    h = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in model.named_parameters()}
    for rnd, cids in enumerate([[0, 2], [1, 2, 3]]):
        x = {k: v.detach().double().clone() for k, v in model.state_dict().items()}
        results = [
            ClientResult(cid=c, num_samples=(10, 30, 20, 40)[c], state={k: (v + torch.randn_like(v)).float() for k, v in x.items()})
            for c in cids
        ]
        alg.aggregate(Stub(), results)
        n = np.array([r.num_samples for r in results], dtype=np.float64)
        p, w = n / n.sum(), n / 100.0
        for k in x:
            h[k] = h[k] - 0.3 * sum(wi * (r.state[k].double() - x[k]) for wi, r in zip(w, results))
            expected = sum(pi * r.state[k].double() for pi, r in zip(p, results)) - h[k] / 0.3
            assert torch.allclose(model.state_dict()[k].double(), expected, atol=1e-5), (rnd, k)
            assert torch.allclose(alg.h[k].double(), h[k], atol=1e-6)


# ---------------------------------------------------------------------------- quadratic toy problem
#
# Client i holds two copies of the sample (x_i, t_i); the model is one weight w and the loss
# ½(w·x − t)², so f_i(w) = ½·a_i·(w − b_i)² with a_i = x_i², b_i = t_i/x_i. Full-batch local
# steps: K = local_epochs gradient steps of size η. The global optimum of the (equally weighted)
# objective is w* = Σ a_i b_i / Σ a_i. FedAvg's fixed point is where the averaged K-step maps
# return w: w_fa = Σ (1 − q_i) b_i / Σ (1 − q_i), q_i = (1 − η a_i)^K — a client-drift bias.

_X = [1.0, 2.0, 0.5, 1.5]
_B = [1.0, -1.0, 2.0, 0.5]
_LR, _K = 0.2, 5


class _Quad(nn.Module):
    def __init__(self, **_: object) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return (self.w * z[:, 0, 0, 0] - z[:, 1, 0, 0]).unsqueeze(1)


def _half_square(out: torch.Tensor, _y: torch.Tensor) -> torch.Tensor:
    return 0.5 * (out**2).mean()


class _QuadContext(Context):
    """The real context and trainer, with the toy's squared loss as the base loss."""

    def train(self, model, client, epochs, **kw):  # type: ignore[override]
        kw["loss_fn"] = kw.get("loss_fn") or _half_square
        return super().train(model, client, epochs, **kw)


def _toy(monkeypatch, name: str, options: dict, rounds: int, momentum: float = 0.0):
    monkeypatch.setitem(fedhetero.models.registry._MODELS, "toyquad", _Quad)
    cfg = from_dict(
        {
            "seed": 0,
            "threads": 1,
            "dtype": "float64",
            "model": {"name": "toyquad", "norm": "none"},
            "data": {"num_clients": len(_X)},
            "train": {"rounds": rounds, "lr": _LR, "momentum": momentum, "weight_decay": 0.0, "batch_size": 8, "local_epochs": _K},
            "algorithm": {"name": name, "options": options},
        }
    )
    rows = torch.tensor([[x, x * b] for x, b in zip(_X, _B) for _ in range(2)], dtype=torch.float32)
    images = rows.view(-1, 2, 1, 1)
    ds = ArrayDataset(images=images, labels=torch.zeros(len(rows), dtype=torch.int64), num_classes=1)
    data = FederatedData(train=ds, test=ds, client_indices=[np.array([2 * i, 2 * i + 1]) for i in range(len(_X))])
    store: dict[int, dict] = {}
    holder: list[Context] = []

    def execute(alg, tasks):
        out = []
        for t in sorted(tasks, key=lambda t: t.cid):
            o = run_task(lambda: type(alg)(alg.options), holder[0], t, store.get(t.cid))
            assert o.error is None, o.detail
            if o.result.client_state is not None:
                store[t.cid] = o.result.client_state
            out.append(o.result)
        return out

    ctx = _QuadContext(cfg, data, None, torch.device("cpu"), executor=execute)  # type: ignore[arg-type]
    holder.append(ctx)
    alg = build_algorithm(cfg)
    alg.setup(ctx)
    trace = []
    for rnd in range(1, rounds + 1):
        ctx.round = rnd
        clients = [ClientInfo(cid=i, tier="all", ratio=1.0, budget_macs=1.0, num_samples=2, round=rnd) for i in range(len(_X))]
        alg.run_round(ctx, clients)
        trace.append(float(alg.global_model.w.detach()))
    return trace, alg, store


def _closed_forms():
    a = np.array(_X) ** 2
    b = np.array(_B)
    w_star = float((a * b).sum() / a.sum())
    q = (1 - _LR * a) ** _K
    w_fa = float(((1 - q) * b).sum() / (1 - q).sum())
    return w_star, w_fa


def test_scaffold_reaches_the_optimum_where_fedavg_stalls(monkeypatch):
    w_star, w_fa = _closed_forms()
    assert abs(w_star - w_fa) > 0.3  # the drift bias is large here (w* ≈ −0.183, w_fa ≈ 0.211)
    fedavg, _, _ = _toy(monkeypatch, "fedavg", {}, rounds=60)
    assert fedavg[-1] == pytest.approx(w_fa, abs=1e-9)
    scaffold, alg, store = _toy(monkeypatch, "scaffold", {}, rounds=300)
    assert scaffold[-1] == pytest.approx(w_star, abs=1e-9)
    # at the fixed point every c_i is the client's gradient at w*, and c their mean (zero)
    a, b = np.array(_X) ** 2, np.array(_B)
    for i in range(len(_X)):
        assert float(store[i]["c_i"]["w"]) == pytest.approx(a[i] * (w_star - b[i]), abs=1e-7)
    assert float(alg.c["w"]) == pytest.approx(0.0, abs=1e-9)


def test_feddyn_reaches_the_optimum_on_the_toy(monkeypatch):
    w_star, _ = _closed_forms()
    trace, alg, store = _toy(monkeypatch, "feddyn", {"alpha": 0.5}, rounds=400)
    assert trace[-1] == pytest.approx(w_star, abs=1e-7)
    assert float(alg.h["w"]) == pytest.approx(0.0, abs=1e-7)
    a, b = np.array(_X) ** 2, np.array(_B)
    for i in range(len(_X)):  # g_i → ∇f_i(w*)
        assert float(store[i]["grad"]["w"]) == pytest.approx(a[i] * (w_star - b[i]), abs=1e-6)


def test_scaffold_dyninit_variant_is_a_scaled_fedavg_step(monkeypatch):
    """The DynInit authors' variant: uncorrected local steps, server step scaled by the client
    learning rate: x¹ = x⁰ + η·(FedAvg's average − x⁰); its fixed point is FedAvg's."""
    _, w_fa = _closed_forms()
    fedavg, _, _ = _toy(monkeypatch, "fedavg", {}, rounds=1)
    dyn, _, _ = _toy(monkeypatch, "scaffold", {"variant": "dyninit"}, rounds=1)
    assert dyn[0] == pytest.approx(0.0 + _LR * (fedavg[0] - 0.0), abs=1e-12)
    dyn, _, _ = _toy(monkeypatch, "scaffold", {"variant": "dyninit"}, rounds=150)
    assert dyn[-1] == pytest.approx(w_fa, abs=1e-6)


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


def test_method_options_are_validated():
    for name, options, field in [
        ("fedprox", {"mu": -0.1}, "mu"),
        ("scaffold", {"variant": "authors"}, "variant"),
        ("scaffold", {"server_lr": 0.0}, "server_lr"),
        ("feddyn", {"alpha": 0.0}, "alpha"),
        ("fednova", {"rho": 0.5}, "rho"),
    ]:
        with pytest.raises(ConfigError, match=field):
            build_algorithm(_cfg(name, options=options))
    assert build_algorithm(_cfg("fedprox")).options.mu == 0.01
    assert build_algorithm(_cfg("feddyn")).options.alpha == 0.01
    opts = build_algorithm(_cfg("scaffold")).options
    assert (opts.variant, opts.server_lr) == ("standard", 1.0)


# ---------------------------------------------------------------------------- runs


def test_scaffold_counts_two_tensors_each_way(tmp_path):
    eng, res = _run(tmp_path, _cfg("scaffold", rounds=1), "s")
    model = eng.algorithm.global_model
    full = state_bytes(model.state_dict())
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    for c in res.metrics[0]["clients"]:
        assert c["bytes_up"] == full + params
        assert c["bytes_down"] == full + params
    _, ra = _run(tmp_path, _cfg("fedavg", rounds=1), "a")
    assert all(c["bytes_up"] == full for c in ra.metrics[0]["clients"])


@pytest.mark.parametrize("name, options", [("scaffold", {}), ("scaffold", {"variant": "dyninit"}), ("feddyn", {}), ("fednova", {})])
def test_resume_equals_uninterrupted(tmp_path, name, options):
    cfg = _cfg(name, rounds=4, options=options, train={"optimizer_state": "persistent"} if name == "fednova" else None)
    full, rf = _run(tmp_path, cfg, "full")
    _run(tmp_path, cfg, "cut", stop_after=2)
    resumed, rr = _run(tmp_path, None, "cut", resume=True)
    assert strip_wall(rr.metrics) == strip_wall(rf.metrics)
    sa, sb = full.algorithm.state_dict(), resumed.algorithm.state_dict()
    assert set(sa) == set(sb)
    for key in sa:
        _assert_equal_states(sa[key], sb[key])


# every trainer option at once, including momentum buffers kept by the workers' clients
_ALL_TRAINER_OPTIONS = {
    "optimizer_state": "persistent",
    "nesterov": True,
    "clip_grad_norm": 1.0,
    "lr_schedule": "cosine",
    "lr_min": 0.001,
    "local_steps": 5,
}


@pytest.mark.parametrize("name", METHODS)
def test_process_backend_gives_the_numbers_of_local(tmp_path, name):
    cfg_local = _cfg(name, rounds=2, train=_ALL_TRAINER_OPTIONS if name == "fedprox" else None)
    cfg_proc = from_dict({**_as_dict(cfg_local), "engine": {"backend": "process", "workers": 2}})
    a, ra = _run(tmp_path, cfg_local, "local")
    b, rb = _run(tmp_path, cfg_proc, "process")
    assert strip_wall(ra.metrics) == strip_wall(rb.metrics)
    if name == "fedprox":  # a client of round 2 started from the buffers it kept in round 1
        first, second = ({c["cid"] for c in r["clients"]} for r in ra.metrics)
        assert first & second
        assert {c["steps"] for r in ra.metrics for c in r["clients"]} == {5}
    sa, sb = a.algorithm.state_dict(), b.algorithm.state_dict()
    for key in sa:
        _assert_equal_states(sa[key], sb[key])


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("model", [{"name": "cnn", "norm": "none", "width": 0.25}, {"name": "logreg"}])
def test_methods_run_on_other_models_and_data(tmp_path, name, model):
    """The corrections apply to any model's parameters: a BatchNorm-free CNN and logistic
    regression, on another data set."""
    cfg = _cfg(name, rounds=2, data={"dataset": "synthetic", "synthetic_size": 200, "num_clients": 4}, model=model)
    _, res = _run(tmp_path, cfg, "other")
    assert all(math.isfinite(r["loss"]) for r in res.metrics)
