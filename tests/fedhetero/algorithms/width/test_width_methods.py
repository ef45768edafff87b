"""The width-scaling baselines: HeteroFL, FedRolex and SplitMix.

End-to-end: every method trains on a tiny synthetic run and records accuracy, per-tier accuracy,
bytes and a model that fits each client's budget; falling budgets shrink the models; resume. Unit
level: HeteroFL's masked per-element averaging on hand-made sub-model updates, FedRolex's rolling
window, untouched coordinates keep their value, static BN equals a cumulative average, the Scaler
is the identity in eval mode, SplitMix averages per base. Which baselines follow falling budgets
(DynamicFL's Table 2) is checked here for the knowledge-distillation ones too.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedhetero.algorithms import get_algorithm
from fedhetero.core.exchange.types import ClientInfo, ClientResult
from fedhetero.algorithms.width.fedrolex import FedRolex, FedRolexOptions, rolling_window
from fedhetero.algorithms.width.heterofl import (
    HeteroFL,
    HeteroFLOptions,
    attach_scaler,
    spec_for_sizes,
    static_bn_model,
)
from fedhetero.algorithms.width.splitmix import SplitMix
from fedhetero.core.common.options import ConfigError
from fedhetero.core.run.engine import Engine
from fedhetero.core.method.registry import build_algorithm
from fedhetero.core.hetero.submodel import extract_state
from fedhetero.models import build_model
from _util import budget_method_cfg, client_half_from_the_task_alone, metrics_rows, run_within_budgets


FAST_OPTIONS = {
    "heterofl": {},
    "fedrolex": {},
    "splitmix": {},
}


def _cfg(algorithm: str, options: dict | None = None, **over: dict) -> object:
    return budget_method_cfg(algorithm, FAST_OPTIONS[algorithm] if options is None else options, **over)


_rows = metrics_rows


# ---------------------------------------------------------------------------------------- end to end
@pytest.mark.parametrize("algorithm", ["heterofl", "fedrolex", "splitmix"])
def test_method_trains_end_to_end_within_budgets(tmp_path, algorithm):
    cfg = _cfg(algorithm)
    engine, rows, clients, macs = run_within_budgets(tmp_path, cfg)
    # bytes are the tensors actually sent: sub-model slices grow with the model
    smallest = min(clients, key=lambda c: c["macs"])
    largest = max(clients, key=lambda c: c["macs"])
    assert smallest["bytes_up"] < largest["bytes_up"] and smallest["bytes_down"] < largest["bytes_down"]
    # every tier's deployed model fits that tier's budget; larger tiers deploy larger models
    algo, ctx = engine.algorithm, engine.ctx
    models = algo.eval_models(ctx)
    tier_macs = {t.name: ctx.macs(models[f"tier:{t.name}"]) for t in cfg.budget.tiers if f"tier:{t.name}" in models}
    assert set(tier_macs) == {"small", "medium", "large"}
    for t in cfg.budget.tiers:
        if t.name in tier_macs:
            assert tier_macs[t.name] <= t.ratio * ctx.plain_macs
    if algorithm in ("heterofl", "fedrolex"):
        # the global model is the architecture widened to fit the largest tier (3 units)
        assert ctx.plain_macs < ctx.macs(algo.global_model) <= ctx.max_budget_macs()
        assert algo.global_width > cfg.model.width
        assert tier_macs["small"] < tier_macs["medium"] < tier_macs["large"]


@pytest.mark.parametrize("algorithm", ["heterofl", "fedrolex", "splitmix"])
def test_client_half_runs_from_the_task_alone(tmp_path, algorithm):
    scenario = "decreasing" if "decreasing" in get_algorithm(algorithm).adapts_to else "static"
    cfg = _cfg(algorithm, budget={"scenario": scenario, "change": 0.3}, train={"local_epochs": 3})
    client_half_from_the_task_alone(cfg, tmp_path, keeps_client_state=False)


def test_decreasing_budget_shrinks_width_methods(tmp_path):
    cfg = _cfg(
        "heterofl",
        train={"rounds": 1, "local_epochs": 3},
        budget={"scenario": "decreasing", "change": 0.3},
    )
    Engine(cfg, tmp_path, progress=False, shared_splits=True).run()
    clients = _rows(tmp_path)[0]["clients"]
    assert clients
    for c in clients:
        assert c["fits_after_change"] is True
        assert c["macs_after_change"] < c["macs"]
        assert c["width_after_change"] < c["width"]


def test_splitmix_decreasing_budget_keeps_fitting(tmp_path):
    cfg = _cfg("splitmix", train={"rounds": 1, "local_epochs": 3}, budget={"scenario": "decreasing", "change": 0.3})
    Engine(cfg, tmp_path, progress=False, shared_splits=True).run()
    for c in _rows(tmp_path)[0]["clients"]:
        assert c["fits_after_change"] is True


def test_adapts_to_matches_dynamicfl_table2():
    for name in ("heterofl", "fedrolex", "splitmix"):
        assert get_algorithm(name).adapts_to == frozenset({"static", "decreasing"})
    for name in ("feddf", "fedet", "dsfl"):
        assert get_algorithm(name).adapts_to == frozenset({"static"})


def test_bad_option_is_reported_with_its_name():
    with pytest.raises(ConfigError, match="algorithm.options.mode"):
        build_algorithm(_cfg("fedrolex", {"mode": "spiral"}))
    with pytest.raises(ConfigError, match="algorithm.options.bogus"):
        build_algorithm(_cfg("heterofl", {"bogus": 1}))


@pytest.mark.parametrize("algorithm", ["splitmix"])
def test_resume_equals_uninterrupted(tmp_path, algorithm):
    cfg = _cfg(algorithm, train={"rounds": 2, "checkpoint_every": 1})
    Engine(cfg, tmp_path / "full", progress=False, shared_splits=True).run()
    Engine(cfg, tmp_path / "cut", progress=False, shared_splits=True, stop_after=1).run()
    Engine(None, tmp_path / "cut", resume=True, progress=False, shared_splits=True).run()
    a, b = _rows(tmp_path / "full"), _rows(tmp_path / "cut")
    assert [r["round"] for r in b] == [1, 2]
    for ra, rb in zip(a, b):
        assert ra["accuracy"] == rb["accuracy"] and ra["tier_accuracy"] == rb["tier_accuracy"]
        assert [c["loss"] for c in ra["clients"]] == [c["loss"] for c in rb["clients"]]


# ---------------------------------------------------------------------------------------- HeteroFL maths
def _model(width: float, track: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("lenet5", num_classes=10, in_channels=3, width=width, track_running_stats=track)


def _update(cid: int, width: float, global_model, labels, seed: int, algo) -> ClientResult:
    sub = _model(width)
    spec = spec_for_sizes(global_model.channel_groups(), dict(sub.channel_groups().sizes))
    g = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in sub.state_dict().items()}
    return ClientResult(
        cid=cid, num_samples=10 * (cid + 1), state=state, spec=spec,
        payload={"labels": torch.as_tensor(labels), "width": width},
    )


def _heterofl(global_model, **opts) -> HeteroFL:
    algo = HeteroFL(HeteroFLOptions(**opts))
    algo.global_model = global_model
    algo.global_width = 1.0
    return algo


def test_heterofl_aggregation_gives_exact_per_element_means():
    glob = _model(1.0)
    old = {k: v.clone() for k, v in glob.state_dict().items()}
    algo = _heterofl(glob)
    a = _update(0, 0.5, glob, [0, 1, 2], seed=1, algo=algo)
    b = _update(1, 0.25, glob, [2, 3], seed=2, algo=algo)
    algo.aggregate(None, [b, a])  # order of the list must not matter (sorted by cid)
    new = glob.state_dict()
    for key, g_old in old.items():
        exp_sum = torch.zeros_like(g_old, dtype=torch.float64)
        cnt = torch.zeros_like(g_old, dtype=torch.float64)
        for u in (a, b):
            t = u.state[key].to(torch.float64)
            region = tuple(slice(0, s) for s in t.shape)  # prefix sub-models: every dim is a prefix
            mask = torch.zeros_like(cnt, dtype=torch.bool)
            mask[region] = True
            if key.startswith("fc3."):  # classifier rows only for the client's classes
                rows = torch.zeros(g_old.shape[0], dtype=torch.bool)
                rows[u.payload["labels"]] = True
                mask &= rows.view(-1, *([1] * (g_old.dim() - 1)))
            padded = torch.zeros_like(exp_sum)
            padded[region] = t
            exp_sum += torch.where(mask, padded, torch.zeros_like(padded))
            cnt += mask.to(torch.float64)
        expected = torch.where(cnt > 0, exp_sum / cnt.clamp_min(1), g_old.to(torch.float64)).to(g_old.dtype)
        assert torch.equal(new[key], expected), key
    # spot checks with hand-computed values
    mean2 = (a.state["fc3.bias"][2].double() + b.state["fc3.bias"][2].double()) / 2
    assert torch.equal(new["fc3.bias"][2], mean2.float())
    assert torch.equal(new["fc3.bias"][0], a.state["fc3.bias"][0])
    assert torch.equal(new["fc3.bias"][3], b.state["fc3.bias"][3])
    assert torch.equal(new["fc3.bias"][7], old["fc3.bias"][7])


def test_heterofl_sample_weighting():
    glob = _model(1.0)
    algo = _heterofl(glob, weighting="samples", mask_classifier=False)
    a = _update(0, 0.5, glob, [0], seed=3, algo=algo)
    b = _update(1, 0.5, glob, [0], seed=4, algo=algo)
    algo.aggregate(None, [a, b])
    w = a.state["conv1.conv.weight"].double() * 10 + b.state["conv1.conv.weight"].double() * 20
    k = a.state["conv1.conv.weight"].shape[0]
    assert torch.equal(glob.state_dict()["conv1.conv.weight"][:k], (w / 30).float())


@pytest.mark.parametrize("mode", ["static", "roll"])
def test_untrained_coordinates_keep_their_value(mode):
    glob = _model(1.0)
    old = {k: v.clone() for k, v in glob.state_dict().items()}
    algo = FedRolex(FedRolexOptions(mode=mode))
    algo.global_model, algo.global_width = glob, 1.0
    algo.groups = glob.channel_groups()
    sub_sizes = dict(_model(0.5).channel_groups().sizes)
    ctx = SimpleNamespace(round=4)
    client = ClientInfo(cid=0, tier="small", ratio=1.0, budget_macs=1.0, num_samples=5, round=4)
    spec = spec_for_sizes(algo.groups, sub_sizes, algo.pick(ctx, client))
    sub_state = extract_state(old, spec)
    g = torch.Generator().manual_seed(0)
    state = {k: v + 1.0 + torch.rand(v.shape, generator=g) for k, v in sub_state.items()}  # never equal to old
    payload = {"labels": torch.tensor([1]), "width": 0.5}
    upd = ClientResult(cid=0, num_samples=5, state=state, spec=spec, payload=payload)
    algo.aggregate(None, [upd])
    new = glob.state_dict()
    total_kept = 0
    for key, before in old.items():
        changed = new[key] != before
        kept_global = torch.zeros_like(before, dtype=torch.bool)
        # positions the client trained: scatter a marker through the spec
        marker = {k: torch.ones_like(v) for k, v in sub_state.items()}
        from fedhetero.core.hetero.submodel import scatter

        placed = scatter({k: torch.zeros_like(v) for k, v in old.items()}, marker, spec)[key].bool()
        if key.startswith("fc3."):
            rows = torch.zeros(before.shape[0], dtype=torch.bool)
            rows[1] = True
            placed &= rows.view(-1, *([1] * (before.dim() - 1)))
        kept_global |= placed
        assert torch.equal(new[key][~kept_global], before[~kept_global]), key  # bit-identical
        assert bool(changed[kept_global].all()), key
        total_kept += int((~kept_global).sum())
        assert not bool(((new[key] == 0) & (before != 0)).any()), key  # nothing zeroed
    assert total_kept > 0


# ---------------------------------------------------------------------------------------- FedRolex window
def test_rolling_window_moves_one_per_round_and_wraps():
    c, k = 5, 2
    windows = [set(rolling_window(c, k, t).tolist()) for t in range(7)]
    assert windows == [{0, 1}, {4, 0}, {3, 4}, {2, 3}, {1, 2}, {0, 1}, {4, 0}]
    for t in range(20):  # offset (−t) mod C, k consecutive, cyclic
        start = (-t) % c
        assert set(rolling_window(c, k, t).tolist()) == {(start + j) % c for j in range(k)}
    assert rolling_window(6, 6, 3).tolist() == list(range(6))


def test_fedrolex_specs_follow_the_server_round():
    glob = _model(1.0)
    algo = FedRolex(FedRolexOptions(mode="roll"))
    algo.groups = glob.channel_groups()
    sizes = dict(_model(0.5).channel_groups().sizes)
    client = ClientInfo(cid=3, tier="small", ratio=1.0, budget_macs=1.0, num_samples=5, round=1)
    seen: dict[str, set[int]] = {g: set() for g in algo.groups.prunable}
    for rnd in range(1, 130):
        spec = spec_for_sizes(algo.groups, sizes, algo.pick(SimpleNamespace(round=rnd), client))
        for g in algo.groups.prunable:
            n, k = algo.groups.sizes[g], sizes[g]
            start = (-(rnd - 1)) % n
            assert set(spec.kept(g).tolist()) == {(start + j) % n for j in range(k)}
            seen[g] |= set(spec.kept(g).tolist())
    for g in algo.groups.prunable:  # over C rounds every channel is trained
        assert seen[g] == set(range(algo.groups.sizes[g]))
    # static = prefix; random = one subset per group, reproducible per (round, client)
    static = FedRolex(FedRolexOptions(mode="static"))
    static.groups = algo.groups
    assert static.pick(SimpleNamespace(round=7), client) is None

    class _Ctx:
        round = 2

        @staticmethod
        def rng(concern, *keys):
            return np.random.default_rng(np.random.SeedSequence(0, spawn_key=keys))

    rnd = FedRolex(FedRolexOptions(mode="random"))
    s1 = spec_for_sizes(algo.groups, sizes, rnd.pick(_Ctx, client))
    s2 = spec_for_sizes(algo.groups, sizes, rnd.pick(_Ctx, client))
    assert s1 == s2 and s1.sizes == spec.sizes


# ---------------------------------------------------------------------------------------- BN, Scaler
def test_scaler_identity_in_eval_mode_and_scales_in_train_mode():
    torch.manual_seed(0)
    m = build_model("lenet5", num_classes=10, in_channels=3, width=0.5, norm="none")
    x = torch.randn(4, 3, 32, 32)
    m.eval()
    ref = m(x)
    handles = attach_scaler(m, 0.5)
    assert len(handles) == 4  # conv1, conv2, fc1, fc2 (not the classifier)
    assert torch.equal(m(x), ref)
    m.train()
    scaled = m(x)
    for h in handles:
        h.remove()
    assert not torch.allclose(scaled, m(x))
    assert attach_scaler(m, 1.0) == []


def test_static_bn_equals_cumulative_average():
    torch.manual_seed(0)
    train_x = torch.randn(50, 3, 32, 32)
    from fedhetero.data.datasets import ArrayDataset

    ds = ArrayDataset(images=train_x, labels=torch.zeros(50, dtype=torch.long), num_classes=10, name="t", split="train")
    ctx = SimpleNamespace(
        device=torch.device("cpu"),
        dtype=torch.float32,
        cfg=SimpleNamespace(train=SimpleNamespace(batch_size=16)),
        data=SimpleNamespace(train=ds, client_indices=[np.arange(0, 20), np.arange(20, 50)]),
        build_model=lambda width, **kw: build_model("lenet5", num_classes=10, in_channels=3, width=width, **kw),
    )
    src = _model(0.5, track=False)
    model = static_bn_model(ctx, 0.5, src.state_dict(), policy="sbn_central")
    assert not model.training
    # manual: cumulative average of per-batch statistics of conv1's output
    conv = src.conv1.conv
    means, vars_ = [], []
    for start in range(0, 50, 16):
        out = conv(train_x[start : start + 16]).detach().double()
        means.append(out.mean((0, 2, 3)))
        vars_.append(out.var((0, 2, 3), unbiased=True))
    bn = model.conv1.bn
    assert torch.allclose(bn.running_mean.double(), torch.stack(means).mean(0), rtol=1e-5, atol=1e-6)
    assert torch.allclose(bn.running_var.double(), torch.stack(vars_).mean(0), rtol=1e-5, atol=1e-6)


def test_splitmix_untrained_base_unchanged_and_average_per_base(tmp_path):
    engine = Engine(_cfg("splitmix"), tmp_path, progress=False, shared_splits=True)
    engine.setup()  # data, context and algorithm set-up only (no rounds)
    algo: SplitMix = engine.algorithm  # type: ignore[assignment]
    assert algo.num_bases == max(algo.tier_bases.values()) >= 2
    before = [{k: v.clone() for k, v in b.state_dict().items()} for b in algo.bases]
    state0 = {f"0.{k}": v + 1.0 for k, v in before[0].items() if v.is_floating_point()}
    state0.update({f"0.{k}": v for k, v in before[0].items() if not v.is_floating_point()})
    upd = ClientResult(cid=0, num_samples=4, state=state0, payload={"bases": [0]})
    algo.aggregate(engine.ctx, [upd])
    for gid, base in enumerate(algo.bases):
        for k, v in base.state_dict().items():
            if gid == 0 and v.is_floating_point():
                assert torch.equal(v, before[0][k] + 1.0)
            else:
                assert torch.equal(v, before[gid][k])
