"""DynInit (initialising each session's model from the earlier sessions' models): the softmin weights,
the gradient distance and the weighted state against hand-computed values, the option checks, the
method's runs (the matching group dominates, R = 0 is Average, one candidate agrees with the
baselines, the gradient round's rate and client state, Continuous distillation), resume, the
process back end, and the parameter counts of the study's models."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from fedhetero.algorithms.dyninit.algorithm import DynInitOptions, gradient_distance, softmin_weights, weighted_state
from fedhetero.core.common.options import ConfigError
from fedhetero.core.run.engine import Engine
from fedhetero.core.exchange.store import ClientStateStore
from _util import SESSION_BASE, session_cfg, strip_wall


BASE = SESSION_BASE


_cfg = session_cfg


def _run(tmp_path: Path, name: str, **over):
    res = Engine(_cfg(**over), tmp_path / name, progress=False).run()
    return res, torch.load(tmp_path / name / "final_model.pt", weights_only=True)


def _state(saved):
    return saved.get("state", saved)


# ---------------------------------------------------------------------------- weights and distances
def test_softmin_weights():
    w = softmin_weights([0.3, 1.2, 0.7], 10.0)
    assert sum(w) == pytest.approx(1.0, abs=1e-12)
    assert w[0] > w[2] > w[1]
    assert softmin_weights([0.3, 1.2, 0.7], 0.0) == pytest.approx([1 / 3] * 3)
    assert softmin_weights([1.7], 10.0) == [1.0]
    assert sum(softmin_weights([1e6, 1e6 + 1], 800.0)) == pytest.approx(1.0)  # no overflow


def test_distance_range_and_orthogonal_value():
    g = {"w": torch.tensor([[1.0, 0.0], [0.0, 2.0]]), "v": torch.tensor([3.0, 0.0])}
    ortho = {"w": torch.tensor([[0.0, 1.0], [-2.0, 0.0]]), "v": torch.tensor([0.0, 5.0])}
    names = ["w", "v"]
    assert gradient_distance(g, g, names) == pytest.approx(0.0, abs=1e-12)
    assert gradient_distance(g, ortho, names) == pytest.approx(math.sqrt(2.0), rel=1e-12)
    neg = {k: -v for k, v in g.items()}
    assert gradient_distance(g, neg, names) == pytest.approx(2.0, rel=1e-12)
    rng = torch.Generator().manual_seed(0)
    for _ in range(20):
        a = {n: torch.randn(3, 4, generator=rng) for n in names}
        b = {n: torch.randn(3, 4, generator=rng) for n in names}
        assert 0.0 <= gradient_distance(a, b, names) <= 2.0
        assert 0.0 <= gradient_distance(a, b, names, "layer_cosine") <= 2.0
    # scale-free per layer; raw_l2 is not
    scaled = {n: 7.0 * v for n, v in g.items()}
    assert gradient_distance(g, scaled, names) == pytest.approx(0.0, abs=1e-12)
    assert gradient_distance(g, scaled, names, "raw_l2") == pytest.approx(6.0 * math.sqrt(1 + 4 + 9), rel=1e-12)
    # a zero-norm layer is skipped
    z = {"w": torch.zeros(2, 2), "v": torch.tensor([3.0, 0.0])}
    assert gradient_distance(g, z, names) == pytest.approx(0.0, abs=1e-12)


def test_weighted_state_keeps_integer_buffers():
    a = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}
    b = {"w": torch.tensor([3.0, 6.0]), "n": torch.tensor(5)}
    out = weighted_state([a, b], [0.25, 0.75], {"w": torch.zeros(2), "n": torch.tensor(9)})
    assert torch.allclose(out["w"], torch.tensor([2.5, 5.0]))
    assert int(out["n"]) == 9


def test_options_are_checked():
    with pytest.raises(ConfigError, match="grad_lr_factor"):
        DynInitOptions(grad_lr_factor=0.0)
    with pytest.raises(ConfigError, match="init"):
        DynInitOptions(init="recovery")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="sessions.count"):
        Engine(_cfg(**{"sessions.count": 0, "sessions.rounds": 5}), "/nonexistent/never-written", progress=False).run()
    with pytest.raises(ConfigError, match="train.rounds"):
        _cfg(**{"train.rounds": 30})


# ---------------------------------------------------------------------------- the method
def test_dyninit_run_weights_matching_group(tmp_path):
    res, _ = _run(tmp_path, "dyninit")
    starts = {r["session"]: r["session_start"] for r in res.metrics if "session_start" in r}
    assert set(starts) == set(range(1, 8))
    assert "grad_round_clients" not in starts[1] and starts[2]["grad_round_clients"] == 10
    # session 5 (group A): candidates 2 (B), 3 (A), 4 (B); the matching group A dominates
    w5 = starts[5]["weights"]
    assert sum(w5.values()) == pytest.approx(1.0, abs=1e-5)
    assert w5["3"] > 0.9
    d5 = starts[5]["distances"]
    assert d5["3"] < min(d5["2"], d5["4"])
    w7 = starts[7]["weights"]  # group A again: sessions 3 and 5 are the matching ones
    assert w7["3"] + w7["5"] > 0.9
    s = res.summary
    for k in range(1, 6):
        assert f"transition_{k}_accuracy" in s and f"transition_{k}_init_accuracy" in s
    # DynInit's initial model of the 2nd transition already knows the session's classes
    assert s["transition_2_init_accuracy"] > 0.5


def test_r_zero_equals_average(tmp_path):
    """With R = 0 the weights are uniform: DynInit's post-pilot models equal Average's (FedAvg
    keeps no client state, so the pilot and gradient rounds leave the main rounds unchanged)."""
    _, a = _run(tmp_path, "r0", **{"algorithm.options.similarity_scale": 0.0})
    _, b = _run(tmp_path, "avg", **{"algorithm.options.init": "average"})
    for k, v in _state(a).items():
        assert torch.equal(v, _state(b)[k]), k


def test_one_candidate_previous_and_average_agree(tmp_path):
    """Up to the 1st transition's session all methods train the same models (one candidate)."""
    ra, _ = _run(tmp_path, "prev", **{"algorithm.options.init": "previous"})
    rb, _ = _run(tmp_path, "avg", **{"algorithm.options.init": "average"})
    rc, _ = _run(tmp_path, "dyn", **{"algorithm.options.init": "dyninit"})
    acc = {n: [r.get("accuracy") for r in res.metrics if r["session"] <= 3] for n, res in
           (("p", ra), ("a", rb), ("d", rc))}
    assert acc["p"] == acc["a"]
    assert acc["p"][5:] == acc["d"][5:]  # baselines skip the pilot session (rows 1-5)
    assert all(r.get("skipped") for r in ra.metrics if r["session"] == 1)
    assert not any(r.get("skipped") for r in rc.metrics)
    assert ra.summary["transition_2_accuracy"] != rc.summary["transition_2_accuracy"]


def test_gradient_scales_with_the_gradient_rate(tmp_path):
    norms = {}
    for f in (0.5, 0.25):
        eng = Engine(_cfg(**{"algorithm.options.grad_lr_factor": f, "train.rounds": 15, "sessions.count": 3,
                             "train.lr": 0.002, "train.lr_min": 0.001}),
                     tmp_path / f"g{f}", progress=False)
        eng.run()
        g = eng.algorithm.grads[1]
        norms[f] = math.sqrt(sum(float((v.double() ** 2).sum()) for v in g.values()))
    assert norms[0.5] / norms[0.25] == pytest.approx(2.0, rel=0.15)


def test_continuous_distils_from_previous_session(tmp_path):
    res, _ = _run(tmp_path, "cont", **{"algorithm.options.init": "continuous", "algorithm.options.host": "fedprox"})
    res0, _ = _run(tmp_path, "cont0", **{"algorithm.options.init": "continuous", "algorithm.options.continuous_kl_coef": 0.0})
    prev, _ = _run(tmp_path, "prev", **{"algorithm.options.init": "previous"})
    # κ = 0 is Previous on FedAvg; κ > 0 changes the training
    assert [r.get("accuracy") for r in res0.metrics] == [r.get("accuracy") for r in prev.metrics]
    assert [r.get("accuracy") for r in res.metrics] != [r.get("accuracy") for r in prev.metrics]
    assert res.summary["dyninit_init"] == "continuous"
    row = next(r for r in res.metrics if r["session"] == 3)
    assert row["clients"][0]["bytes_down"] == 2 * row["clients"][0]["bytes_up"]  # model + teacher


@pytest.mark.parametrize("host", ["scaffold", "moon"])
def test_gradient_round_client_state_side_effects(tmp_path, host, monkeypatch):
    """The gradient round runs before the session's first round; the client state it writes is
    what that round's tasks see, or it is discarded (grad_round_updates_client_state: false)."""
    real_put, real_get = ClientStateStore.put, ClientStateStore.get
    puts: list[tuple[int, int, bool]] = []
    gets: list[tuple[int, int, bool, bool]] = []
    for keep in (True, False):
        puts.clear()
        gets.clear()

        def put(self, cid, state, round, prelude=False):
            puts.append((cid, round, prelude))
            return real_put(self, cid, state, round, prelude)

        def get(self, cid, before_round=None, prelude=False):
            out = real_get(self, cid, before_round, prelude)
            gets.append((cid, before_round, prelude, out is not None))
            return out

        monkeypatch.setattr(ClientStateStore, "put", put)
        monkeypatch.setattr(ClientStateStore, "get", get)
        Engine(_cfg(**{"algorithm.options.host": host, "train.rounds": 15, "sessions.count": 3,
                       "algorithm.options.grad_round_updates_client_state": keep}),
               tmp_path / f"{host}{keep}", progress=False).run()
        # client 10 (group B) first works in session 2 (rounds 6..10): its gradient round is the
        # prelude of round 6, and round 6's own task finds that state only when it was kept
        assert ((10, 6, True) in puts) == keep
        assert (10, 6, True, False) in gets  # the prelude itself starts with no state
        assert (10, 6, False, keep) in gets


def test_resume_is_bit_equal(tmp_path):
    cfg = _cfg(**{"algorithm.options.host": "scaffold", "engine.vectorize": True})
    full = Engine(cfg, tmp_path / "full", progress=False).run()
    Engine(cfg, tmp_path / "part", progress=False, stop_after=17).run()
    res = Engine(cfg, tmp_path / "part", progress=False, resume=True).run()
    assert strip_wall(res.metrics) == strip_wall(full.metrics)


def test_study_models_parameter_counts():
    from fedhetero import models

    assert sum(p.numel() for p in models.build_model("logreg", in_channels=1, input_size=28).parameters()) == 7850
    assert sum(p.numel() for p in models.build_model("svhn_cnn").parameters()) == 667_178
    assert sum(p.numel() for p in models.build_model("resnet18_proj").parameters()) == 11_573_066
    assert sum(p.numel() for p in models.build_model("resnet18_proj", num_classes=100).parameters()) == 11_596_196


@pytest.mark.slow  # run by: python -m pytest -m slow
def test_process_back_end_equals_local(tmp_path):
    """Prelude exchanges (the gradient round, with its server-sent rate) and session hooks run the
    same on worker processes: bit-identical to the local back end."""
    over = {"algorithm.options.host": "scaffold", "train.rounds": 15, "sessions.count": 3}
    _, a = _run(tmp_path, "local", **over)
    _, b = _run(tmp_path, "proc", **over, **{"engine.backend": "process", "engine.workers": 2})
    for k, v in _state(a).items():
        assert torch.equal(v, _state(b)[k]), k
