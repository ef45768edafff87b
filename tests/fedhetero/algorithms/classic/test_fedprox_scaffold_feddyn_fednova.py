"""FedProx, SCAFFOLD, FedDyn and FedNova.

Exact reductions (FedProx μ=0 and FedNova with equal work are FedAvg bit for bit, FedDyn's α → 0
limit), closed forms on a quadratic toy problem (SCAFFOLD reaches the global optimum where FedAvg
stalls at its drift bias), the option checks, resume, and the process back end's numbers against
local."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import fedhetero.models.registry
from fedhetero.algorithms import build_algorithm
from fedhetero.core.exchange.types import ClientInfo, ClientResult, state_bytes
from fedhetero.algorithms.classic.feddyn import FedDyn, FedDynOptions
from fedhetero.algorithms.classic.fednova import FedNova, normalizing_factor
from fedhetero.core.common.config import from_dict
from fedhetero.core.common.options import ConfigError
from fedhetero.core.local.context import ClientContext, Context, build_data
from fedhetero.data import ArrayDataset, FederatedData
from fedhetero.core.run.backend import run_task
from _util import equal_states, global_state, local_cfg, run_engine, strip_wall


METHODS = ["fedprox", "scaffold", "feddyn", "fednova"]


_cfg = local_cfg
_run = run_engine
_state = global_state
_assert_equal_states = equal_states


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
    cfg0 = _cfg("fedavg", **kw)
    ctx0 = Context(cfg0, build_data(cfg0), None, torch.device("cpu"))  # type: ignore[arg-type]
    init = build_algorithm(cfg0)
    with ctx0.seeded("init", 1):  # as the engine sets a method up
        init.setup(ctx0)
    theta0 = {k: v.detach().clone() for k, v in init.global_model.state_dict().items()}
    params = {n for n, _ in init.global_model.named_parameters()}
    a, ra = _run(tmp_path, _cfg("fedavg", **kw), "avg")
    b, rb = _run(tmp_path, _cfg("feddyn", options={"alpha": 1e-30}, **kw), "dyn")
    # client halves: identical uploads (each client's loss, steps, MACs and bytes are FedAvg's)
    assert strip_wall(ra.metrics)[0]["clients"] == strip_wall(rb.metrics)[0]["clients"]
    avg, dyn = _state(a), _state(b)
    for k, v in dyn.items():
        if k in params:
            expected = 2 * avg[k].double() - theta0[k].double()
            assert torch.allclose(v.double(), expected, rtol=0, atol=1e-6), k
        else:  # BatchNorm statistics: FedAvg's average
            assert torch.equal(v, avg[k]), k


def _as_dict(cfg):
    from fedhetero.core.common.config import to_dict

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


class _QuadContext(ClientContext):
    """The real client context and trainer, with the toy's squared loss as the base loss."""

    def train(self, model, client, epochs, **kw):  # type: ignore[override]
        kw["loss_fn"] = kw.get("loss_fn") or _half_square
        return super().train(model, client, epochs, **kw)


@pytest.fixture(autouse=True, scope="module")
def _toy_model():
    """The toy registered as a model for this module's runs (a public registration, undone)."""
    fedhetero.models.register_model("toyquad", _Quad)
    yield
    fedhetero.models.unregister_model("toyquad")


def _toy(monkeypatch, name: str, options: dict, rounds: int, momentum: float = 0.0):
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
    cctx = _QuadContext(cfg, data, torch.device("cpu"))

    def execute(alg, tasks):
        out = []
        for t in sorted(tasks, key=lambda t: t.cid):
            o = run_task(lambda: type(alg)(alg.options), cctx, t, store.get(t.cid))
            assert o.error is None, o.detail
            if o.result.client_state is not None:
                store[t.cid] = o.result.client_state
            out.append(o.result)
        return out

    ctx = Context(cfg, data, None, torch.device("cpu"))  # type: ignore[arg-type]
    alg = build_algorithm(cfg)
    alg.setup(ctx)
    trace = []
    for rnd in range(1, rounds + 1):
        ctx.round = rnd
        clients = [ClientInfo(cid=i, tier="all", ratio=1.0, budget_macs=1.0, num_samples=2, round=rnd) for i in range(len(_X))]
        steps = alg.run_round(ctx, clients)  # a round is data: run each exchange it yields
        try:
            tasks = next(steps)
            while True:
                tasks = steps.send(execute(alg, tasks))
        except StopIteration:
            pass
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


@pytest.mark.slow  # run by: python -m pytest -m slow
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
