"""DynaComm (dynamic communication-resource allocation): schedules and κ accounting against the
paper's printed values, the group heterogeneity measure, the group selectors against exhaustive
search, the engine's reductions (every client at interval 1 is DynamicSGD; an interval of at
least L, or an empty high group, is FedAvg with L local steps, bit for bit), the toy quadratic's
closed form, resume and the process back end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedhetero.algorithms.dynacomm import selection as dc
from fedhetero.core.common.config import from_dict, to_dict
from fedhetero.core.common.options import ConfigError
from fedhetero.data import num_batches
from fedhetero.core.local.context import ClientContext
from fedhetero.core.run.engine import Engine
from _util import strip_wall

LETTERS = "abcdefg"


# ----------------------------------------------------------------------------- schedules and κ
def test_local_steps_for_cifar_and_femnist():
    assert dc.default_local_steps(50_000, 100, 5, 10) == 250
    assert dc.default_local_steps(644_210, 100, 5, 10) == 3221


def test_sync_counts_and_published_kappa():
    assert [dc.parse_interval(x) for x in LETTERS] == [1, 4, 16, 32, 64, 128, 256]
    assert [dc.nu_code(dc.parse_interval(x), 250) for x in LETTERS] == [249, 63, 16, 8, 4, 2, 1]
    assert [dc.nu_paper(dc.parse_interval(x), 250) for x in LETTERS] == [250, 63, 16, 8, 4, 2, 1]
    assert [dc.nu_code(dc.parse_interval(x), 3221) for x in LETTERS] == [3220, 805, 202, 101, 51, 26, 13]
    assert dc.nu_paper(4, 3221) == 806
    # every-client rows of the tables (10 active clients, L = 250)
    kappas = [round(dc.kappa_round([dc.nu_code(dc.parse_interval(x), 250)] * 10, 10, 250), 3) for x in LETTERS]
    assert kappas == [0.996, 0.252, 0.064, 0.032, 0.016, 0.008, 0.004]
    # FEMNIST: a = 0.9997, b = 0.250, c = 0.063, d = 0.031
    fem = [dc.kappa_round([dc.nu_code(dc.parse_interval(x), 3221)] * 10, 10, 3221) for x in "abcd"]
    assert [round(fem[0], 4)] + [round(v, 3) for v in fem[1:]] == [0.9997, 0.250, 0.063, 0.031]
    # Dynamic-0.3 a-g with three high-frequency clients every round
    assert dc.kappa_round([249] * 3 + [1] * 7, 10, 250) == pytest.approx(0.3016, abs=1e-12)
    # "x*": the idle low clients count 0 but stay in the denominator
    assert dc.kappa_round([249] * 3 + [0] * 7, 10, 250) == pytest.approx(0.2988, abs=1e-12)


@pytest.mark.parametrize("L", [1, 2, 5, 250, 251, 3221])
def test_sync_points_match_the_counts(L):
    for interval in [1, 2, 3, 4, 16, 83, 249, 250, 256, 5000]:
        paper = dc.sync_points(interval, L, "paper")
        code = dc.sync_points(interval, L, "code")
        assert len(paper) == dc.nu_paper(interval, L)
        assert len(code) == dc.nu_code(interval, L)
        assert paper[-1] == code[-1] == L
        assert paper == sorted(set(paper)) and code == sorted(set(code))
    assert dc.sync_points(1, 250, "code")[-2:] == [248, 250]


def test_interval_parsing_rejects_bad_values():
    assert dc.parse_interval("C") == 16 and dc.parse_interval(7) == 7 and dc.parse_interval("12") == 12
    for bad in ["h", 0, -1, "", True, 1.5]:
        with pytest.raises(ValueError):
            dc.parse_interval(bad)


# ----------------------------------------------------------------------------- heterogeneity
def test_kl_of_single_and_k_class_groups():
    uniform = np.full(10, 0.1)
    hists = np.zeros((10, 10))
    for c in range(10):
        hists[c, c] = 500
    assert dc.group_distance(hists, [3], uniform) == pytest.approx(math.log(10))
    for k in range(1, 11):
        assert dc.group_distance(hists, list(range(k)), uniform) == pytest.approx(math.log(10 / k))
    assert dc.group_distance(hists, list(range(10)), uniform) == pytest.approx(0.0, abs=1e-15)
    # sizes weight the pooled distribution; 0·log 0 = 0
    p = dc.pooled_distribution(np.array([[30, 0], [10, 10]]), [0, 1])
    assert p.tolist() == [0.8, 0.2]
    assert dc.kl_divergence([1.0, 0.0], [0.5, 0.5]) == pytest.approx(math.log(2))
    assert dc.group_distance(hists, [0, 1], uniform, "squared_l2") == pytest.approx(2 * 0.4**2 + 8 * 0.01)


# ----------------------------------------------------------------------------- selectors
def _instance(rng, n=10, classes=10):
    hists = np.stack([rng.multinomial(int(rng.integers(20, 300)), rng.dirichlet(np.full(classes, 0.3))) for _ in range(n)])
    glob = rng.dirichlet(np.full(classes, 5.0))
    cap = int(rng.integers(1, n + 1))
    budget = dc.Budget(client=(249.0,) * n, server=249.0 * cap, nu_high=249.0, nu_low=1.0)
    if rng.random() < 0.3:  # Fix-β style: only some clients can afford high frequency
        capable = rng.random(n) < 0.5
        budget = dc.Budget(client=tuple(249.0 if c else 1.0 for c in capable), server=249.0 * n, nu_high=249.0, nu_low=1.0)
    return hists, glob, budget


def test_ensemble_dp_against_exhaustive_search():
    rng = np.random.default_rng(0)
    close = 0
    for _ in range(200):
        hists, glob, budget = _instance(rng)
        exact, d_exact = dc.select_brute_force(hists, glob, budget)
        members, d = dc.select_ensemble_dp(hists, glob, budget, orders=10, rng=np.random.default_rng(int(rng.integers(1 << 30))))
        if not exact:
            assert members == [] and d == math.inf
            continue
        assert budget.feasible(members) and len(members) >= 1
        assert d == pytest.approx(dc.group_distance(hists, members, glob))
        assert d >= d_exact - 1e-12  # never better than exhaustive search
        close += d <= d_exact * 1.05 + 1e-12
    assert close >= 190


def test_ensemble_is_the_best_single_order_run_and_respects_caps():
    rng = np.random.default_rng(1)
    for trial in range(20):
        hists, glob, budget = _instance(rng)
        members, d = dc.select_ensemble_dp(hists, glob, budget, orders=10, rng=np.random.default_rng(trial))
        # the same ten client orders, one run each: a generator draws one order per run
        orders = np.random.default_rng(trial)
        singles = [dc.select_ensemble_dp(hists, glob, budget, orders=1, rng=orders) for _ in range(10)]
        best = min(singles, key=lambda r: r[1])
        assert d == best[1] and members == best[0]
    # a Dynamic-β cap of 3: never more than 3 members; fixed size: exactly 3
    hists, glob, _ = _instance(np.random.default_rng(5))
    cap3 = dc.Budget(client=(4.0,) * 10, server=12.0, nu_high=4.0, nu_low=1.0)
    assert 1 <= len(dc.select_ensemble_dp(hists, glob, cap3)[0]) <= 3
    assert len(dc.select_ensemble_dp(hists, glob, cap3, fixed_size=3)[0]) == 3
    assert len(dc.select_brute_force(hists, glob, cap3, fixed_size=3)[0]) == 3
    # the paper's total-cost constraint gives the same cap here
    total = dc.Budget(client=(4.0,) * 10, server=3 * 4.0 + 7 * 1.0, nu_high=4.0, nu_low=1.0, semantics="total_cost")
    assert dc.select_brute_force(hists, glob, total) == dc.select_brute_force(hists, glob, cap3)
    # nothing feasible: the empty group
    none = dc.Budget(client=(1.0,) * 10, server=100.0, nu_high=4.0, nu_low=1.0)
    assert dc.select_ensemble_dp(hists, glob, none) == ([], math.inf)


def test_random_and_genetic_selectors():
    rng = np.random.default_rng(2)
    for trial in range(5):
        hists, glob, budget = _instance(rng)
        exact, d_exact = dc.select_brute_force(hists, glob, budget)
        ga, d_ga = dc.select_ga(hists, glob, budget, rng=np.random.default_rng(trial), population=20, iterations=30)
        if exact:
            assert budget.feasible(ga) and d_ga >= d_exact - 1e-12
        k = max(1, len(exact))
        rnd, d_rnd = dc.select_random(hists, glob, k, budget, rng=np.random.default_rng(trial))
        assert all(budget.capable(m) for m in rnd) and len(rnd) <= k
    with pytest.raises(ValueError):
        dc.select_brute_force(np.ones((21, 3)), np.full(3, 1 / 3))


# ----------------------------------------------------------------------------- the toy quadratic
def _quadratic_dynacomm(zbar, n, intervals, L, rounds, eta, theta0, rule="paper"):
    """DynaComm on scalar quadratics L_i(θ) = ½·mean_j (θ − z_ij)²: full-gradient local steps,
    sync points from :func:`sync_points`, size-weighted averages of the syncing clients."""
    theta = theta0
    points = [set(dc.sync_points(i, L, rule)) for i in intervals]
    for _ in range(rounds):
        local = [theta] * len(zbar)
        for l in range(1, L + 1):
            local = [w - eta * (w - z) for w, z in zip(local, zbar)]
            due = [m for m in range(len(zbar)) if l in points[m]]
            if not due:
                continue
            avg = sum(n[m] * local[m] for m in due) / sum(n[m] for m in due)
            for m in due:
                local[m] = avg
        theta = local[0]
    return theta


def test_toy_quadratic_closed_form():
    zbar, n = [1.0, -2.0, 5.0], [3, 5, 2]
    star = sum(a * b for a, b in zip(zbar, n)) / sum(n)
    eta, k, r, theta0 = 0.1, 6, 4, 10.0
    closed = star + (1 - eta) ** (k * r) * (theta0 - star)
    # clients 1 and 2 synchronise every step, client 3 only at the end (Theorem 1)
    assert _quadratic_dynacomm(zbar, n, [1, 1, k], k, r, eta, theta0) == pytest.approx(closed, abs=1e-12)
    # FedAvg with k local steps reaches the same point (identity Hessians)
    assert _quadratic_dynacomm(zbar, n, [k, k, k], k, r, eta, theta0) == pytest.approx(closed, abs=1e-12)
    assert _quadratic_dynacomm(zbar, n, [1, 1, 1], k, r, eta, theta0, rule="code") == pytest.approx(closed, abs=1e-12)


# ----------------------------------------------------------------------------- the engine
def _cfg(options=None, train=None, name="dynacomm", rounds=2, **top):
    return from_dict(
        {
            "seed": 5,
            "threads": 1,
            "data": {"num_clients": 8},
            "train": {
                "rounds": rounds,
                "sample_rate": 0.5,
                "local_epochs": 1,
                "local_steps": 6,
                "checkpoint_every": 1,
                "momentum": 0.9,
                "nesterov": True,
                "optimizer_state": "persistent",
                "clip_grad_norm": 1.0,
                "lr_schedule": "cosine",
                "lr_min": 0.001,
                **(train or {}),
            },
            "algorithm": {"name": name, "options": options or {}},
            # one by one: DynaComm's client half is its own, and its FedAvg equivalences are bit for bit
            **{"engine": {"vectorize": False}, **top},
        }
    )


def _run(tmp_path: Path, cfg, tag: str, **kw):
    eng = Engine(cfg, tmp_path / tag, progress=False, **kw)
    return eng, eng.run()


def _same_states(a, b):
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _global(eng):
    return {k: v.detach().clone() for k, v in eng.algorithm.global_model.state_dict().items()}


def _numbers(rows):
    return [(r["accuracy"], r["loss"], [(c["cid"], c["loss"]) for c in r["clients"]]) for r in rows]


def test_long_intervals_and_empty_high_group_are_fedavg_with_L_steps(tmp_path):
    ref, rref = _run(tmp_path, _cfg(name="fedavg"), "fedavg")
    for tag, options in {
        "none": {"budget_mode": "none", "interval_low": "g"},
        "both_long": {"budget_mode": "all_high", "interval_high": 6, "interval_low": 6},
        "empty_high": {"budget_mode": "dynamic", "beta": 0.0, "interval_high": "a", "interval_low": 100},
    }.items():
        eng, res = _run(tmp_path, _cfg(options), tag)
        _same_states(_global(eng), _global(ref))
        assert _numbers(res.metrics) == _numbers(rref.metrics)
        assert all(c["steps"] == 6 and c["syncs"] == 1 for r in res.metrics for c in r["clients"])
        assert all(c["high_freq"] == (tag == "both_long") for r in res.metrics for c in r["clients"])
        assert all(c["kappa_code"] == c["kappa_paper"] == 1 / 6 for r in res.metrics for c in r["clients"])


def test_every_client_at_interval_one_is_dynamic_sgd(tmp_path):
    """All clients synchronising after every step: the same numbers whichever way the interval is
    set, and (without momentum) one model stepping on the weighted mean of the clients' clipped
    gradients, as the paper's DynamicSGD is described."""
    plain = {"name": "cnn", "norm": "none", "width": 0.25}  # no BatchNorm statistics to average
    train = {"optimizer_state": "none", "momentum": 0.0, "nesterov": False, "local_steps": 4}
    a, ra = _run(tmp_path, _cfg({"budget_mode": "all_high", "interval_high": "a"}, train, rounds=1, model=plain), "all_high")
    b, rb = _run(tmp_path, _cfg({"budget_mode": "none", "interval_low": 1}, train, rounds=1, model=plain), "none")
    c, rc = _run(tmp_path, _cfg({"budget_mode": "dynamic", "beta": 1.0, "interval_high": "a", "interval_low": "a"}, train, rounds=1, model=plain), "dyn")
    _same_states(_global(a), _global(b))
    _same_states(_global(a), _global(c))
    assert all(x["syncs"] == 4 and x["kappa_paper"] == 1.0 and x["kappa_code"] == 0.75 for x in ra.metrics[0]["clients"])

    # the reference: one model, the weighted mean of per-client clipped gradient steps
    eng = Engine(_cfg({"budget_mode": "none"}, train, rounds=1, model=plain), tmp_path / "ref", progress=False)
    eng.setup()
    ctx = eng.ctx
    ctx.round = 1
    model = eng.algorithm.global_model
    cids = eng.sample_clients(1)
    sizes = [len(eng.data.client_indices[c]) for c in cids]
    lr = ctx.lr_at(1)
    client = ClientContext(eng.cfg, eng.data, ctx.device)  # the batches a client's trainer takes
    client.round = 1

    def batch(cid, s):  # step s of the round takes batch s mod P of pass s // P
        per_pass = num_batches(len(eng.data.client_indices[cid]), ctx.cfg.train.batch_size)
        p, pos = divmod(s, per_pass)
        return list(client.client_batches(cid, p))[pos]

    for s in range(4):
        new = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in model.state_dict().items()}
        for cid, n in zip(cids, sizes):
            x, y = batch(cid, s)
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1.0)
            grads = {k: p.grad for k, p in model.named_parameters()}
            wd = ctx.cfg.train.weight_decay
            for k, v in model.state_dict().items():
                step = v - lr * (grads[k] + wd * v) if k in grads else v
                new[k] += step.to(torch.float64) * n / sum(sizes)
        model.load_state_dict({k: v.to(torch.float32) for k, v in new.items()})
    for k, v in model.state_dict().items():
        assert torch.allclose(v, _global(a)[k], atol=1e-5, rtol=1e-4), k
    eng.backend.close()


def test_dynamic_avg_round_accounting(tmp_path):
    """Dynamic-β with a cap: the high group is within the cap, the logged κ is the mean of the
    clients' κ, and the high clients synchronise more often."""
    opts = {"budget_mode": "dynamic", "beta": 0.5, "interval_high": "a", "interval_low": 3}
    eng, res = _run(tmp_path, _cfg(opts), "dyn")
    for row in res.metrics:
        high = [c for c in row["clients"] if c["high_freq"]]
        low = [c for c in row["clients"] if not c["high_freq"]]
        assert 1 <= len(high) <= 2
        assert all(c["syncs"] == 6 and c["nu_code"] == 5 for c in high)
        assert all(c["syncs"] == 2 and c["nu_code"] == 2 for c in low)
        assert all(c["steps"] == 6 for c in row["clients"])
    for row in res.metrics:  # the round's κ is the mean of its clients'
        assert row["kappa_code"] == pytest.approx(np.mean([c["kappa_code"] for c in row["clients"]]))
        assert row["kappa_paper"] == pytest.approx(np.mean([c["kappa_paper"] for c in row["clients"]]))
        assert row["high_group"] == [c["cid"] for c in row["clients"] if c["high_freq"]]
        assert row["local_steps"] == 6
    assert res.summary["kappa_code"] == pytest.approx(np.mean([r["kappa_code"] for r in res.metrics]))
    assert res.summary["kappa_paper"] == pytest.approx(np.mean([r["kappa_paper"] for r in res.metrics]))
    assert json.loads((tmp_path / "dyn" / "summary.json").read_text())["kappa_code"] == res.summary["kappa_code"]
    assert res.metrics[0]["accuracy"] > 0
    # the authors' sync rule: interval 1 skips the sync after step L−1
    _, rc = _run(tmp_path, _cfg({**opts, "sync_rule": "code"}, rounds=1), "code")
    for c in rc.metrics[0]["clients"]:
        assert c["syncs"] == (5 if c["high_freq"] else 2) == c["nu_code"]


def test_fix_beta_and_only_high_group(tmp_path):
    opts = {"budget_mode": "fix", "beta": 0.5, "interval_high": 2, "interval_low": "g", "only_high_freq": True, "selector": "brute_force"}
    eng, res = _run(tmp_path, _cfg(opts), "xstar")
    capable = set(eng.algorithm.capable)
    assert len(capable) == 4
    for row in res.metrics:
        for c in row["clients"]:
            if c["high_freq"]:
                assert c["cid"] in capable and c["steps"] == 6 and c["syncs"] == 3
            else:
                assert c["steps"] == 0 and c["kappa_code"] == 0 and c["bytes_up"] == 0
    quirk, rq = _run(tmp_path, _cfg({**opts, "only_high_freq_code_quirk": True}), "quirk")
    assert [c["high_freq"] for r in rq.metrics for c in r["clients"]] == [c["high_freq"] for r in res.metrics for c in r["clients"]]
    if any(not c["high_freq"] for c in res.metrics[0]["clients"]):
        assert not torch.equal(next(iter(_global(eng).values())), next(iter(_global(quirk).values())))


def test_options_are_validated():
    for options, field in [
        ({"interval_high": "h"}, "interval_high"),
        ({"interval_low": 0}, "interval_low"),
        ({"beta": 1.5}, "beta"),
        ({"selector_orders": 0}, "selector_orders"),
        ({"only_high_freq_code_quirk": True}, "only_high_freq_code_quirk"),
        ({"ga_mutation_prob": 2.0}, "ga_mutation_prob"),
        ({"local_steps": 0}, "local_steps"),
    ]:
        with pytest.raises(ConfigError, match=f"algorithm.options.{field}"):
            from fedhetero.algorithms import build_algorithm

            build_algorithm(_cfg(options))
    with pytest.raises(ConfigError, match="algorithm.options.selector"):
        from fedhetero.algorithms import build_algorithm

        build_algorithm(_cfg({"selector": "magic"}))


def test_resume_equals_uninterrupted(tmp_path):
    cfg = _cfg({"budget_mode": "fix", "beta": 0.5, "interval_high": 2, "interval_low": 3}, rounds=3)
    full, rf = _run(tmp_path, cfg, "full")
    _run(tmp_path, cfg, "cut", stop_after=1)
    resumed, rr = _run(tmp_path, None, "cut", resume=True)
    assert strip_wall(rr.metrics) == strip_wall(rf.metrics)
    _same_states(_global(full), _global(resumed))


@pytest.mark.slow  # run by: python -m pytest -m slow
def test_process_backend_gives_the_numbers_of_local(tmp_path):
    cfg = _cfg({"budget_mode": "dynamic", "beta": 0.5, "interval_high": 2, "interval_low": 3})
    cfg_proc = from_dict({**to_dict(cfg), "engine": {"backend": "process", "workers": 2}})
    a, ra = _run(tmp_path, cfg, "local")
    b, rb = _run(tmp_path, cfg_proc, "process")
    assert strip_wall(ra.metrics) == strip_wall(rb.metrics)
    _same_states(_global(a), _global(b))


def test_a_lone_client_continues_its_stream_and_momentum_across_syncs(tmp_path):
    """With one active client every average is the client's own model, so any interval must give
    FedAvg with L steps bit for bit: the batch stream and the (Nesterov) momentum buffer carry on
    across sync points instead of restarting."""
    train = {"sample_rate": 0.125}
    ref, rref = _run(tmp_path, _cfg(name="fedavg", train=train, rounds=3), "fedavg")
    for interval in (1, 2, 4):
        eng, res = _run(tmp_path, _cfg({"budget_mode": "none", "interval_low": interval}, train, rounds=3), f"i{interval}")
        assert [c["syncs"] for r in res.metrics for c in r["clients"]] == [len(dc.sync_points(interval, 6))] * 3
        _same_states(_global(eng), _global(ref))
        assert [r["accuracy"] for r in res.metrics] == [r["accuracy"] for r in rref.metrics]


def test_summed_gradient_dynamic_sgd(tmp_path):
    """Without momentum and with uniform weights, stepping one model on the mean clipped
    gradient is the engine's every-step model average (up to rounding); with persistent momentum
    the server's buffer survives a resume."""
    plain = {"name": "cnn", "norm": "none", "width": 0.25}
    train = {"optimizer_state": "none", "momentum": 0.0, "nesterov": False, "local_steps": 4, "aggregation": "uniform"}
    opts = {"budget_mode": "all_high", "interval_high": "a"}
    a, ra = _run(tmp_path, _cfg(opts, train, model=plain), "engine")
    b, rb = _run(tmp_path, _cfg({**opts, "dynamicsgd_impl": "summed_gradient"}, train, model=plain), "summed")
    for k, v in _global(a).items():
        assert torch.allclose(v, _global(b)[k], atol=1e-5, rtol=1e-4), k
    assert [c["kappa_code"] for r in rb.metrics for c in r["clients"]] == [0.75] * 8
    assert [c["steps"] for r in rb.metrics for c in r["clients"]] == [4] * 8

    cfg = _cfg({**opts, "dynamicsgd_impl": "summed_gradient"}, rounds=3)
    full, rf = _run(tmp_path, cfg, "full")
    assert full.algorithm.state_dict()["server_momentum"]
    _run(tmp_path, cfg, "cut", stop_after=1)
    resumed, rr = _run(tmp_path, None, "cut", resume=True)
    assert strip_wall(rr.metrics) == strip_wall(rf.metrics)
    _same_states(_global(full), _global(resumed))
    with pytest.raises(ConfigError, match="algorithm.options.dynamicsgd_impl"):
        from fedhetero.algorithms import build_algorithm

        build_algorithm(_cfg({"dynamicsgd_impl": "summed_gradient"}))


@pytest.mark.parametrize("final", [False, True])
def test_a_batched_window_keeps_the_momentum_buffers_one_by_one_keeps(final):
    """With ``train.optimizer_state: persistent`` a client keeps its trained momentum buffers to
    its next round only after the round's last exchange; a window before it leaves the kept ones
    as they were (what the client stores if it drops out later in the round). The batched windows
    of an exchange keep what each client one by one keeps, and start, like it, from the buffers
    carried in, else from the kept ones."""
    from fedhetero.algorithms.dynacomm.algorithm import DynaComm, DynaCommOptions
    from fedhetero.core.run.backend import run_task, run_together
    from fedhetero.core.local.context import client_context
    from fedhetero.core.exchange.types import OPTIMIZER_STATE_KEY, ClientTask, split_optimizer_state

    cfg = from_dict({"seed": 1, "threads": 1, "dtype": "float64",
                     "data": {"dataset": "digits", "num_clients": 4},
                     "train": {"local_steps": 6, "batch_size": 16, "momentum": 0.9, "nesterov": True,
                               "optimizer_state": "persistent"},
                     "engine": {"vectorize": True}, "algorithm": {"name": "dynacomm"}})
    ctx = client_context(cfg)
    g = torch.Generator().manual_seed(0)
    model = ctx.build_model()
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    names = [n for n, p in model.named_parameters() if p.requires_grad]

    def buffers():
        return {n: torch.randn(model.get_parameter(n).shape, generator=g, dtype=torch.float64) for n in names}

    tasks, states = [], {}
    for cid in range(4):
        payload = {"state": start, "start": 2, "steps": 3, "final": final}
        if cid % 2:  # carried in from this round's last sync; the others start from their kept ones
            payload["momentum"] = buffers()
        tasks.append(ClientTask(cid=cid, round=2, tier="all", ratio=1.0, budget_macs=ctx.plain_macs,
                                num_samples=len(ctx.data.client_indices[cid]), payload=payload, step=2))
        states[cid] = {OPTIMIZER_STATE_KEY: buffers()}

    algo = lambda: DynaComm(DynaCommOptions())  # noqa: E731
    together = run_together(algo, ctx, tasks, states)
    assert sorted(together) == [0, 1, 2, 3]
    for task in tasks:
        alone = run_task(algo, ctx, task, states[task.cid]).result
        batched = together[task.cid].result
        _, kept_alone = split_optimizer_state(alone.client_state)
        _, kept_batched = split_optimizer_state(batched.client_state)
        moved = alone.payload["momentum"]
        for n in names:
            assert torch.allclose(kept_batched[n], kept_alone[n], rtol=1e-10, atol=1e-12), n
            assert torch.allclose(batched.payload["momentum"][n], moved[n], rtol=1e-10, atol=1e-12), n
            assert torch.equal(kept_alone[n], moved[n]) == final  # kept: the trained ones after the last exchange only
        for k, v in alone.state.items():
            assert torch.allclose(batched.state[k], v, rtol=1e-10, atol=1e-12), k
        assert batched.metrics["loss"] == pytest.approx(alone.metrics["loss"], rel=1e-10)
