"""DynInit and sessions: the sanity checks of the method, the engine's session handling, the
vectorised cohort trainer and the latency/energy model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fedhetero.algorithms.dyninit import DynInitOptions, gradient_distance, softmin_weights, weighted_state
from fedhetero.config import ConfigError, from_dict
from fedhetero.engine import Engine
from fedhetero.sessions import (
    PUBLISHED_ROUND_COST,
    EnergyModel,
    Schedule,
    accumulated_gain,
    overlap_label_split,
    session_groups,
    time_to_accuracy,
    transition_accuracy,
)
from fedhetero.store import ClientStateStore

BASE = {
    "seed": 0,
    "threads": 1,
    "data": {"dataset": "digits", "partition": "session_groups", "num_clients": 20, "alpha": 0.5},
    "model": {"name": "logreg"},
    "train": {"rounds": 35, "sample_rate": 1.0, "batch_size": 32, "lr": 0.05, "local_epochs": 1,
              "lr_schedule": "polynomial", "lr_min": 0.01, "weight_decay": 0.0},
    "sessions": {"count": 7, "rounds": 5, "transition_window": 3},
    "algorithm": {"name": "dyninit", "options": {"host": "fedavg"}},
}


def _cfg(**over):
    data = json.loads(json.dumps(BASE))
    for key, value in over.items():
        node = data
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return from_dict(data)


def _run(tmp_path: Path, name: str, **over):
    res = Engine(_cfg(**over), tmp_path / name, progress=False).run()
    return res, torch.load(tmp_path / name / "final_model.pt", weights_only=True)


def _state(saved):
    return saved.get("state", saved)


# ---------------------------------------------------------------------------- label split / partition
@pytest.mark.parametrize(
    "classes, overlap, a, b",
    [
        (10, 0.2, list(range(0, 5)), list(range(4, 9))),
        (100, 0.2, list(range(0, 55)), list(range(44, 99))),
        (200, 0.2, list(range(0, 111)), list(range(89, 200))),
        (4, 0.8, [0, 1, 2], [1, 2, 3]),
        (4, 0.0, [0, 1], [2, 3]),
        (10, 0.0, list(range(5)), list(range(5, 10))),
    ],
)
def test_label_split_per_overlap(classes, overlap, a, b):
    got_a, got_b = overlap_label_split(classes, overlap)
    assert got_a == a and got_b == b


def test_label_split_rejects_bad_overlap():
    with pytest.raises(ValueError, match="overlap"):
        overlap_label_split(10, 1.0)


@pytest.mark.parametrize("classes, per_class, overlap, size, steps", [(10, 6000, 0.0, 300, 3), (100, 500, 0.2, 275, 3)])
def test_session_groups_sizes_and_labels(classes, per_class, overlap, size, steps):
    """Balanced quotas (FMNIST: 300 samples, 3 steps of 128; CIFAR-100 o=0.2: 275, 3 steps), every
    sample of a group's labels dealt once inside the group, only the group's labels."""
    labels = np.repeat(np.arange(classes), per_class)
    parts = session_groups(labels, 200, overlap, 0.3, np.random.default_rng(0))
    a_cls, b_cls = overlap_label_split(classes, overlap)
    for group, cls in ((parts[:100], a_cls), (parts[100:], b_cls)):
        sizes = [len(p) for p in group]
        assert max(sizes) - min(sizes) <= 1 and min(sizes) == size
        assert math.ceil(size / 128) == steps
        rows = np.concatenate(group)
        assert len(np.unique(rows)) == len(rows) == per_class * len(cls)  # each sample once in the group
        assert set(np.unique(labels[rows])) == set(cls)
    # the Dirichlet mix makes devices unlike each other: a device's top class is far above its
    # share under a uniform mix
    hist = np.stack([np.bincount(labels[p], minlength=classes) for p in parts[:100]])
    assert (hist.max(1) / hist.sum(1)).mean() > 2.0 / len(a_cls)


def test_session_groups_needs_an_even_count():
    with pytest.raises(ConfigError, match="even"):
        _cfg(**{"data.num_clients": 21})


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


# ---------------------------------------------------------------------------- schedule and engine
def test_schedule_alternates_and_explicit_devices():
    s = Schedule.from_config(5, 4, 10)
    assert s.devices[0] == s.devices[2] == (0, 1, 2, 3, 4) and s.devices[1] == (5, 6, 7, 8, 9)
    assert [s.session_of(r) for r in (1, 4, 5, 20)] == [0, 0, 1, 4]
    assert [s.round_in_session(r) for r in (1, 4, 5, 8)] == [1, 4, 1, 4]
    e = Schedule.from_config(2, 3, 10, devices=[[3, 1], [0, 9, 9]])
    assert e.devices == ((1, 3), (0, 9))


def test_sessions_sample_devices_restart_lr_and_eval_on_session_classes(tmp_path):
    devices = [[0, 1, 2], [10, 11], [0, 11, 12, 13]]
    cfg = _cfg(**{
        "algorithm": {"name": "fedavg"}, "sessions.count": 3, "sessions.rounds": 4, "train.rounds": 12,
        "sessions.devices": devices,
    })
    eng = Engine(cfg, tmp_path / "r", progress=False)
    res = eng.run()
    rows = res.metrics
    for r in rows:
        assert sorted(c["cid"] for c in r["clients"]) == devices[r["session"] - 1]
        assert r["session_round"] == (r["round"] - 1) % 4 + 1
    # the learning rate restarts at every session
    ctx = eng.ctx
    assert ctx.lr_at(1) == ctx.lr_at(5) == ctx.lr_at(9) == pytest.approx(0.05)
    assert ctx.lr_at(4) == ctx.lr_at(8) < ctx.lr_at(5)
    # session-class accuracy: group A (clients 0..9) holds the lower labels only
    assert all(r["accuracy"] == r["accuracy_session"] for r in rows)
    assert any(r["accuracy"] != r["accuracy_full"] for r in rows)
    idx = ctx.session_test_indices(1)
    labels = eng.data.train.labels_np
    held = set(np.unique(np.concatenate([labels[eng.data.client_indices[c]] for c in devices[1]])).tolist())
    assert set(np.unique(eng.data.test.labels_np[idx]).tolist()) == held
    assert [s["session"] for s in res.summary["sessions"]] == [1, 2, 3]


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
    strip = [{k: v for k, v in r.items() if k not in ("wall_s", "timers")} for r in res.metrics]
    ref = [{k: v for k, v in r.items() if k not in ("wall_s", "timers")} for r in full.metrics]
    assert strip == ref


# ---------------------------------------------------------------------------- vectorised cohort
@pytest.mark.parametrize(
    "host, init, options, extra",
    [
        ("fedavg", "dyninit", {}, {}),
        ("fedprox", "dyninit", {"mu": 0.5}, {"train.weight_decay": 0.001}),
        ("scaffold", "average", {}, {"train.nesterov": True}),
        ("scaffold", "previous", {"variant": "dyninit"}, {}),
        ("moon", "dyninit", {"mu": 1.0, "tau": 1.0}, {}),
        ("fedacg", "previous", {"lam": 0.5, "beta": 0.1}, {"train.local_steps": 5}),
        ("fedavg", "continuous", {}, {}),
    ],
)
def test_cohort_equals_one_by_one_float64(tmp_path, host, init, options, extra):
    over = {"dtype": "float64", "algorithm.options.host": host, "algorithm.options.init": init,
            "algorithm.options.host_options": options, "train.rounds": 20, "sessions.count": 4, **extra}
    _, a = _run(tmp_path, "one", **over)
    _, b = _run(tmp_path, "all", **over, **{"engine.vectorize": True})
    for k, v in _state(a).items():
        ref = _state(b)[k]
        assert torch.allclose(v, ref, rtol=1e-10, atol=1e-10 * float(v.abs().max())), k


@pytest.mark.parametrize("model_name", ["logreg", "lenet5"])
def test_cohort_equals_one_by_one_other_models(tmp_path, model_name):
    """The batched product of flat-linear models and the generic vmap path (a CNN without
    BatchNorm) both give each client its own trajectory."""
    over = {"dtype": "float64", "model.name": model_name, "model.norm": "none", "train.rounds": 6,
            "sessions.count": 3, "sessions.rounds": 2, "algorithm.options.host": "fedprox",
            "algorithm.options.host_options": {"mu": 0.5}}
    _, a = _run(tmp_path, "one", **over)
    _, b = _run(tmp_path, "all", **over, **{"engine.vectorize": True})
    for k, v in _state(a).items():
        ref = _state(b)[k]
        assert torch.allclose(v, ref, rtol=1e-10, atol=1e-10 * float(v.abs().max())), k


def test_stacked_linear_matches_autograd():
    from fedhetero.cohort import _StackedLinear

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, 7, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_StackedLinear.apply, (x, w, b))
    out = _StackedLinear.apply(x, w, b)
    ref = torch.stack([torch.nn.functional.linear(x[i], w[i], b[i]) for i in range(3)])
    assert torch.allclose(out, ref, rtol=1e-12, atol=0)


def test_cohort_is_used_and_falls_back(tmp_path, monkeypatch):
    from fedhetero import cohort

    calls = []
    real = cohort.Cohort.train

    def spy(self, *a, **k):
        calls.append(len(self.tasks))
        return real(self, *a, **k)

    monkeypatch.setattr(cohort.Cohort, "train", spy)
    Engine(_cfg(**{"engine.vectorize": True, "train.rounds": 15, "sessions.count": 3}), tmp_path / "v", progress=False).run()
    assert calls and set(calls) == {10}
    calls.clear()
    # BatchNorm running statistics: one by one
    Engine(_cfg(**{"engine.vectorize": True, "model.name": "lenet5", "train.rounds": 15, "sessions.count": 3}),
           tmp_path / "bn", progress=False).run()
    assert calls == []


# ---------------------------------------------------------------------------- store ticks
def test_store_prelude_versions(tmp_path):
    st = ClientStateStore(tmp_path)
    st.put(3, {"v": torch.tensor(1)}, 4)
    st.put(3, {"v": torch.tensor(2)}, 6, prelude=True)  # before round 6 proper
    assert int(st.get(3, before_round=6)["v"]) == 2
    assert int(st.get(3, before_round=6, prelude=True)["v"]) == 1
    st.put(3, {"v": torch.tensor(3)}, 6)
    assert int(st.get(3, before_round=7)["v"]) == 3
    st.rollback(5)
    assert int(st.get(3, before_round=7)["v"]) == 1


# ---------------------------------------------------------------------------- metrics
def test_transition_metrics():
    assert transition_accuracy([0.1, 0.2, 0.3, 0.9], window=3) == pytest.approx(0.2)
    assert time_to_accuracy([0.1, 0.5, 0.8, 0.9], 0.8) == 3
    assert time_to_accuracy([0.1, 0.5, 0.8], 0.8, offset=1) == 4
    assert time_to_accuracy([0.1], 0.8) == math.inf
    assert accumulated_gain([0.9, 0.8], [0.5, 0.8, 0.1]) == pytest.approx(40.0)


# ---------------------------------------------------------------------------- latency / energy
def test_energy_model_constants():
    m = EnergyModel()
    assert m.breakpoint_m == pytest.approx(210.0, rel=0.01)
    assert m.doppler_hz == pytest.approx(116.7, rel=0.001)
    assert m.fading_correlation == pytest.approx(0.967, abs=0.001)
    # the published time-to-accuracy rows: rounds × per-round cost
    lat, kj = PUBLISHED_ROUND_COST["tinyimagenet"]
    assert 11 * lat == pytest.approx(1249.4, rel=5e-4) and 11 * kj == pytest.approx(15.72, rel=5e-3)
    assert 150 * lat == pytest.approx(17037.7, rel=5e-4) and 150 * kj == pytest.approx(214.33, rel=5e-3)
    lat, kj = PUBLISHED_ROUND_COST["svhn"]
    assert 52 * lat == pytest.approx(358.1, rel=2e-3) and 52 * kj == pytest.approx(4.04, rel=5e-3)


def test_energy_model_reproduces_published_energy():
    """Uplink plus computation energy summed over 100 devices matches the published per-round
    energy (ResNet-34 at 64x64: 1.43 kJ; the SVHN CNN: 77.7 J) within a few per cent."""
    m = EnergyModel()
    tiny = m.round_cost(21_730_056, 27.69, 100, rng=0)["energy_j"]
    svhn = np.mean([m.round_cost(667_178, 91.04, 100, rng=s)["energy_j"] for s in range(3)])
    assert tiny == pytest.approx(1429.0, rel=0.06)
    assert svhn == pytest.approx(77.7, rel=0.06)
    cost = m.round_cost(667_178, 91.04, 100, rng=0)
    assert cost["energy_with_downlink_j"] > cost["energy_j"] and cost["latency_s"] >= cost["mean_device_latency_s"]


# ---------------------------------------------------------------------------- SVHN and the study's models
def _write_svhn(folder: Path, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    from scipy.io import savemat

    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, size=(32, 32, 3, n), dtype=np.uint8)
    y = rng.integers(1, 11, size=(n, 1)).astype(np.uint8)
    folder.mkdir(parents=True, exist_ok=True)
    savemat(folder / ("train_32x32.mat" if seed == 0 else "test_32x32.mat"), {"X": x, "y": y})
    return x, y


def test_svhn_mat_loader(tmp_path):
    from fedhetero.data import load_dataset
    from fedhetero.data.errors import DatasetFormatError, DatasetNotFoundError

    with pytest.raises(DatasetNotFoundError, match="train_32x32.mat"):
        load_dataset("svhn", data_dir=tmp_path)
    x, y = _write_svhn(tmp_path / "svhn", 12, 0)
    _write_svhn(tmp_path / "svhn", 5, 1)
    raw = load_dataset("svhn", data_dir=tmp_path, normalize=False)
    assert raw.images.shape == (12, 3, 32, 32) and raw.num_classes == 10
    assert torch.equal(raw.images[3, 1], torch.from_numpy(x[:, :, 1, 3].astype(np.float32)) / 255.0)
    want = np.where(y.reshape(-1) == 10, 0, y.reshape(-1))
    assert raw.labels.tolist() == want.tolist()
    norm = load_dataset("svhn", data_dir=tmp_path, split="test", normalize=True)
    raw_test = load_dataset("svhn", data_dir=tmp_path, split="test", normalize=False)
    assert norm.images.shape[0] == 5
    assert torch.allclose(norm.images[:, 2], (raw_test.images[:, 2] - 0.4728) / 0.1970)
    from scipy.io import savemat

    savemat(tmp_path / "svhn" / "train_32x32.mat", {"X": x, "y": np.zeros((12, 1), np.uint8)})
    with pytest.raises(DatasetFormatError, match="labels must be 1..10"):
        load_dataset("svhn", data_dir=tmp_path)


def test_study_models_parameter_counts():
    from fedhetero import models

    assert sum(p.numel() for p in models.build_model("logreg", in_channels=1, input_size=28).parameters()) == 7850
    assert sum(p.numel() for p in models.build_model("svhn_cnn").parameters()) == 667_178
    assert sum(p.numel() for p in models.build_model("resnet18_proj").parameters()) == 11_573_066
    assert sum(p.numel() for p in models.build_model("resnet18_proj", num_classes=100).parameters()) == 11_596_196


def test_model_weights_file_loads_into_backbone(tmp_path):
    from fedhetero import models

    torch.manual_seed(1)
    donor = models.build_model("resnet18_proj").backbone.state_dict()
    torch.save(donor, tmp_path / "w.pt")
    cfg = from_dict({"data": {"dataset": "synthetic", "num_clients": 2, "synthetic_size": 20},
                     "model": {"name": "resnet18_proj", "weights": str(tmp_path / "w.pt")}, "train": {"rounds": 1}})
    from fedhetero.context import client_context

    ctx = client_context(cfg)
    m = ctx.build_model()
    assert torch.equal(m.backbone.conv1.weight, donor["conv1.weight"])
    torch.save({"nothing": torch.zeros(3)}, tmp_path / "bad.pt")
    with pytest.raises(ConfigError, match="model.weights"):
        client_context(from_dict({"data": {"dataset": "synthetic", "num_clients": 2, "synthetic_size": 20},
                                  "model": {"name": "resnet18_proj", "weights": str(tmp_path / "bad.pt")},
                                  "train": {"rounds": 1}}))


# ---------------------------------------------------------------------------- the table command
def test_dyninit_table_command(tmp_path):
    """The grid runner: runs every cell once (Continuous shared by hosts with one learning rate),
    reuses finished runs, writes both tables, the numbers and the session plot."""
    from fedhetero.lab.dyninit_table import main, plan_runs

    cfg = tmp_path / "base.yaml"
    cfg.write_text(json.dumps({**BASE, "engine": {"vectorize": True}}))
    runs = plan_runs([0.0], [0.5], ["fedavg", "fedprox"], ["dyninit", "continuous", "previous", "average"], [1])
    assert len(runs) == 8 and len(set(runs.values())) == 7  # one Continuous run for both hosts
    args = ["--config", str(cfg), "--out", str(tmp_path / "t"), "--overlaps", "0.0", "--alphas", "0.5",
            "--hosts", "fedavg,fedprox", "--seeds", "1", "--jobs", "1"]
    assert main(args) == 0
    table = (tmp_path / "t" / "table_transitions.md").read_text()
    assert "Proposed (ours)" in table and "| 0 | 0.5 | fedprox | 2 |" in table
    tta = (tmp_path / "t" / "table_time_to_accuracy.md").read_text()
    assert "| Previous |" in tta
    res = json.loads((tmp_path / "t" / "results.json").read_text())
    assert res["missing_runs"] == [] and res["energy_per_round"]["energy_j"] > 0
    cell = res["cells"][0]["transitions"]["2"]
    assert set(cell) == {"dyninit", "continuous", "previous", "average"}
    assert (tmp_path / "t" / "accuracy_sessions.png").stat().st_size > 1000
    stamp = (tmp_path / "t" / runs[(0.0, 0.5, "fedavg", "dyninit", 1)] / "summary.json").stat().st_mtime
    assert main(args) == 0  # everything reused
    assert (tmp_path / "t" / runs[(0.0, 0.5, "fedavg", "dyninit", 1)] / "summary.json").stat().st_mtime == stamp


def test_time_to_accuracy_table_shows_seeds_that_never_reach_the_target(tmp_path):
    """A baseline that never reaches rho x DynInit's session peak in one seed is shown as such
    (not as inf), and its other columns average the seeds that reach it."""
    from fedhetero.lab.dyninit_table import build_table

    curves = {  # session 4 (after the 2nd transition) accuracy per round, two seeds
        ("dyninit", 1): [0.90, 0.91, 0.92], ("dyninit", 2): [0.90, 0.90, 0.90],
        ("previous", 1): [0.10, 0.50, 0.90], ("previous", 2): [0.10, 0.20, 0.30],
    }
    runs = {}
    for (m, sd), acc in curves.items():
        name = f"{m}-s{sd}"
        runs[(0.0, 0.3, "fedavg", m, sd)] = name
        d = tmp_path / name
        d.mkdir()
        (d / "summary.json").write_text(json.dumps({"transition_2_accuracy": float(np.mean(acc))}))
        (d / "metrics.jsonl").write_text("\n".join(json.dumps({"session": 4, "accuracy": a}) for a in acc))
    res = build_table(tmp_path, runs, transitions=(2,), rho=0.95)
    row = next(line for line in res["tta"].splitlines() if "| Previous |" in line)
    # seed 1 reaches 0.95 x 0.92 = 0.874 at round 3, seed 2 never reaches 0.855
    assert "| 3.0 (1 of 2 seeds never) | 3.0× |" in row
    assert "inf" not in res["tta"]


@pytest.mark.parametrize("overlap, b_labels", [(0.0, {5, 6, 7, 8, 9}), (0.2, {4, 5, 6, 7, 8})])
def test_config_overlap_reaches_the_partition(overlap, b_labels):
    from fedhetero.context import build_data

    data = build_data(_cfg(**{"data.group_overlap": overlap}))
    labels = data.train.labels_np
    assert set(np.unique(labels[np.concatenate(data.client_indices[10:])]).tolist()) == b_labels
    assert set(np.unique(labels[np.concatenate(data.client_indices[:10])]).tolist()) == {0, 1, 2, 3, 4}


def test_compare_rows_carry_transition_accuracy():
    from fedhetero.compare import comparison_rows

    base = {"final_accuracy": 0.5, "mean_last5_accuracy": 0.5, "mean_client_macs": 1.0, "sim_time_s": 1.0,
            "bytes_total": 1, "wall_s": 1.0, "all_fit_budget": True, "tiers": {}}
    rows = comparison_rows({"dyninit": [{**base, "transition_2_accuracy": 0.8}, {**base, "transition_2_accuracy": 0.6}]}, [])
    assert rows[0]["transition_2_accuracy_mean"] == pytest.approx(0.7)
    assert rows[0]["transition_2_accuracy_std"] == pytest.approx(0.1)


def test_process_back_end_equals_local(tmp_path):
    """Prelude exchanges (the gradient round, with its server-sent rate) and session hooks run the
    same on worker processes: bit-identical to the local back end."""
    over = {"algorithm.options.host": "scaffold", "train.rounds": 15, "sessions.count": 3}
    _, a = _run(tmp_path, "local", **over)
    _, b = _run(tmp_path, "proc", **over, **{"engine.backend": "process", "engine.workers": 2})
    for k, v in _state(a).items():
        assert torch.equal(v, _state(b)[k]), k
