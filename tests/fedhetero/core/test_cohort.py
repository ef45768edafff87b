"""The vectorised cohort trainer (fedhetero.core.local.cohort, ``engine.vectorize``): clients trained together
give each client the numbers it gets trained alone, and the cohort is used where it can be and
falls back where it cannot."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedhetero.core.run.engine import Engine
from _util import ROOT, SESSION_BASE, dotted, session_cfg


BASE = SESSION_BASE


_cfg = session_cfg


def _run(tmp_path: Path, name: str, **over):
    res = Engine(_cfg(**over), tmp_path / name, progress=False).run()
    return res, torch.load(tmp_path / name / "final_model.pt", weights_only=True)


def _state(saved):
    return saved.get("state", saved)


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
        ("feddyn", "dyninit", {"alpha": 0.1}, {}),
        ("fedavg", "continuous", {}, {}),
    ],
)
def test_cohort_equals_one_by_one_float64(tmp_path, host, init, options, extra):
    over = {"dtype": "float64", "algorithm.options.host": host, "algorithm.options.init": init,
            "algorithm.options.host_options": options, "train.rounds": 20, "sessions.count": 4, **extra}
    _, a = _run(tmp_path, "one", **over, **{"engine.vectorize": False})
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
    _, a = _run(tmp_path, "one", **over, **{"engine.vectorize": False})
    _, b = _run(tmp_path, "all", **over, **{"engine.vectorize": True})
    for k, v in _state(a).items():
        ref = _state(b)[k]
        assert torch.allclose(v, ref, rtol=1e-10, atol=1e-10 * float(v.abs().max())), k


def test_flat_linear_cohort_matches_autograd():
    """A model that declares ``flat_linear`` runs as one batched product with a hand-written
    backward: the cohort's forward passes gradcheck and gives each client its own linear map."""
    from types import SimpleNamespace

    from fedhetero.core.local.cohort import Cohort

    class Flat(torch.nn.Module):
        flat_linear = "fc"

        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(7, 4)

        def forward(self, x):
            return self.fc(x.flatten(1))

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, 7, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    model = Flat().double()
    cohort = Cohort(SimpleNamespace(device=torch.device("cpu"), dtype=torch.float64), model, [None] * 3,
                    [model.state_dict()] * 3)

    def forward(x, w, b):
        return cohort.forward({"fc.weight": w, "fc.bias": b}, x)

    assert torch.autograd.gradcheck(forward, (x, w, b))
    out = forward(x, w, b)
    ref = torch.stack([torch.nn.functional.linear(x[i], w[i], b[i]) for i in range(3)])
    assert torch.allclose(out, ref, rtol=1e-12, atol=0)


def test_cohort_is_used_and_falls_back(tmp_path, monkeypatch):
    from fedhetero.core.local import cohort

    calls = []
    real = cohort.Cohort.train

    def spy(self, *a, **k):
        calls.append(len(self.tasks))
        return real(self, *a, **k)

    monkeypatch.setattr(cohort.Cohort, "train", spy)
    Engine(_cfg(**{"engine.vectorize": True, "train.rounds": 15, "sessions.count": 3}), tmp_path / "v", progress=False).run()
    assert calls and set(calls) == {10}
    calls.clear()
    # BatchNorm running statistics: a stacked cohort too
    Engine(_cfg(**{"engine.vectorize": True, "model.name": "lenet5", "train.rounds": 15, "sessions.count": 3}),
           tmp_path / "bn", progress=False).run()
    assert calls and set(calls) == {10}
    calls.clear()
    # momentum buffers kept per client: a cohort too
    Engine(_cfg(**{"engine.vectorize": True, "train.optimizer_state": "persistent", "train.momentum": 0.9,
                   "train.rounds": 15, "sessions.count": 3}), tmp_path / "persistent", progress=False).run()
    assert calls and set(calls) == {10}
    calls.clear()
    # off: one by one
    Engine(_cfg(**{"engine.vectorize": False, "train.rounds": 3, "sessions.count": 3, "sessions.rounds": 1}),
           tmp_path / "off", progress=False).run()
    assert calls == []
    # by default (auto), on a CPU: cohorts of engine.min_cohort clients or more, of 10 steps or more
    auto = {"train.rounds": 3, "sessions.count": 3, "sessions.rounds": 1, "train.local_steps": 10}
    Engine(_cfg(**auto, **{"engine.min_cohort": 11}), tmp_path / "auto-few", progress=False).run()
    assert calls == []
    Engine(_cfg(**{**auto, "train.local_steps": 9}), tmp_path / "auto-short", progress=False).run()
    assert calls == []
    Engine(_cfg(**auto), tmp_path / "auto", progress=False).run()
    assert calls and set(calls) == {10}


# ---------------------------------------------------------------------------- stacked models (BatchNorm, GroupNorm, clipping)
def _fedavg_like(name: str, **over):
    from fedhetero.core.common.config import from_dict

    data = {
        "seed": 4, "threads": 1, "dtype": "float64",
        "data": {"dataset": "digits", "num_clients": 6, "partition": "dirichlet", "alpha": 0.5},
        "model": {"name": "lenet5", "norm": "bn"},
        "train": {"rounds": 2, "sample_rate": 1.0, "batch_size": 16, "lr": 0.05, "local_epochs": 1,
                  "momentum": 0.9, "nesterov": True, "weight_decay": 0.001},
        "algorithm": {"name": name},
    }
    return from_dict(dotted(data, over))


@pytest.mark.parametrize(
    "name, over",
    [
        ("fedavg", {}),
        ("fedavg", {"train.clip_grad_norm": 0.5}),
        ("fedavg", {"model.norm": "groupnorm1", "train.local_steps": 7}),
        ("fedprox", {"algorithm.options": {"mu": 0.3}}),
        # a gentler rate: at lr 0.05 with Nesterov SCAFFOLD diverges (losses past 100) and amplifies
        # the order of sums beyond any tolerance, one by one or together alike
        ("scaffold", {"train.lr": 0.01, "train.momentum": 0.5}),
    ],
)
def test_stacked_cohort_equals_one_by_one(tmp_path, monkeypatch, name, over):
    """Models with BatchNorm (each client's own batch and running statistics, padded rows of
    uneven clients left out), GroupNorm, gradient clipping and objectives train as one stacked
    model with each client's numbers (float64, up to the order of sums)."""
    from fedhetero.core.local import cohort

    used = []
    real = cohort.Cohort.train
    monkeypatch.setattr(cohort.Cohort, "train", lambda self, *a, **k: used.append(self.stacked is not None) or real(self, *a, **k))
    cfg = _fedavg_like(name, **over, **{"engine.vectorize": False})
    a = Engine(cfg, tmp_path / "one", progress=False).run()
    assert used == []
    b_cfg = _fedavg_like(name, **over, **{"engine.vectorize": True})
    b = Engine(b_cfg, tmp_path / "all", progress=False).run()
    assert used and all(used)  # every round ran as one stacked cohort
    sa = _state(torch.load(tmp_path / "one" / "final_model.pt", weights_only=True))
    sb = _state(torch.load(tmp_path / "all" / "final_model.pt", weights_only=True))
    for k, v in sa.items():
        if v.is_floating_point():
            assert torch.allclose(v, sb[k], rtol=1e-9, atol=1e-9 * float(v.abs().max())), k
        else:
            assert torch.equal(v, sb[k]), k
    _same_client_rows(a, b)  # the same clients, steps and losses


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the CPU runs are the tests above)")
def test_stacked_cohort_on_cuda_equals_one_by_one(tmp_path, monkeypatch):
    """On a GPU the round runs as one stacked cohort with each client's numbers. The stacking check
    once drew its random states on the CPU and added them to the model's CUDA tensors, so every
    cohort on a GPU fell back to one client after another; the check now runs on CPU copies."""
    from fedhetero.core.local import cohort

    used = []
    real = cohort.Cohort.train
    monkeypatch.setattr(cohort.Cohort, "train", lambda self, *a, **k: used.append(self.stacked is not None) or real(self, *a, **k))
    Engine(_fedavg_like("fedavg", device="cuda", **{"engine.vectorize": False}), tmp_path / "one", progress=False).run()
    assert used == []
    Engine(_fedavg_like("fedavg", device="cuda", **{"engine.vectorize": True}), tmp_path / "all", progress=False).run()
    assert used and all(used)
    _close_states(_final(tmp_path / "one"), _final(tmp_path / "all"))


def test_stacking_refuses_what_it_cannot_stack():
    from fedhetero.core.local.stacking import stack_model

    class Mixing(torch.nn.Module):  # mixes channels outside a layer: stacking would mix clients
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(1, 4, 3)
            self.fc = torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(self.conv(x).mean((1, 2, 3), keepdim=True).expand(-1, 4))

    class Odd(torch.nn.Module):  # a layer with parameters the stacking does not know
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.LayerNorm(8)
            self.fc = torch.nn.Linear(8, 2)

        def forward(self, x):
            return self.fc(self.norm(x.flatten(1)))

    assert stack_model(Mixing(), 3, (1, 6, 6)) is None
    assert stack_model(Odd(), 3, (8, 1, 1)) is None


def test_a_process_keeps_a_bounded_number_of_stacked_models(monkeypatch):
    """Stacked models are built once per architecture and cohort size and reused; a run whose
    clients train many structures keeps at most ``STACKED_KEPT`` of them, the least recently used
    going first."""
    from types import SimpleNamespace

    from fedhetero.core.local import cohort

    monkeypatch.setattr(cohort, "STACKED_KEPT", 3)
    ctx = SimpleNamespace(cache={}, dtype=torch.float32, device=torch.device("cpu"), input_shape=(4,))
    models = [torch.nn.Sequential(torch.nn.Linear(4, n)) for n in range(2, 7)]
    first = cohort._stacked_for(ctx, models[0], 2)
    assert first is not None and cohort._stacked_for(ctx, models[0], 2) is first  # reused
    for m in models[1:3]:
        cohort._stacked_for(ctx, m, 2)
    cohort._stacked_for(ctx, models[0], 2)  # used again: now the most recent
    cohort._stacked_for(ctx, models[3], 2)  # a fourth: the least recently used (models[1]) goes
    held = [k for k in ctx.cache if k[0] == "stacked"]
    assert len(held) == 3
    assert cohort._stacked_for(ctx, models[0], 2) is first
    assert len([k for k in ctx.cache if k[0] == "stacked"]) == 3


def test_expanded_models_stack_with_their_reparam_layers():
    """A model expanded into Diverse Branch Blocks (identity-based 1×1 stages, nested blocks
    with frozen identity norms) stacks: each stacked forward equals each client's own model
    (stack_model checks it in float64, train and eval), and every block runs branch by branch."""
    import reparam
    from models import build_model
    from reparam.layers import FrozenIdentityBN, IdentityBasedConv1x1
    from reparam.planning import fill_to_budget
    from fedhetero.core.local.stacking import StackedIdentityConv1x1, stack_model

    torch.manual_seed(0)
    model = reparam.expand(build_model("lenet5", num_classes=10, in_channels=1, norm="bn"), branches="all")
    fill_to_budget(model, 4 * reparam.model_macs(model, (1, 32, 32)), (1, 32, 32), grow_mode="nested")
    kinds = {type(m) for m in model.modules()}
    assert IdentityBasedConv1x1 in kinds and FrozenIdentityBN in kinds
    stacked = stack_model(model, 3, (1, 32, 32))
    assert stacked is not None
    assert any(isinstance(m, StackedIdentityConv1x1) for m in stacked.modules())
    blocks = [m for m in stacked.modules() if isinstance(m, reparam.DiverseBranchBlock)]
    assert blocks and all(b._forward_pre_hooks for b in blocks)  # hooked blocks take no fused path


def test_stacked_cohort_accuracy_curves_within_the_seed_spread(tmp_path):
    """In float32 the order of sums differs, so the numbers do too: over three seeds, the batched
    runs' mean accuracy curve stays within the spread of the one-by-one runs' curves."""
    curves: dict[bool, list[list[float]]] = {False: [], True: []}
    for vec in (False, True):
        for seed in range(3):
            # a moderate rate: at lr 0.05 with Nesterov momentum 0.9 this small job is chaotic, and
            # float32's last bits alone move a seed's accuracy by several points, either way
            cfg = _fedavg_like("fedavg", **{"dtype": "float32", "seed": seed, "train.rounds": 3,
                                            "train.local_epochs": 1, "train.lr": 0.02, "train.momentum": 0.5,
                                            "train.nesterov": False, "engine.vectorize": vec})
            res = Engine(cfg, tmp_path / f"{vec}-{seed}", progress=False).run()
            curves[vec].append([r["accuracy"] for r in res.metrics])
    one = torch.tensor(curves[False])
    together = torch.tensor(curves[True])
    spread = one.max(0).values - one.min(0).values
    assert bool(((together.mean(0) - one.mean(0)).abs() <= spread + 5e-3).all())
    assert float((together - one).abs().max()) < 0.03  # seed by seed, the curves nearly coincide


def _final(path: Path):
    return _state(torch.load(path / "final_model.pt", weights_only=True))


def _close_states(sa, sb, rel=1e-9):
    assert sa.keys() == sb.keys()
    for k, v in sa.items():
        if v.is_floating_point():
            assert torch.allclose(v, sb[k], rtol=rel, atol=rel * float(v.abs().max())), k
        else:
            assert torch.equal(v, sb[k]), k


def _same_client_rows(a, b, same_fields: bool = False) -> None:
    """Two runs' per-client rows: the same clients and steps, losses within float64 rounding (and,
    with ``same_fields``, the same fields reported)."""
    rows_a = [c for r in a.metrics for c in r["clients"]]
    rows_b = [c for r in b.metrics for c in r["clients"]]
    assert [(c["cid"], c["steps"]) for c in rows_a] == [(c["cid"], c["steps"]) for c in rows_b]
    for ca, cb in zip(rows_a, rows_b):
        assert cb["loss"] == pytest.approx(ca["loss"], rel=1e-9)
        if same_fields:
            assert {k for k in ca if k != "seconds"} == {k for k in cb if k != "seconds"}


def _spied(monkeypatch) -> list[int]:
    from fedhetero.core.local import cohort

    sizes: list[int] = []
    real = cohort.Cohort.train
    monkeypatch.setattr(cohort.Cohort, "train", lambda self, *a, **k: sizes.append(len(self.tasks)) or real(self, *a, **k))
    return sizes


# ---------------------------------------------------------------------------- dropout, kept momentum, the FedDU family
@pytest.mark.parametrize(
    "name, over",
    [
        # dropout: each client's masks from its own stream, bit for bit those it draws alone
        ("fedavg", {"model.name": "svhn_cnn", "train.rounds": 1, "train.local_steps": 3}),
        ("fedprox", {"model.name": "svhn_cnn", "algorithm.options": {"mu": 0.2}, "train.local_steps": 3, "train.rounds": 1}),
        # momentum buffers kept from round to round, per client
        ("fedavg", {"train.optimizer_state": "persistent", "train.rounds": 3, "train.sample_rate": 0.7}),
        # FedNova: clients of unequal steps (Dirichlet split), each normalising factor from its own
        ("fednova", {"train.rounds": 2}),
        # the FedDU family's plain-SGD devices at the server's η_t
        ("feddu", {"data.server_fraction": 0.1, "train.rounds": 2}),
        # FedDUM's and FedDUMAP's device momentum (Formula 11: the dampened buffer from zero, every
        # round); FedDUMAP prunes at round 1
        ("feddum", {"data.server_fraction": 0.1, "train.rounds": 2}),
        ("feddumap", {"algorithm.options": {"prune_round": 1, "prune_rate_mode": "fixed", "fixed_prune_rate": 0.4},
                      "data.server_fraction": 0.1, "train.rounds": 3}),
        # Hybrid-FL: the devices train as FedAvg's (the server joins the average on its own)
        ("hybrid_fl", {"data.server_fraction": 0.1, "train.rounds": 2}),
        # FedAP: after pruning at round 1, every client trains the pruned structure
        ("fedap", {"algorithm.options": {"prune_round": 1, "prune_rate_mode": "fixed", "fixed_prune_rate": 0.4},
                   "data.server_fraction": 0.1, "train.rounds": 3}),
        # width methods, grouped by width: the Scaler, the masked loss over each client's own
        # classes, clipping, BatchNorm without running statistics (static BN)
        ("heterofl", {"train.local_steps": 4, "data.num_clients": 9}),
        ("fedrolex", {"train.local_steps": 4, "data.num_clients": 9, "train.rounds": 3}),
        # SplitMix: every base a trainee of its own on its client's batches (1, 2 or 3 bases a
        # client); with clipping the many-base clients run one by one beside batched one-base ones
        ("splitmix", {"train.local_steps": 4, "data.num_clients": 9, "train.rounds": 2}),
        ("splitmix", {"train.local_steps": 4, "data.num_clients": 9, "train.rounds": 2, "train.clip_grad_norm": 0.5}),
        # FedDA: the device momentum starts at the global buffer and the trained buffer goes up, in
        # both implementations of the device step
        ("feddu_da", {"data.server_fraction": 0.1, "train.rounds": 3}),
        ("feddu_da", {"data.server_fraction": 0.1, "train.rounds": 2,
                      "algorithm.options": {"device_momentum_impl": "torch_sgd"}}),
        # IMC: once pruned (round 1), the masks zero the pruned entries before and after every step
        ("imc", {"algorithm.options": {"prune_round": 1, "prune_rate_mode": "fixed", "fixed_prune_rate": 0.5,
                                       "device_momentum": 0.9},
                 "data.server_fraction": 0.1, "train.rounds": 3}),
        # Data-sharing: each device's epochs over its own and its shared server samples
        ("data_sharing", {"data.server_fraction": 0.1, "train.rounds": 2,
                          "algorithm.options": {"shared_samples": 30, "device_momentum": 0.9}}),
        ("data_sharing", {"data.server_fraction": 0.1, "train.rounds": 2, "train.local_steps": 9,
                          "train.clip_grad_norm": 0.5, "algorithm.options": {"shared_samples": 30}}),
        # DynaComm: every exchange's windows of steps (2 steps for the high-frequency group, 6 for
        # the low one), the momentum carried from window to window and, persistent, from round to
        # round; GroupNorm and clipping as in its tables
        ("dynacomm", {"train.local_steps": 6, "train.rounds": 3, "train.optimizer_state": "persistent",
                      "train.clip_grad_norm": 0.5, "model.norm": "groupnorm1",
                      "algorithm.options": {"interval_high": 2, "interval_low": 6, "beta": 0.5}}),
        # DS-FL: from round 2 each client's distillation on the open data towards the server's soft
        # labels (a prelude of plain SGD), then its local SGD; one cohort per tier's model
        ("dsfl", {"data.public_fraction": 0.2, "train.rounds": 3,
                  "algorithm.options": {"subset_size": 150, "kd_epochs": 2, "kd_batch_size": 40}}),
        # MOON on a model with hidden layers: the contrastive loss on the penultimate features of
        # the stacked model, the global and the previous local model's (each client's own)
        ("moon", {"train.rounds": 3, "train.local_steps": 4, "algorithm.options": {"mu": 1.0, "tau": 0.5}}),
        ("moon", {"train.rounds": 2, "model.norm": "groupnorm1", "algorithm.options": {"mu": 5.0}}),
        # FedGen: from round 2 the generator's terms, each client's noise and labels drawn from its
        # own stream step by step, the generated features through the client's own classifier
        ("fedgen", {"train.rounds": 3}),
        ("fedgen", {"train.rounds": 3, "train.local_steps": 5, "train.clip_grad_norm": 0.5,
                    "algorithm.options": {"gen_batch_size": 7, "alpha": 2.0}}),
        ("dynacomm", {"train.local_steps": 5, "train.rounds": 2,
                      "algorithm.options": {"interval_high": 2, "interval_low": 5, "beta": 0.5, "sync_rule": "code"}}),
    ],
)
def test_more_methods_and_models_train_as_cohorts(tmp_path, monkeypatch, name, over):
    """Dropout, persistent momentum and the FedDU family (whose devices run plain SGD at the
    server's rate, stated by ``local_plan``) give each client its one-by-one numbers in a
    cohort (float64, up to the order of sums)."""
    sizes = _spied(monkeypatch)
    a = Engine(_fedavg_like(name, **over, **{"engine.vectorize": False}), tmp_path / "one", progress=False).run()
    assert sizes == []
    b = Engine(_fedavg_like(name, **over, **{"engine.vectorize": True}), tmp_path / "all", progress=False).run()
    assert sizes and sum(sizes) >= 2 * len(b.metrics)
    _close_states(_final(tmp_path / "one"), _final(tmp_path / "all"))
    _same_client_rows(a, b, same_fields=True)


@pytest.mark.parametrize("clip", [None, 0.5])
def test_splitmix_bases_train_as_trainees_of_their_own(tmp_path, monkeypatch, clip):
    """Every SplitMix base is one trainee of a cohort; a clipped client with several bases (one
    gradient norm over all of them) runs one by one, a one-base client still batches."""
    sizes = _spied(monkeypatch)
    over = {"train.local_steps": 4, "data.num_clients": 9, "train.rounds": 2, "train.clip_grad_norm": clip,
            "engine.vectorize": True, "dtype": "float32"}
    res = Engine(_fedavg_like("splitmix", **over), tmp_path / "r", progress=False).run()
    bases = [c["num_bases"] for r in res.metrics for c in r["clients"]]
    assert max(bases) > 1
    expected = sum(bases) if clip is None else sum(b for b in bases if b == 1)
    assert sum(sizes) == expected


@pytest.mark.parametrize(
    "name, over, structures",
    [
        # FedAP before and after pruning: two structures, one per round
        ("fedap", {"algorithm.options": {"prune_round": 1, "prune_rate_mode": "fixed", "fixed_prune_rate": 0.4},
                   "data.server_fraction": 0.1, "train.rounds": 2}, 2),
        # HeteroFL's three tiers: three widths in every round
        ("heterofl", {"train.local_steps": 4, "data.num_clients": 9, "train.rounds": 1}, 3),
    ],
)
def test_structures_group_apart(tmp_path, monkeypatch, name, over, structures):
    """Clients whose models differ in structure never share a cohort: each cohort holds one
    structure (a pruned model, a width)."""
    from fedhetero.core.local import cohort

    seen = []
    real = cohort.Cohort.train

    def spy(self, *a, **k):
        seen.append(cohort.structure_key(self.model))
        assert all(cohort.structure_key(self.model) == seen[-1] for _ in self.tasks)
        return real(self, *a, **k)

    monkeypatch.setattr(cohort.Cohort, "train", spy)
    Engine(_fedavg_like(name, **over, **{"engine.vectorize": True, "dtype": "float32"}), tmp_path / "r",
           progress=False).run()
    assert len(set(seen)) == structures


def test_methods_that_train_otherwise_run_one_by_one(tmp_path, monkeypatch):
    """A method whose local training is not plain SGD (the FedDU family's device momentum in
    PyTorch's form, ``device_momentum_impl: torch_sgd``) keeps its own client half."""
    sizes = _spied(monkeypatch)
    Engine(_fedavg_like("feddu", **{"data.server_fraction": 0.1, "engine.vectorize": True, "dtype": "float32",
                                    "algorithm.options": {"device_momentum": 0.5, "device_momentum_impl": "torch_sgd"}}),
           tmp_path / "m", progress=False).run()
    assert sizes == []


# ---------------------------------------------------------------------------- uneven clients, memory, back ends
from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 60), max_size=40), st.integers(1, 6), st.integers(1, 12),
       st.sampled_from([0.0, 0.25, 1.0]))
def test_plan_cohorts_invariants(steps, min_size, max_size, slack):
    """Every client is in at most one cohort; cohorts are within [min_size, max_size], list
    their clients longest first, run at most (1 + slack) × the steps their clients need, and only
    clients with steps join; equal step counts never leave a client out for padding."""
    from fedhetero.core.local.cohort import plan_cohorts

    plan = plan_cohorts(steps, min_size=min_size, max_size=max_size, slack=slack)
    flat = [i for g in plan for i in g]
    assert len(flat) == len(set(flat))
    for g in plan:
        assert min_size <= len(g) <= max_size
        assert all(steps[i] > 0 for i in g)
        assert [steps[i] for i in g] == sorted((steps[i] for i in g), reverse=True)
        assert len(g) * steps[g[0]] <= (1 + slack) * sum(steps[i] for i in g) + 1e-9
    if steps and len(set(steps)) == 1 and steps[0] > 0 and len(steps) >= min_size and max_size >= min_size:
        parts = -(-len(steps) // max_size)
        if len(steps) // parts >= min_size:
            assert sorted(flat) == list(range(len(steps)))


def test_uneven_clients_train_in_cohorts_of_like_length(tmp_path, monkeypatch):
    """On a Dirichlet split the clients of a round take very different numbers of steps: they
    are grouped so that no cohort pads more than a quarter of its steps, and the results still
    equal one by one: with the BatchNorm statistics masked row by row in a step where a batch is
    short, and plain (the idle clients' running statistics put back) in a step whose only padding
    is clients that have finished."""
    from fedhetero.core.local import cohort, stacking

    padded = []
    real = cohort.Cohort.train

    def spy(self, *a, **k):
        steps = [len(s) for s in self._schedules()]
        padded.append(len(steps) * max(steps) / sum(steps))
        return real(self, *a, **k)

    kinds: dict[str, int] = {"masked": 0, "idle": 0, "plain": 0}
    norm = stacking.StackedBatchNorm2d.forward

    def norm_spy(self, x):
        if self.training:
            assert self.mask is None or self.idle is None
            kinds["masked" if self.mask is not None else "idle" if self.idle is not None else "plain"] += 1
        return norm(self, x)

    monkeypatch.setattr(cohort.Cohort, "train", spy)
    monkeypatch.setattr(stacking.StackedBatchNorm2d, "forward", norm_spy)
    over = {"data.num_clients": 24, "data.alpha": 0.3, "train.rounds": 1, "train.local_epochs": 2}
    Engine(_fedavg_like("fedavg", **over, **{"engine.vectorize": False}), tmp_path / "one", progress=False).run()
    Engine(_fedavg_like("fedavg", **over, **{"engine.vectorize": True}), tmp_path / "all", progress=False).run()
    assert len(padded) >= 2 and max(padded) <= 1.25
    assert min(kinds.values()) > 0, kinds
    _close_states(_final(tmp_path / "one"), _final(tmp_path / "all"))


def test_cohorts_split_to_the_memory_budget(tmp_path, monkeypatch):
    from fedhetero.core.local.cohort import client_bytes

    sizes = _spied(monkeypatch)
    cfg = _fedavg_like("fedavg", **{"train.local_steps": 3, "engine.vectorize": True, "train.rounds": 1})
    from fedhetero.core.local.context import client_context

    ctx = client_context(cfg)
    per = client_bytes(ctx, ctx.build_model())
    assert per > 0
    budget = 2.5 * per / 2**20  # room for two clients
    Engine(_fedavg_like("fedavg", **{"train.local_steps": 3, "engine.vectorize": True, "train.rounds": 1,
                                     "engine.cohort_memory_mb": budget}), tmp_path / "r", progress=False).run()
    assert sizes and max(sizes) <= 2 and sum(sizes) == 6


def test_process_back_end_batches_each_executors_share(tmp_path, monkeypatch):
    """With the process back end each executor trains its share of the round as a cohort (the
    server's own share is seen here); the model equals the local one-by-one run's up to the order
    of sums."""
    sizes = _spied(monkeypatch)
    over = {"data.num_clients": 8, "train.local_steps": 4}
    Engine(_fedavg_like("fedavg", **over, **{"engine.vectorize": False}), tmp_path / "one", progress=False).run()
    sizes.clear()
    Engine(_fedavg_like("fedavg", **over, **{"engine.vectorize": True, "engine.backend": "process", "engine.workers": 2}),
           tmp_path / "proc", progress=False).run()
    assert sizes == [4, 4]  # two rounds, the server's half each time
    _close_states(_final(tmp_path / "one"), _final(tmp_path / "proc"))


# ---------------------------------------------------------------------------- the invariant, over random set-ups
@settings(max_examples=5, deadline=None, derandomize=True)
@given(
    model=st.sampled_from([("lenet5", "bn"), ("lenet5", "groupnorm1"), ("svhn_cnn", "bn"), ("logreg", "bn")]),
    method=st.sampled_from([("fedavg", {}), ("fedprox", {"mu": 0.3})]),
    momentum=st.sampled_from([0.0, 0.9]),
    nesterov=st.booleans(),
    weight_decay=st.sampled_from([0.0, 1e-3]),
    clip=st.sampled_from([None, 0.5]),
    state=st.sampled_from(["reset_per_round", "persistent", "none"]),
    steps=st.sampled_from([None, 3]),
    alpha=st.sampled_from([0.3, 5.0]),
)
def test_cohort_equals_one_by_one_over_random_setups(tmp_path_factory, model, method, momentum, nesterov,
                                                     weight_decay, clip, state, steps, alpha):
    """Whatever the model, method, optimiser settings and split, every client of a cohort gets its
    one-by-one numbers (float64, relative 1e-9): the final model, and each client's steps and loss."""
    name, options = method
    over = {"model.name": model[0], "model.norm": model[1], "algorithm.options": options,
            "train.momentum": momentum, "train.nesterov": nesterov and momentum > 0 and state != "none",
            "train.weight_decay": weight_decay, "train.clip_grad_norm": clip, "train.optimizer_state": state,
            "train.local_steps": steps, "data.alpha": alpha, "train.sample_rate": 0.7, "train.rounds": 2}
    tmp = tmp_path_factory.mktemp("setup")
    a = Engine(_fedavg_like(name, **over, **{"engine.vectorize": False}), tmp / "one", progress=False).run()
    b = Engine(_fedavg_like(name, **over, **{"engine.vectorize": True}), tmp / "all", progress=False).run()
    _close_states(_final(tmp / "one"), _final(tmp / "all"))
    _same_client_rows(a, b)


def test_a_resumed_cohort_run_equals_the_uninterrupted_one_bit_for_bit(tmp_path):
    """Which clients batch together is decided from the round's tasks alone, and a cohort's
    numbers from its clients alone, so a run stopped and resumed (a fresh process cache, stacked
    models rebuilt) gives the uninterrupted run's model bit for bit."""
    over = {"dtype": "float32", "train.rounds": 4, "train.checkpoint_every": 1, "train.optimizer_state": "persistent",
            "engine.vectorize": True, "train.local_steps": 3}
    full = Engine(_fedavg_like("fedavg", **over), tmp_path / "full", progress=False).run()
    Engine(_fedavg_like("fedavg", **over), tmp_path / "cut", progress=False, stop_after=2).run()
    resumed = Engine(None, tmp_path / "cut", progress=False, resume=True).run()
    assert [r.get("accuracy") for r in resumed.metrics] == [r.get("accuracy") for r in full.metrics]
    a, b = _final(tmp_path / "full"), _final(tmp_path / "cut")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------- local training as a value
def test_a_method_that_trains_in_segments_builds_each_client_model_once(tmp_path, monkeypatch):
    """A method whose plan is None and whose local training comes in segments (DynamicFL: REP,
    the epochs around DYMM and the merged upload) builds every client's model once, in its own
    client half, whether its segments then train alone or in cohorts."""
    from fedhetero.algorithms.dynamicfl.algorithm import DynamicFL

    built: list[int] = []
    real = DynamicFL._client_model
    monkeypatch.setattr(DynamicFL, "_client_model", lambda self, run, state: built.append(run.task.cid) or real(self, run, state))
    sizes = _spied(monkeypatch)
    res = Engine(_fedavg_like("dynamicfl", **{"engine.vectorize": True, "dtype": "float32", "train.rounds": 1}),
                 tmp_path / "d", progress=False).run()
    clients = [c["cid"] for c in res.metrics[0]["clients"]]
    assert sorted(built) == sorted(clients) and len(clients) == 6
    assert sizes and all(n >= 2 for n in sizes)  # the clients of one structure trained together


def test_the_guides_example_trains_in_cohorts_with_its_one_by_one_numbers(tmp_path, monkeypatch):
    """The guide's FedAvgM keeps the default model and training and uploads a delta: its clients
    batch, and the run equals the one-by-one run up to the order of float sums (float64)."""
    name = f"{ROOT / 'examples' / 'my_algorithm.py'}:FedAvgM"
    a = Engine(_fedavg_like(name, **{"engine.vectorize": False}), tmp_path / "one", progress=False).run()
    sizes = _spied(monkeypatch)
    b = Engine(_fedavg_like(name, **{"engine.vectorize": True}), tmp_path / "many", progress=False).run()
    assert sizes and max(sizes) >= 2
    for ra, rb in zip(a.metrics, b.metrics):
        assert ra["accuracy"] == pytest.approx(rb["accuracy"], abs=1e-9)
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-9)


@settings(max_examples=60, deadline=None)
@given(masked=st.booleans(), masks=st.booleans(), carried=st.booleans(), momentum=st.booleans())
def test_a_local_plan_refuses_what_it_cannot_train(masked, masks, carried, momentum):
    """A plan's masks come with ``sgd.masked`` and only with it; handed-over momentum needs
    ``sgd.carried``."""
    import dataclasses

    from fedhetero.core.local.objective import LocalPlan, LocalSGD

    sgd = LocalSGD(lr=0.1, masked=masked, carried=carried)
    kw = {"masks": {"w": torch.ones(2)} if masks else None, "momentum": {"w": torch.zeros(2)} if momentum else None}
    ok = masked == masks and (carried or not momentum)
    if ok:
        plan = LocalPlan(sgd, **kw)
        with pytest.raises(dataclasses.FrozenInstanceError):
            plan.sgd = sgd  # type: ignore[misc]  # frozen: a plan is a value
    else:
        with pytest.raises(ValueError, match="LocalPlan"):
            LocalPlan(sgd, **kw)
