"""Local objectives (fedhetero.core.local.objective): a method's rule, written once, gives each client of
a cohort exactly what it gives that client trained alone, for random parameters, gradients,
constants and batches; and the objective's bookkeeping (finish, records) reaches the result."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fedhetero.algorithms.classic.fedacg import FedACG
from fedhetero.algorithms.classic.feddyn import FedDyn
from fedhetero.algorithms.classic.fedprox import FedProx
from fedhetero.algorithms.classic.moon import Moon
from fedhetero.algorithms.classic.scaffold import Scaffold
from fedhetero.algorithms.dyninit.algorithm import DynInit
from fedhetero.core.local.objective import Batch, LocalObjective, LocalSGD, cohort_rules, move_consts, stack_consts
from fedhetero.core.exchange.types import ClientResult

SHAPES = {"w": (3, 4), "b": (3,)}


def _tensors(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {n: torch.randn(s, generator=g, dtype=torch.float64) for n, s in SHAPES.items()}


def _client(method: str, g: torch.Generator):
    """A task and the client's state for ``method`` with random tensors."""
    payload = {"state": _tensors(g)}
    state = None
    if method == "scaffold":
        payload["c"] = _tensors(g)
        state = {"c_i": _tensors(g)}
    elif method == "feddyn":
        state = {"grad": _tensors(g)}
    return SimpleNamespace(payload=payload), state


GRAD_METHODS = {
    "fedprox": lambda: FedProx(FedProx.Options(mu=0.3)),
    "fedacg": lambda: FedACG(FedACG.Options(lam=0.5, beta=0.2)),
    "scaffold": lambda: Scaffold(),
    "feddyn": lambda: FedDyn(FedDyn.Options(alpha=0.1)),
}
_CTX = SimpleNamespace(lr_at=lambda: 0.1, configured_sgd=lambda: LocalSGD(lr=0.1))


def _objective(algo, ctx, task, state):
    """The objective of ``algo``'s local plan for ``task``."""
    return algo.local_plan(ctx or _CTX, task, state).objective


@settings(max_examples=40, deadline=None)
@given(method=st.sampled_from(sorted(GRAD_METHODS)), clients=st.integers(1, 5), seed=st.integers(0, 2**31 - 1))
def test_gradient_rules_are_the_same_alone_and_stacked(method, clients, seed):
    g = torch.Generator().manual_seed(seed)
    algo = GRAD_METHODS[method]()
    objectives, params, grads = [], [], []
    for _ in range(clients):
        task, state = _client(method, g)
        objectives.append(_objective(algo, _CTX, task, state))
        params.append(_tensors(g))
        grads.append(_tensors(g))
    shared = cohort_rules(objectives)
    assert isinstance(shared, LocalObjective) and shared.grad is not None
    alone = []
    for o, p, gr in zip(objectives, params, grads):
        mine = {n: v.clone() for n, v in gr.items()}
        o.grad(p, mine, move_consts(o.consts, p))
        alone.append(mine)
    stacked_p = {n: torch.stack([p[n] for p in params]) for n in SHAPES}
    stacked_g = {n: torch.stack([gr[n] for gr in grads]) for n in SHAPES}
    consts = stack_consts([o.consts for o in objectives], list(SHAPES), "cpu", torch.float64)
    shared.grad(stacked_p, stacked_g, consts)
    for i in range(clients):
        for n in SHAPES:
            assert torch.equal(stacked_g[n][i], alone[i][n]), (method, n)


def _teacher_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w


@settings(max_examples=40, deadline=None)
@given(method=st.sampled_from(["moon", "distil"]), clients=st.integers(1, 4), batch=st.integers(1, 6),
       seed=st.integers(0, 2**31 - 1))
def test_loss_rules_are_the_same_alone_and_stacked(method, clients, batch, seed):
    """The loss term of each client alone equals its entry of the cohort's term, and a client's
    padding rows (mask 0) change nothing."""
    g = torch.Generator().manual_seed(seed)
    k = 4
    if method == "moon":
        algo = Moon(Moon.Options(mu=0.7, tau=0.5))
        objectives = [_objective(algo, None, SimpleNamespace(payload={"state": {}}), {"x": 1} if i % 2 else None)
                      for i in range(clients)]
    else:
        algo = DynInit(DynInit.Options(init="continuous", continuous_kl_coef=0.4))
        objectives = [_objective(algo, None, SimpleNamespace(payload={"state": {}, "teacher": {}}), None)
                      for _ in range(clients)]
    rule = objectives[0].loss
    names = sorted(objectives[0].references)
    out = torch.randn(clients, batch + 1, k, generator=g, dtype=torch.float64)
    refs = {n: torch.randn(clients, batch + 1, k, generator=g, dtype=torch.float64) for n in names}
    mask = torch.ones(clients, batch + 1, dtype=torch.float64)
    mask[:, -1] = 0.0  # one padding row per client
    consts = stack_consts([o.consts for o in objectives], [], "cpu", torch.float64)
    records: dict = {}

    def masked(v, mask=mask):
        return (v * mask).sum(1) / mask.sum(1)

    together = rule(Batch(out, consts, lambda n: refs[n], masked, records))
    for i, o in enumerate(objectives):
        mine = move_consts(o.consts, {"w": out}) if o.consts else {}
        alone = rule(Batch(out[i, :batch], mine, lambda n, i=i: refs[n][i, :batch], torch.mean, {}))
        assert torch.allclose(together[i], alone, rtol=1e-12, atol=1e-15), (method, i)


def test_moon_term_is_the_published_loss_and_zero_without_a_previous_model():
    g = torch.Generator().manual_seed(3)
    z, zg, zp = (torch.randn(5, 6, generator=g, dtype=torch.float64) for _ in range(3))
    algo = Moon(Moon.Options(mu=2.0, tau=0.5))
    with_prev = _objective(algo, None, SimpleNamespace(payload={"state": {}}), {"p": 1})
    fresh = _objective(algo, None, SimpleNamespace(payload={"state": {}}), None)
    refs = {"global": zg, "previous": zp}
    records: dict = {}
    term = with_prev.loss(Batch(z, move_consts(with_prev.consts, {"w": z}), refs.__getitem__, torch.mean, records))
    logits = torch.stack([F.cosine_similarity(z, zg, dim=1), F.cosine_similarity(z, zp, dim=1)], 1) / 0.5
    expected = 2.0 * F.cross_entropy(logits, torch.zeros(5, dtype=torch.long))
    assert torch.allclose(term, expected, rtol=1e-12)
    assert torch.allclose(records["contrastive_loss"][0], expected / 2.0, rtol=1e-12)
    zero = fresh.loss(Batch(z, move_consts(fresh.consts, {"w": z}), refs.__getitem__, torch.mean, {}))
    assert float(zero) == 0.0


def test_scaffold_finish_counts_the_control_delta_and_keeps_the_new_variate():
    g = torch.Generator().manual_seed(1)
    task, state = _client("scaffold", g)
    task.payload["state"] = {n: v.float() for n, v in task.payload["state"].items()}
    objective = _objective(Scaffold(), _CTX, task, state)
    trained = {n: v + 0.5 for n, v in task.payload["state"].items()}
    result = ClientResult(cid=0, num_samples=1, state=trained, bytes_up=100, metrics={"steps": 5})
    objective.finish(result)
    for n in SHAPES:
        drift = (task.payload["state"][n] - trained[n]).double() / (5 * 0.1)
        dc = drift - task.payload["c"][n]
        assert torch.allclose(result.payload["delta_c"][n], dc.to(state["c_i"][n].dtype))
        assert torch.allclose(result.client_state["c_i"][n], state["c_i"][n] + dc)
    assert result.bytes_up == 100 + sum(v.numel() * v.element_size() for v in result.payload["delta_c"].values())


def test_objectives_that_differ_do_not_share_a_cohort():
    prox = _objective(FedProx(), None, SimpleNamespace(payload={"state": {}}), None)
    acg = _objective(FedACG(), None, SimpleNamespace(payload={"state": {}}), None)
    assert cohort_rules([None, None]) is None
    assert cohort_rules([prox, None]) is False
    assert isinstance(cohort_rules([prox, prox]), LocalObjective)
    # the same rule code with the same constants: FedProx and FedACG share the proximal rule
    assert isinstance(cohort_rules([prox, acg]), LocalObjective)
    moon = _objective(Moon(), None, SimpleNamespace(payload={"state": {}}), None)
    assert cohort_rules([prox, moon]) is False
