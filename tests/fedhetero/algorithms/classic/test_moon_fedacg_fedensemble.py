"""MOON, FedACG and FedEnsemble.

End to end on a small digits run: each method reduces to FedAvg bit for bit when its extra term is
switched off (MOON μ = 0, FedACG λ = β = 0, FedEnsemble K = 1), gives the same numbers on the process
back end as on local, resumes to the numbers of an uninterrupted run and learns (accuracy well above
chance after 3 rounds). Unit level: MOON's contrastive loss on a hand-made example, FedACG's
lookahead, momentum and regulariser against their formulas, FedEnsemble's permutation schedule and
inference, and the option checks.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from fedhetero.core.exchange.types import ClientResult
from fedhetero.algorithms.classic.fedacg import FedACG, FedACGOptions, lookahead_state
from fedhetero.algorithms.classic.fedensemble import EnsembleModel
from fedhetero.algorithms.classic.moon import moon_contrastive_loss
from fedhetero.core.local.objective import LocalSGD, move_consts
from fedhetero.core.common.options import ConfigError
from fedhetero.core.run.engine import Engine
from fedhetero.core.method.registry import build_algorithm
from _util import SharedRuns, equal_states, fedavg_cfg, strip_wall


METHODS = ["moon", "fedacg", "fedensemble"]


OFF = {  # the options that switch each method's extra term off
    "moon": {"mu": 0.0},
    "fedacg": {"lam": 0.0, "beta": 0.0},
    "fedensemble": {"num_models": 1},
}


_cfg = fedavg_cfg


def _state(eng: Engine) -> dict[str, torch.Tensor]:
    return eng.algorithm.global_model.state_dict()


_assert_equal_states = equal_states
_Runs = SharedRuns


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> _Runs:
    return _Runs(tmp_path_factory.mktemp("moon_fedacg_fedensemble"))


# ---------------------------------------------------------------------- end to end
@pytest.mark.parametrize("name", METHODS)
def test_switched_off_equals_fedavg_bit_for_bit(runs, name):
    ref, ref_res = runs.get("fedavg", _cfg("fedavg"))
    eng, res = runs.get(f"{name}-off", _cfg(name, options=OFF[name]))
    state = _state(eng)
    if name == "fedensemble":  # the one member of a K = 1 ensemble
        state = {k.removeprefix("members.0."): v for k, v in state.items()}
    _assert_equal_states(_state(ref), state)
    assert [r["accuracy"] for r in res.metrics] == [r["accuracy"] for r in ref_res.metrics]
    clients = [c for r in res.metrics for c in r["clients"]]
    # the switched-off term was computed (multiplied by zero), not skipped
    if name == "moon":
        assert any("contrastive_loss" in c for c in clients)


@pytest.mark.parametrize("name", METHODS)
def test_learns_and_process_backend_matches_local(runs, name):
    local, rl = runs.get(f"{name}-local", _cfg(name))
    assert rl.summary["final_accuracy"] > 0.3  # 10 classes: chance is 0.1
    proc, rp = runs.get(f"{name}-process", _cfg(name, "process", workers=2))
    assert strip_wall(rp.metrics) == strip_wall(rl.metrics)
    _assert_equal_states(_state(local), _state(proc))
    if name == "fedacg":
        for k, v in local.algorithm.momentum.items():
            assert torch.equal(v, proc.algorithm.momentum[k]), k
            assert v.abs().sum() > 0


@pytest.mark.parametrize("name", METHODS)
def test_resume_equals_uninterrupted(runs, name):
    full, rf = runs.get(f"{name}-local", _cfg(name))
    Engine(_cfg(name), runs.root / f"{name}-cut", progress=False, stop_after=1).run()
    resumed = Engine(None, runs.root / f"{name}-cut", progress=False, resume=True)
    rr = resumed.run()
    assert strip_wall(rr.metrics) == strip_wall(rf.metrics)
    _assert_equal_states(_state(full), _state(resumed))
    if name == "moon":  # a client's previous model went through the on-disk store
        assert resumed.store.clients()


# ---------------------------------------------------------------------- MOON
def test_moon_contrastive_loss_matches_its_formula():
    z = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    z_glob = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    z_prev = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    tau = 0.5
    # row 1: cos = 1 (global), 0 (previous); row 2: cos = 1/√2 (global), 1 (previous)
    row1 = -math.log(math.exp(1 / tau) / (math.exp(1 / tau) + math.exp(0 / tau)))
    row2 = -math.log(math.exp(2**-0.5 / tau) / (math.exp(2**-0.5 / tau) + math.exp(1 / tau)))
    got = moon_contrastive_loss(z, z_glob, z_prev, tau)
    assert got.item() == pytest.approx((row1 + row2) / 2, rel=1e-6)
    # identical positive and negative: log 2 and no gradient
    zz = torch.randn(4, 8, requires_grad=True)
    other = torch.randn(4, 8)
    loss = moon_contrastive_loss(zz, other, other, 0.7)
    loss.backward()
    assert loss.item() == pytest.approx(math.log(2), rel=1e-6)
    assert zz.grad.abs().max() < 1e-6


# ---------------------------------------------------------------------- FedACG
def test_fedacg_lookahead_momentum_and_regulariser_follow_the_formulas():
    lam, beta = 0.5, 0.1
    torch.manual_seed(0)
    algo = FedACG(FedACGOptions(lam=lam, beta=beta))
    algo.global_model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    w = {k: v.clone() for k, v in algo.global_model.state_dict().items()}
    params = [k for k, _ in algo.global_model.named_parameters()]
    algo.momentum = {k: torch.randn_like(w[k]) for k in params}
    m = {k: v.clone() for k, v in algo.momentum.items()}

    theta0 = lookahead_state(w, m, lam)
    for k in w:
        expected = w[k] + lam * m[k] if k in params else w[k]
        assert torch.allclose(theta0[k], expected, atol=1e-7), k

    counts = [3, 1, 4]
    thetas = [{k: (v + torch.randn_like(v) if v.is_floating_point() else v) for k, v in theta0.items()} for _ in counts]
    results = [ClientResult(cid=i, num_samples=n, state=s) for i, (n, s) in enumerate(zip(counts, thetas))]
    ctx = SimpleNamespace(aggregation_weights=lambda rs: [float(r.num_samples) for r in rs])
    algo.aggregate(ctx, results)
    p = [n / sum(counts) for n in counts]
    new = algo.global_model.state_dict()
    for k in params:
        m_new = lam * m[k] + sum(pk * (t[k] - theta0[k]) for pk, t in zip(p, thetas))
        assert torch.allclose(algo.momentum[k], m_new, atol=1e-5), k
        assert torch.allclose(new[k], w[k] + m_new, atol=1e-5), k
    for k in ("1.running_mean", "1.running_var"):  # buffers: plain average, no momentum
        assert torch.allclose(new[k], sum(pk * t[k] for pk, t in zip(p, thetas)), atol=1e-6)
    assert torch.equal(new["1.num_batches_tracked"], thetas[0]["1.num_batches_tracked"])
    nxt = lookahead_state(new, algo.momentum, lam)
    for k in params:
        assert torch.allclose(nxt[k], new[k] + lam * algo.momentum[k], atol=1e-7)

    # client: each step's gradient gains β·(θ − θ₀)
    model = nn.Linear(3, 2)
    sent = {k: v + 1.0 for k, v in model.state_dict().items()}
    ctx = SimpleNamespace(configured_sgd=lambda: LocalSGD(lr=0.1))
    objective = algo.local_plan(ctx, SimpleNamespace(payload={"state": sent}), None).objective
    params = dict(model.named_parameters())
    seen = {k: torch.full_like(q, 0.25) for k, q in params.items()}
    with torch.no_grad():
        objective.grad(params, seen, move_consts(objective.consts, params))
    for k, q in model.named_parameters():
        assert torch.allclose(seen[k], 0.25 + beta * (q.detach() - sent[k]))


# ---------------------------------------------------------------------- FedEnsemble and FedGen
def test_fedensemble_schedule_and_inference(runs):
    eng, _ = runs.get("fedensemble-local", _cfg("fedensemble"))
    algo, ctx = eng.algorithm, eng.ctx
    k = algo.options.num_models
    assert np.bincount(algo.stratum, minlength=k).tolist() == [2] * k  # 10 clients, 5 strata
    for period in range(2):
        rounds = range(period * k + 1, period * k + k + 1)
        table = [algo.assignment(ctx, r) for r in rounds]
        for row in table:  # every round: a permutation of the models over the strata
            assert sorted(row.values()) == list(range(k))
        for s in range(k):  # every period: each stratum trains every model once
            assert sorted(row[s] for row in table) == list(range(k))
    # inference: log of the mean of the members' probabilities
    x = ctx.data.test.images[:5]
    ens = algo.eval_models(ctx)["global"].eval()
    with torch.no_grad():
        probs = torch.stack([torch.softmax(m(x), 1) for m in ens.members]).mean(0)
        assert torch.allclose(ens(x).exp(), probs, atol=1e-6)
    single = EnsembleModel([ens.members[0]])
    with torch.no_grad():
        assert torch.equal(single(x), ens.members[0](x))


@pytest.mark.parametrize(
    "name, options, field",
    [
        ("moon", {"tau": 0.0}, "tau"),
        ("moon", {"mu": -1.0}, "mu"),
        ("fedacg", {"lam": 1.0}, "lam"),
        ("fedacg", {"beta": -0.1}, "beta"),
        ("fedensemble", {"num_models": 0}, "num_models"),
    ],
)
def test_option_ranges_are_checked(name, options, field):
    with pytest.raises(ConfigError, match=f"algorithm.options.{field}"):
        build_algorithm(_cfg(name, options=options))
