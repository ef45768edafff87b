"""FedDU / FedDUM / FedAP / FedDUMAP and the FedDUMAP baselines (the paper's Algorithms 1–3, Formulas 2–15)."""

from __future__ import annotations

import ast
import copy
import json
import math
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedhetero.core.exchange.types import ClientInfo
from fedhetero.algorithms.feddumap.fedap import conv_layer_rates
from fedhetero.algorithms.feddumap.feddu import (
    NonIIDStats,
    feddu_alpha,
    fprime,
    importance_ratio,
    interpolate_states,
    server_steps,
)
from fedhetero.algorithms.feddumap.feddum import DampedMomentumSGD, server_momentum_step
from fedhetero.algorithms import build_algorithm
from fedhetero.core.common.config import from_dict
from fedhetero.core.common.options import ConfigError
from fedhetero.core.local.context import build_data
from fedhetero.data.datasets import ArrayDataset
from fedhetero.data.federated import FederatedData
from fedhetero.core.run.engine import Engine
from fedhetero.backends.local import LocalBackend
from fedhetero.algorithms.pruning.rates import aggregation_weights, kept_count
from _util import ROOT, strip_wall

FAST_PRUNE = {"prune_round": 1, "prune_rate_mode": "fixed", "fixed_prune_rate": 0.5,
              "hrank_samples": 16, "hrank_batch": 8}


def _cfg(name: str, options: dict | None = None, engine: dict | None = None, **train) -> object:
    t = {"rounds": 2, "sample_rate": 0.34, "local_epochs": 1, "batch_size": 32}
    t.update(train)
    return from_dict({
        "seed": 1,
        "data": {"dataset": "synthetic", "num_clients": 6, "server_fraction": 0.1, "synthetic_size": 200,
                 "server_classes": 0.5},
        "model": {"name": "cnn", "norm": "none"},
        "train": t,
        "algorithm": {"name": name, "options": options or {}},
        "engine": engine or {},
    })


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def _hand_js(p: list[float], q: list[float]) -> float:
    m = [(a + b) / 2 for a, b in zip(p, q)]
    kl = lambda x, y: sum(a * math.log2(a / b) for a, b in zip(x, y) if a > 0)  # noqa: E731
    return 0.5 * kl(p, m) + 0.5 * kl(q, m)


# ---------------------------------------------------------------------------------------- FedDU formulas
def test_feddu_alpha_is_formula_7_over_tau():
    # f'(acc) = 1 - acc, ratio = n0·D(P̄') / (n0·D(P̄') + n'·D(P0)), C, decay^(t-1)
    acc, n0, js_sel, n_sel, js_srv = 0.6, 400, 0.1, 4000, 0.31
    ratio = importance_ratio(n0, js_sel, n_sel, js_srv)
    assert ratio == pytest.approx(400 * 0.1 / (400 * 0.1 + 4000 * 0.31), rel=1e-15)
    alpha = feddu_alpha(acc, ratio, round_index=3, C=1.0, decay=0.99)
    assert alpha == pytest.approx(0.4 * ratio * 0.99**2, rel=1e-15)
    assert feddu_alpha(acc, ratio, round_index=1) == pytest.approx(0.4 * ratio, rel=1e-15)  # decay^0 first
    assert feddu_alpha(acc, ratio, round_index=1, decay_index_base=1) == pytest.approx(0.4 * ratio * 0.99, rel=1e-15)
    assert feddu_alpha(acc, ratio, round_index=2, C=0.5, fprime_kind="1/(acc+eps)") == pytest.approx(
        ratio * 0.5 * 0.99 / (0.6 + 1e-4), rel=1e-15)
    # equivalent bracket form of the paper (importance of the server data)
    assert ratio == pytest.approx((n0 / js_srv) / (n0 / js_srv + n_sel / js_sel), rel=1e-12)
    assert importance_ratio(0, 0.1, 100, 0.3) == 0.0  # no server data: FedAvg
    assert importance_ratio(10, 0.0, 30, 0.0) == pytest.approx(0.25)  # both IID: size-weighted
    assert fprime(0.25) == 0.75
    assert server_steps(4000, 10, 5) == 2000 and server_steps(401, 10, 5) == 205
    with pytest.raises(ValueError, match="acc"):
        fprime(1.5)


def test_interpolation_is_formula_4():
    a = {"w": torch.tensor([1.0, -2.0, 3.0]), "n": torch.tensor(7)}
    b = {"w": torch.tensor([2.0, 0.0, 3.5]), "n": torch.tensor(9)}
    out = interpolate_states(a, b, 0.25)
    assert torch.equal(out["w"], torch.tensor([1.25, -1.5, 3.125]))
    assert int(out["n"]) == 7
    assert torch.equal(interpolate_states(a, b, 0.0)["w"], a["w"])
    assert torch.equal(interpolate_states(a, b, 1.0)["w"], b["w"])


def _tiny_data(train_labels, clients, server, num_classes):
    y = torch.as_tensor(train_labels, dtype=torch.int64)
    ds = ArrayDataset(torch.zeros(len(y), 1, 4, 4), y, num_classes)
    test = ArrayDataset(torch.zeros(2, 1, 4, 4), torch.zeros(2, dtype=torch.int64), num_classes)
    return FederatedData(ds, test, [np.asarray(c) for c in clients],
                         server_indices=None if server is None else np.asarray(server))


def test_js_degrees_used_by_feddu_match_hand_computation():
    # device 0: labels 0,0,0,1 ; device 1: 1,1,1,1 ; device 2: 0,1 ; server: 0,0
    labels = [0, 0, 0, 1, 1, 1, 1, 1, 0, 1, 0, 0]
    data = _tiny_data(labels, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]], [10, 11], 2)
    st = NonIIDStats(data)
    pbar = [4 / 10, 6 / 10]  # pooled devices, server excluded
    assert np.allclose(st.global_dist, pbar, rtol=0, atol=1e-15)
    for k, p in enumerate([[0.75, 0.25], [0.0, 1.0], [0.5, 0.5]]):
        assert st.client_js[k] == pytest.approx(_hand_js(p, pbar), rel=1e-12)
    assert st.server_js == pytest.approx(_hand_js([1.0, 0.0], pbar), rel=1e-12)
    n_sel, js_sel = st.selected([0, 2])  # pooled 0,0,0,1,0,1 -> (4/6, 2/6)
    assert n_sel == 6 and js_sel == pytest.approx(_hand_js([4 / 6, 2 / 6], pbar), rel=1e-12)
    # the paper's check values: server on 2 / 5 / 10 of 10 uniform classes
    pooled = list(range(10)) * 10
    for k, expect in [(2, 0.610), (5, 0.311), (10, 0.0)]:
        d = _tiny_data(pooled + list(range(k)), [list(range(100))], list(range(100, 100 + k)), 10)
        assert NonIIDStats(d).server_js == pytest.approx(expect, abs=5e-4)
    # natural-log option
    assert NonIIDStats(data, base="e").server_js == pytest.approx(st.server_js * math.log(2), rel=1e-12)


def test_feddu_server_step_equals_formula_in_the_engine(tmp_path):
    eng = Engine(_cfg("feddu", {"decay": 0.9}), tmp_path, progress=False)
    eng.setup()
    alg, ctx = eng.algorithm, eng.ctx
    ctx.round = 3
    clients = [ClientInfo(cid=c, tier="small", ratio=1.0, budget_macs=float(ctx.plain_macs),
                          num_samples=len(ctx.data.client_indices[c]), round=3) for c in (0, 2, 5)]
    alg.round_extras = {}
    half = copy.deepcopy(alg.global_model.state_dict())
    # expected, computed independently from the paper's Formulas 2–7
    idx = ctx.data.server_indices
    acc = ctx.evaluate(alg.global_model, dataset=ctx.data.train, indices=idx)["accuracy"]
    hist = lambda ix: ctx.data.train.label_histogram(ix).astype(float)  # noqa: E731
    pooled = sum(hist(ix) for ix in ctx.data.client_indices)
    pbar = list(pooled / pooled.sum())
    sel = sum(hist(ctx.data.client_indices[c.cid]) for c in clients)
    js_sel = _hand_js(list(sel / sel.sum()), pbar)
    srv = hist(idx)
    js_srv = _hand_js(list(srv / srv.sum()), pbar)
    n0, n_sel = len(idx), sel.sum()
    alpha = (1 - acc) * (n0 * js_sel / (n0 * js_sel + n_sel * js_srv)) * 1.0 * 0.9 ** (3 - 1)
    server_model = copy.deepcopy(alg.global_model)
    alg.train_on_server(ctx, server_model)
    srv_state = server_model.state_dict()
    got_alpha = alg.feddu_step(ctx, clients)
    assert got_alpha == pytest.approx(alpha, rel=1e-10)
    assert alg.round_extras["feddu_alpha"] == got_alpha and alg.round_extras["feddu_server_step"] == 1
    assert alg.round_extras["feddu_js_selected"] == pytest.approx(js_sel, rel=1e-10)
    assert alg.round_extras["feddu_server_acc"] == acc
    new = alg.global_model.state_dict()
    for k in half:
        want = (half[k].double() + got_alpha * (srv_state[k].double() - half[k].double())).float()
        assert torch.equal(new[k], want), k


def test_feddu_with_alpha_zero_equals_fedavg_bit_for_bit(tmp_path):
    a = Engine(_cfg("feddu", {"server_update": "none", "lr_decay": 1.0}, momentum=0.0), tmp_path / "a",
               progress=False).run()
    # the same server split is held out for FedAvg, as in a comparison
    b = Engine(_cfg("fedavg", momentum=0.0), tmp_path / "b", progress=False, shared_splits=True).run()
    ra, rb = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert [r["accuracy"] for r in ra] == [r["accuracy"] for r in rb]
    assert [[c["loss"] for c in r["clients"]] for r in ra] == [[c["loss"] for c in r["clients"]] for r in rb]
    sa = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=True)["algorithm"]["global_model"]
    sb = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)["algorithm"]["global_model"]
    assert all(torch.equal(sa[k], sb[k]) for k in sb)
    assert a.summary["final_accuracy"] == b.summary["final_accuracy"]


# ---------------------------------------------------------------------------------------- FedDUM formulas
def test_server_momentum_update_is_formula_8_on_the_pseudo_gradient():
    w0 = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([[0.5]])}
    t1 = {"a": torch.tensor([0.5, 1.0]), "b": torch.tensor([[1.5]])}  # FedDU output of round 1
    w1, m1 = server_momentum_step(w0, t1, None, beta=0.9, lr=1.0, init="first_grad", count=1)
    # m^1 = g^1 = w^0 - w~^1, w^1 = w^0 - m^1 = w~^1
    assert torch.equal(m1["a"], torch.tensor([0.5, 1.0], dtype=torch.float64))
    assert torch.equal(w1["a"], t1["a"]) and torch.equal(w1["b"], t1["b"])
    t2 = {"a": torch.tensor([0.25, 1.5]), "b": torch.tensor([[1.0]])}
    w2, m2 = server_momentum_step(w1, t2, m1, beta=0.9, lr=1.0, count=2)
    g2 = torch.tensor([0.5 - 0.25, 1.0 - 1.5], dtype=torch.float64)
    m_exp = 0.9 * torch.tensor([0.5, 1.0], dtype=torch.float64) + 0.1 * g2
    assert torch.allclose(m2["a"], m_exp, rtol=0, atol=1e-15)
    assert torch.allclose(w2["a"].double(), torch.tensor([0.5, 1.0], dtype=torch.float64) - m_exp, rtol=0, atol=1e-7)
    # η_s scales the step; "zero" init moves (1-β) of the way in round 1; bias correction undoes it
    wz, mz = server_momentum_step(w0, t1, None, beta=0.9, lr=2.0, init="zero", count=1)
    assert torch.allclose(mz["a"], 0.1 * torch.tensor([0.5, 1.0], dtype=torch.float64))
    assert torch.allclose(wz["a"], torch.tensor([0.9, 1.8]))
    wb, _ = server_momentum_step(w0, t1, None, beta=0.9, lr=1.0, init="bias_correct", count=1)
    assert torch.allclose(wb["a"], t1["a"], rtol=0, atol=1e-7)
    # β = 0, η_s = 1: the FedDU output itself (FedDUM with β = β' = 0 is FedDU)
    w0b, _ = server_momentum_step(w1, t2, m1, beta=0.0, lr=1.0, count=2)
    assert all(torch.equal(w0b[k], t2[k]) for k in t2)


def test_device_momentum_is_formula_11_restarted_at_zero():
    p = torch.nn.Parameter(torch.tensor([1.0, -1.0]))
    opt = DampedMomentumSGD([p], lr=0.1, beta=0.9)
    p.grad = torch.tensor([2.0, 4.0])
    opt.step()  # m = 0.1 g, w -= 0.1 m
    assert torch.allclose(p.detach(), torch.tensor([1.0 - 0.1 * 0.2, -1.0 - 0.1 * 0.4]))
    p.grad = torch.tensor([1.0, 1.0])
    opt.step()  # m = 0.9·0.1g + 0.1g'
    m = 0.9 * torch.tensor([0.2, 0.4]) + 0.1 * torch.tensor([1.0, 1.0])
    assert torch.allclose(p.detach(), torch.tensor([0.98, -1.04]) - 0.1 * m)
    q = torch.nn.Parameter(torch.tensor([1.0]))
    q.grad = torch.tensor([3.0])
    DampedMomentumSGD([q], lr=0.5, beta=0.0).step()
    assert torch.equal(q.detach(), torch.tensor([1.0 - 1.5]))


def test_options_are_validated_with_the_field_name():
    with pytest.raises(ConfigError, match="server_momentum"):
        build_algorithm(_cfg("feddum", {"server_momentum": 1.5}))
    with pytest.raises(ConfigError, match="decay"):
        build_algorithm(_cfg("feddu", {"decay": 0.0}))


# ---------------------------------------------------------------------------------------- FedAP
def test_fedap_pruned_model_fits_the_computed_rates_and_has_fewer_flops(tmp_path):
    opts = {"prune_round": 0, "slq_iters": 3, "hessian_batch": 4, "hrank_samples": 16, "hrank_batch": 8}
    eng = Engine(_cfg("fedap", opts), tmp_path, progress=False)
    eng.setup()
    alg, ctx = eng.algorithm, eng.ctx
    ctx.round = 1
    before = copy.deepcopy(alg.global_model)
    alg.prune_now(ctx)
    rep = alg.prune_report
    # Formula 15 over the server and all N devices
    assert rep["participants"][0] == "server" and len(rep["rates"]) == 1 + 6
    w = aggregation_weights(rep["sizes"], rep["degrees"], 1e-4)
    assert w.sum() == pytest.approx(1.0, abs=1e-12)
    assert rep["p_star"] == pytest.approx(float((w * np.asarray(rep["rates"])).sum()), rel=1e-12)
    # per-layer rates from the magnitude threshold on the unpruned model, ⌊p_l·d_l⌋ filters removed
    rates, thr = conv_layer_rates(before, rep["p_star"], alg.options)
    assert thr == rep["threshold"]
    after = alg.global_model
    for group, conv in (("conv1", "conv1.conv"), ("conv2", "conv2.conv"), ("conv3", "conv3.conv")):
        w_l = before.get_submodule(conv).weight
        assert rates[conv] == pytest.approx(float((w_l.abs() < thr).sum()) / w_l.numel(), rel=1e-15)
        d = w_l.shape[0]
        assert after.get_submodule(conv).out_channels == kept_count(d, rates[conv]) == d - math.floor(rates[conv] * d + 1e-9)
        assert rep["group_rates"][group] == pytest.approx(1 - after.get_submodule(conv).out_channels / d)
    # surviving filters keep their trained weights (conv1 reads all image channels)
    kept1 = alg.prune_spec.kept("conv1")
    assert torch.equal(after.conv1.conv.weight, before.conv1.conv.weight[kept1])
    assert ctx.macs(after) < ctx.macs(before) and rep["macs_after"] == ctx.macs(after)
    assert rep["params_after"] < rep["params_before"]
    x = torch.randn(2, *ctx.input_shape)
    assert after(x).shape == (2, ctx.num_classes)


# ---------------------------------------------------------------------------------------- end to end
ALGORITHMS = {
    "feddu": {},
    "feddu_static": {"tau_eff": 1.0},
    "feddum": {},
    "fedap": FAST_PRUNE,
    "fedduap": FAST_PRUNE,
    "feddumap": FAST_PRUNE,
    "data_sharing": {"shared_samples": 8},
    "hybrid_fl": {},
    "feddu_sm": {},
    "feddu_dm": {},
    "feddu_da": {},
    "hrank_fl": {k: v for k, v in FAST_PRUNE.items() if k != "prune_rate_mode"},
    "imc": {"prune_round": 1, "prune_rate_mode": "fixed", "fixed_prune_rate": 0.5},
}


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_algorithm_trains_end_to_end(tmp_path, name):
    res = Engine(_cfg(name, ALGORITHMS[name]), tmp_path, progress=False).run()
    rows = _rows(tmp_path)
    assert [r["round"] for r in rows] == [1, 2]
    assert all(0.0 <= r["accuracy"] <= 1.0 and math.isfinite(r["loss"]) for r in rows)
    plain = res.summary["plain_macs"]
    model_bytes = 4 * 122_570  # float32 CNN on 3×32×32, 10 classes, no norm: parameters only
    for r in rows:
        for c in r["clients"]:
            assert c["macs"] > 0 and math.isfinite(c["loss"]) and c["lr"] > 0
    last = rows[-1]["clients"]
    if name in ("fedap", "fedduap", "feddumap", "hrank_fl"):
        assert all(c["macs"] == plain for c in rows[0]["clients"])
        assert all(c["macs"] < plain and c["params"] < 122_570 for c in last)
        assert all(0 < c["prune_rate/conv3"] <= 0.5 for c in last)
        assert all(c["bytes_up"] == 4 * c["params"] for c in last)
    else:
        assert all(c["macs"] == plain for r in rows for c in r["clients"])
    if name.startswith("feddu") or name in ("fedduap", "feddumap"):
        assert all("feddu_alpha" in c for c in last)
        assert rows[1]["clients"][0]["lr"] == pytest.approx(0.05 * 0.99)
    if name in ("feddum", "feddu_sm", "feddumap"):
        # decoupled momentum: only the model travels
        assert all("server_momentum_norm" in c for c in last)
        if name != "feddumap":
            assert all(c["bytes_up"] == c["bytes_down"] == model_bytes for r in rows for c in r["clients"])
    if name == "feddu_da":
        assert all(c["bytes_up"] == 2 * model_bytes for r in rows for c in r["clients"])
    if name == "imc":
        assert all(c["bytes_up"] < model_bytes and c["params_remaining"] < 122_570 for c in last)
        state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["algorithm"]
        masked = sum(int((~m).sum()) for m in state["masks"].values())
        zeros = sum(int((state["global_model"][k] == 0).sum()) for k in state["masks"])
        assert masked > 0 and zeros >= masked
    if name == "data_sharing":
        assert all(c["num_samples"] > 8 and c["shared_samples"] == 8 for c in last)


def test_data_sharing_follows_local_steps_and_clipping(tmp_path, monkeypatch):
    """Data-sharing's devices take ``train.local_steps`` steps over their own and shared samples
    (more passes than one when the steps ask for them), and clip as configured, as every other
    device does; in epochs its numbers are those of the plain epoch loop."""
    calls = []
    real = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda params, c, *a, **k: calls.append(c) or real(params, c, *a, **k))
    opts = {"shared_samples": 8}
    Engine(_cfg("data_sharing", opts, local_steps=7, clip_grad_norm=0.25), tmp_path / "steps", progress=False).run()
    rows = [c for r in _rows(tmp_path / "steps") for c in r["clients"]]
    assert rows and all(c["steps"] == 7 for c in rows)
    assert len(calls) == 7 * len(rows) and set(calls) == {0.25}
    calls.clear()
    Engine(_cfg("data_sharing", opts, local_epochs=2), tmp_path / "epochs", progress=False).run()
    rows = [c for r in _rows(tmp_path / "epochs") for c in r["clients"]]
    # two passes over own + shared samples, in batches of 32
    assert all(c["steps"] == 2 * math.ceil(c["num_samples"] / 32) for c in rows) and calls == []


def test_feddumap_resume_after_pruning_equals_uninterrupted(tmp_path):
    opts = dict(FAST_PRUNE, prune_round=0)
    cfg = _cfg("feddumap", opts, checkpoint_every=1)
    Engine(cfg, tmp_path / "full", progress=False).run()
    Engine(cfg, tmp_path / "cut", progress=False, stop_after=1).run()
    Engine(None, tmp_path / "cut", resume=True, progress=False).run()
    a, b = _rows(tmp_path / "full"), _rows(tmp_path / "cut")
    assert [r["accuracy"] for r in a] == [r["accuracy"] for r in b]
    assert [[c["loss"] for c in r["clients"]] for r in a] == [[c["loss"] for c in r["clients"]] for r in b]
    sa = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=True)["algorithm"]
    sb = torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=True)["algorithm"]
    assert all(torch.equal(sa["global_model"][k], sb["global_model"][k]) for k in sa["global_model"])
    assert all(torch.equal(sa["server_momentum"][k], sb["server_momentum"][k]) for k in sa["server_momentum"])
    assert sa["server_momentum"]["conv3.conv.weight"].shape[0] < 64  # sliced with the pruned filters


# ---------------------------------------------------------------------------------------- client half
class _PicklingBackend(LocalBackend):
    """The local back end on a data set and client context of its own, with every task, private
    state and outcome sent through pickle: what a worker process sees, without the processes."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg, build_data(cfg))
        self.payload_keys: set[str] = set()

    def run(self, algorithm, tasks, states, on_done=None):  # type: ignore[no-untyped-def]
        for t in tasks:
            self.payload_keys.update(t.payload)
            _assert_no_module(t.payload)
        tasks, states = pickle.loads(pickle.dumps((tasks, states)))
        return pickle.loads(pickle.dumps(super().run(algorithm, tasks, states, on_done)))


def _assert_no_module(value) -> None:
    assert not isinstance(value, torch.nn.Module), "a model object travels in a task payload"
    if isinstance(value, dict):
        for v in value.values():
            _assert_no_module(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _assert_no_module(v)


@pytest.mark.parametrize("name,extra_key", [("feddumap", "pruned"), ("hrank_fl", "pruned"), ("imc", "masks"),
                                            ("data_sharing", "shared"), ("feddu_da", "momentum")])
def test_client_half_runs_from_the_task_alone(tmp_path, name, extra_key):
    # prune before round 2, so round 2's devices rebuild the pruned model from the payload
    opts = dict(ALGORITHMS[name], **({"prune_round": 1} if "prune_round" in ALGORITHMS[name] else {}))
    cfg = _cfg(name, opts)
    Engine(cfg, tmp_path / "local", progress=False).run()
    backend = _PicklingBackend(cfg)
    eng = Engine(cfg, tmp_path / "pickled", progress=False, backend=backend)
    eng.run()
    assert {"state", "lr", extra_key} <= backend.payload_keys
    assert strip_wall(_rows(tmp_path / "local")) == strip_wall(_rows(tmp_path / "pickled"))
    sa = torch.load(tmp_path / "local" / "checkpoint.pt", weights_only=True)["algorithm"]["global_model"]
    sb = eng.algorithm.global_model.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.slow  # run by: python -m pytest -m slow
def test_feddumap_on_the_process_backend_equals_local(tmp_path):
    opts = dict(FAST_PRUNE, prune_round=1)
    local = Engine(_cfg("feddumap", opts), tmp_path / "local", progress=False)
    local.run()
    proc = Engine(_cfg("feddumap", opts, engine={"backend": "process", "workers": 2}), tmp_path / "process",
                  progress=False)
    proc.run()
    assert strip_wall(_rows(tmp_path / "local")) == strip_wall(_rows(tmp_path / "process"))
    sa, sb = local.algorithm.global_model.state_dict(), proc.algorithm.global_model.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def _module_imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_no_import_circle_in_the_feddumap_family():
    family_dir = ROOT / "fedhetero" / "algorithms" / "feddumap"
    family = {f"fedhetero.algorithms.feddumap.{m}" for m in ("feddu", "feddum", "fedap", "feddumap", "baselines")}
    assert not _module_imports(family_dir / "_common.py") & family
    assert "fedhetero.algorithms.feddumap.feddum" not in _module_imports(family_dir / "feddu.py")


# ---------------------------------------------------------------------------------------- divergence guards
def _global(path) -> dict:
    return torch.load(path / "checkpoint.pt", weights_only=True)["algorithm"]["global_model"]


def _initial_global(cfg, path) -> dict:
    eng = Engine(cfg, path, progress=False)
    eng.setup()
    return {k: v.clone() for k, v in eng.algorithm.global_model.state_dict().items()}


def test_guards_that_never_fire_change_nothing(tmp_path):
    """Invariant: the guards only observe until they fire; with factors no loss reaches, a run
    with guards is the run without them, bit for bit."""
    never = {"divergence_guards": True, "guard_factor": 1e9, "test_guard_factor": 1e9}
    a = Engine(_cfg("feddum", never, rounds=3), tmp_path / "a", progress=False).run()
    b = Engine(_cfg("feddum", rounds=3), tmp_path / "b", progress=False).run()
    ra, rb = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert [r["accuracy"] for r in ra] == [r["accuracy"] for r in rb]
    assert all(c["guard_dropped"] is False and c["guard_test_reverted"] == 0 for r in ra for c in r["clients"])
    sa, sb = _global(tmp_path / "a"), _global(tmp_path / "b")
    assert all(torch.equal(sa[k], sb[k]) for k in sb)
    assert a.summary["final_accuracy"] == b.summary["final_accuracy"]


def test_the_test_guard_keeps_the_previous_global_model(tmp_path):
    """A test guard that fires every round (any test loss ≥ 1e-9 × the initial one) keeps w^{t−1}
    every round: the global model ends as it started, exactly."""
    cfg = _cfg("feddum", {"divergence_guards": True, "test_guard_factor": 1e-9}, rounds=3)
    start = _initial_global(cfg, tmp_path / "setup")
    Engine(cfg, tmp_path / "run", progress=False).run()
    rows = _rows(tmp_path / "run")
    assert all(c["guard_test_reverted"] == 1 for r in rows for c in r["clients"])
    end = _global(tmp_path / "run")
    assert all(torch.equal(end[k], start[k]) for k in start)


def test_the_device_and_server_guards_drop_every_device_and_step(tmp_path):
    """A device guard that fires for every loss drops every upload from the aggregate, and the
    server guard reverts FedDU's step when the server-data loss does not fall below a 1e-9 share of
    its old value: the global model never moves."""
    cfg = _cfg("feddu", {"divergence_guards": True, "guard_factor": 1e-9, "lr_decay": 1.0}, rounds=2)
    start = _initial_global(cfg, tmp_path / "setup")
    Engine(cfg, tmp_path / "run", progress=False).run()
    rows = _rows(tmp_path / "run")
    assert all(c["guard_dropped"] is True for r in rows for c in r["clients"])
    assert all(r["clients"][0].get("guard_server_reverted") == 1 for r in rows if r["clients"][0]["feddu_alpha"] > 1e-3)
    end = _global(tmp_path / "run")
    assert all(torch.equal(end[k], start[k]) for k in start)


def test_a_diverged_server_step_stops_the_run_and_names_the_guards(tmp_path, monkeypatch):
    """A server step that leaves a NaN (here put there by hand after FedDUM's momentum) stops the
    run in its round, and the message points to the family's guards."""
    from fedhetero.algorithms.feddumap.feddum import FedDUM
    from fedhetero.core.local.context import RunError

    plain = FedDUM.after_server_update

    def poisoned(self, ctx, prev):
        plain(self, ctx, prev)
        if ctx.round == 2:
            with torch.no_grad():
                next(self.global_model.parameters()).view(-1)[0] = float("inf")

    monkeypatch.setattr(FedDUM, "after_server_update", poisoned)
    with pytest.raises(RunError, match=r"^round 2: the server's update left non-finite values in global_model\..*"
                       r"divergence_guards=true"):
        Engine(_cfg("feddum", rounds=3), tmp_path / "run", progress=False).run()


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 300), batch=st.integers(1, 64), steps=st.integers(0, 40))
def test_samples_in_steps_counts_the_rows_of_the_batches(n, batch, steps):
    """The samples of ``steps`` steps over passes of ``n`` samples are the rows of exactly those
    batches, each pass cut into batches with a short last one."""
    from fedhetero.algorithms.feddumap._common import samples_in_steps

    batches = [min(batch, n - k) for k in range(0, n, batch)]
    walk = [batches[s % len(batches)] for s in range(steps)] if batches else []
    assert samples_in_steps(n, batch, steps) == sum(walk)


@pytest.mark.parametrize("name, steps", [("feddu", 7), ("feddu", None), ("data_sharing", 5)])
def test_samples_processed_counts_the_steps_taken(tmp_path, name, steps):
    """``samples_processed`` is what local training went through: ``n × local_epochs`` in
    epochs, the rows of the steps taken under ``train.local_steps`` (not ``n × local_epochs``)."""
    from fedhetero.algorithms.feddumap._common import samples_in_steps

    opts = {"shared_samples": 8} if name == "data_sharing" else {}
    Engine(_cfg(name, opts, local_steps=steps, local_epochs=2, batch_size=16), tmp_path, progress=False).run()
    rows = [c for r in _rows(tmp_path) for c in r["clients"]]
    assert rows
    for c in rows:
        n = c["num_samples"]
        want = 2 * n if steps is None else samples_in_steps(n, 16, steps)
        assert c["samples_processed"] == want
        if steps is not None:
            assert c["steps"] == steps and c["samples_processed"] <= 16 * steps
