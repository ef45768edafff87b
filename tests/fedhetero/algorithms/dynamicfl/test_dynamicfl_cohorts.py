"""DynamicFL's clients trained together (``engine.vectorize``): a round's clients advance through
their local training in segments (the epoch before DYMM, the epochs after it), coinciding
segments — the same structure, the same epochs — train as one batched cohort, and every client
gets the numbers it gets trained alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedhetero.core.common.config import from_dict
from fedhetero.core.run.engine import Engine
from _util import dotted

TIERS = [{"name": "a", "ratio": 2.0, "share": 0.5}, {"name": "b", "ratio": 3.0, "share": 0.5}]


def _cfg(vectorize, dtype="float64", rounds=3, options=None, **over):
    data = {
        "seed": 4, "threads": 1, "dtype": dtype,
        "data": {"dataset": "digits", "num_clients": 6, "partition": "dirichlet", "alpha": 0.5},
        "model": {"name": "lenet5", "norm": "bn"},
        "train": {"rounds": rounds, "sample_rate": 1.0, "batch_size": 16, "lr": 0.05, "local_epochs": 2,
                  "momentum": 0.9, "nesterov": True, "weight_decay": 0.001},
        "budget": {"tiers": TIERS},
        "engine": {"vectorize": vectorize},
        "algorithm": {"name": "dynamicfl", "options": dict(options or {})},
    }
    return from_dict(dotted(data, over))


def _spied(monkeypatch) -> list[int]:
    from fedhetero.core.local import cohort

    sizes: list[int] = []
    real = cohort.Cohort.train
    monkeypatch.setattr(cohort.Cohort, "train", lambda self, *a, **k: sizes.append(len(self.tasks)) or real(self, *a, **k))
    return sizes


def _final(path: Path) -> dict[str, torch.Tensor]:
    saved = torch.load(path / "final_model.pt", weights_only=True)
    return saved.get("state", saved)


STRUCTURE = ("mode", "branches", "grown", "folded", "filled")


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Two final models equal up to the order of float64 sums."""
    assert a.keys() == b.keys()
    for k, v in a.items():
        if v.is_floating_point():
            assert torch.allclose(v, b[k], rtol=1e-9, atol=1e-9 * float(v.abs().max())), k
        else:
            assert torch.equal(v, b[k]), k


def _clients(res):
    return [c for r in res.metrics for c in r["clients"]]


@pytest.mark.parametrize("options, over", [
    ({}, {}),  # the default: synflow saliency over every parameter, blocks stepping by the mean
    ({"saliency": "snip", "saliency_params": "conv_weights", "block_step": "sum"}, {"train.clip_grad_norm": 1.0}),
    ({"saliency": "grad_norm", "grow_mode": "block"}, {"budget.scenario": "increasing"}),
    ({"global_form": "host", "anchor_norm": "calibrated"}, {"train.nesterov": False}),
])
def test_coinciding_segments_train_as_cohorts_with_one_by_one_numbers(tmp_path, monkeypatch, options, over):
    sizes = _spied(monkeypatch)
    one = Engine(_cfg(False, options=options, **over), tmp_path / "one", progress=False).run()
    assert sizes == []
    together = Engine(_cfg(True, options=options, **over), tmp_path / "all", progress=False).run()
    assert sizes and min(sizes) >= 2  # coinciding segments trained as cohorts
    _close(_final(tmp_path / "one"), _final(tmp_path / "all"))
    ca, cb = _clients(one), _clients(together)
    assert [c["cid"] for c in ca] == [c["cid"] for c in cb]
    # each client says how many of its epochs trained in a cohort (only where some did)
    assert not any("cohort_epochs" in c for c in ca) and any(c.get("cohort_epochs", 0) > 0 for c in cb)
    for x, y in zip(ca, cb):
        # the same structure decisions (saliency to rounding: DYMM chose alike), losses to rounding
        assert {k: x.get(k) for k in STRUCTURE} == {k: y.get(k) for k in STRUCTURE}
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-9)
        assert y["wall_s"] > 0  # each client's own time, cohorts' shared
    for ra, rb in zip(one.metrics, together.metrics):
        assert rb["accuracy"] == pytest.approx(ra["accuracy"], abs=1e-12)
        assert rb["timers"].get("rep", 0.0) > 0 and rb["timers"].get("merge", 0.0) > 0  # each client's timers kept
        assert sum(c["wall_s"] for c in rb["clients"]) <= rb["timers"]["client_phase"] * 1.01 + 1e-3


@pytest.mark.parametrize("options", [{}, {"verify": True}, {"saliency": "random"}])
def test_segments_that_train_alone_are_the_one_by_one_run_bit_for_bit(tmp_path, monkeypatch, options):
    """The clients advanced together by the segment driver, each segment trained alone (no cohort
    allowed; with ``verify`` or random saliency none is ever formed), draw the same random numbers
    and compute the same bits as their one-by-one runs: each client's random state is carried
    from one of its pieces to the next."""
    from fedhetero.core.local import segments

    sizes = _spied(monkeypatch)
    if not options:
        monkeypatch.setattr(segments, "_train_cohort", lambda ctx, chosen: None)
    driven: list[int] = []
    real = segments.train_segments
    monkeypatch.setattr("fedhetero.core.local.runner.train_segments",
                        lambda *a, **k: (lambda out: driven.append(len(out)) or out)(real(*a, **k)))
    over = {"init": "random_resolve"}  # new branches drawn at random: the random states matter
    one = Engine(_cfg(False, dtype="float32", options={**over, **options}), tmp_path / "one", progress=False).run()
    together = Engine(_cfg(True, dtype="float32", options={**over, **options}), tmp_path / "all", progress=False).run()
    assert sizes == [] and driven and all(n == 6 for n in driven)  # every task went through the driver
    a, b = _final(tmp_path / "one"), _final(tmp_path / "all")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda c: {k: v for k, v in c.items() if k != "wall_s"}  # noqa: E731
    assert [strip(c) for c in _clients(one)] == [strip(c) for c in _clients(together)]
    assert [r["accuracy"] for r in one.metrics] == [r["accuracy"] for r in together.metrics]


def test_on_a_cpu_by_default_dynamicfl_trains_one_by_one(tmp_path, monkeypatch):
    """``engine.vectorize: null`` on a CPU: DynamicFL's coinciding groups are too few and too small
    to pay there, so its tasks run one by one through the back end, as before."""
    from fedhetero.core.local import segments

    called: list[int] = []
    monkeypatch.setattr("fedhetero.core.local.runner.train_segments",
                        lambda *a, **k: called.append(1) or segments.train_segments(*a, **k))
    sizes = _spied(monkeypatch)
    Engine(_cfg(None, dtype="float32", rounds=2, **{"train.batch_size": 4}), tmp_path / "d", progress=False).run()
    assert called == [] and sizes == []


def test_the_process_back_end_batches_each_executors_share(tmp_path):
    """On worker processes each executor advances its share of the round's clients together: the
    model equals the local one-by-one run's up to the order of sums (float64)."""
    one = Engine(_cfg(False, rounds=2), tmp_path / "one", progress=False).run()
    proc = Engine(_cfg(True, rounds=2, **{"engine.backend": "process", "engine.workers": 2}), tmp_path / "proc",
                  progress=False).run()
    _close(_final(tmp_path / "one"), _final(tmp_path / "proc"))
    assert [{k: c.get(k) for k in STRUCTURE} for c in _clients(one)] == \
        [{k: c.get(k) for k in STRUCTURE} for c in _clients(proc)]


from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=4, deadline=None, derandomize=True)
@given(
    epochs=st.sampled_from([1, 2, 3]),
    tiers=st.sampled_from([TIERS, [{"name": "x", "ratio": 1.0, "share": 0.5}, {"name": "y", "ratio": 2.5, "share": 0.5}],
                           [{"name": "z", "ratio": 3.0, "share": 1.0}]]),
    saliency=st.sampled_from(["synflow", "snip", "grad_norm"]),
    block_step=st.sampled_from(["sum", "mean"]),
    momentum=st.sampled_from([0.0, 0.9]),
    nesterov=st.booleans(),
    batch=st.sampled_from([8, 16]),
)
def test_cohorts_equal_one_by_one_over_random_setups(tmp_path_factory, epochs, tiers, saliency, block_step, momentum,
                                                     nesterov, batch):
    """The invariant over random set-ups: whatever the epochs (DYMM's segment split), tiers,
    saliency metric, block step and SGD, a run whose coinciding segments train as cohorts equals
    the one-by-one run up to the order of sums (float64): the final model, each client's loss and
    the structure decisions."""
    tmp = tmp_path_factory.mktemp("seg")
    options = {"saliency": saliency, "block_step": block_step}
    over = {"budget.tiers": tiers, "train.local_epochs": epochs, "train.momentum": momentum,
            "train.nesterov": nesterov and momentum > 0, "train.batch_size": batch}
    one = Engine(_cfg(False, rounds=2, options=options, **over), tmp / "one", progress=False).run()
    together = Engine(_cfg(True, rounds=2, options=options, **over), tmp / "all", progress=False).run()
    _close(_final(tmp / "one"), _final(tmp / "all"))
    for x, y in zip(_clients(one), _clients(together), strict=True):
        assert {k: x.get(k) for k in STRUCTURE} == {k: y.get(k) for k in STRUCTURE}
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-9)


def test_the_driver_holds_clients_within_the_memory_budget(tmp_path, monkeypatch):
    """Clients are advanced in windows that hold at most ``engine.cohort_memory_mb`` of models: a
    tiny budget holds one client at a time (nothing to batch; the one-by-one numbers bit for bit),
    the default the round's six."""
    from fedhetero.core.local import segments

    windows: list[int] = []
    real = segments._run_window
    monkeypatch.setattr(segments, "_run_window", lambda ctx, clients, smallest: windows.append(len(clients))
                        or real(ctx, clients, smallest))
    sizes = _spied(monkeypatch)
    Engine(_cfg(False, dtype="float32", rounds=2), tmp_path / "one", progress=False).run()
    Engine(_cfg(True, dtype="float32", rounds=2, **{"engine.cohort_memory_mb": 0.01}), tmp_path / "tiny",
           progress=False).run()
    assert sizes == [] and windows and set(windows) <= {0, 1} and windows.count(1) == 12
    a, b = _final(tmp_path / "one"), _final(tmp_path / "tiny")
    assert all(torch.equal(a[k], b[k]) for k in a)
    windows.clear()
    Engine(_cfg(True, dtype="float32", rounds=2), tmp_path / "all", progress=False).run()
    assert windows == [6, 6] and sizes


def test_a_resumed_batched_run_equals_the_uninterrupted_one_bit_for_bit(tmp_path, monkeypatch):
    """Which segments batch together is decided from the round's clients alone, so a batched run
    stopped and resumed (a fresh process: stacked models rebuilt, client states read from their
    files) gives the uninterrupted run's model bit for bit."""
    sizes = _spied(monkeypatch)
    over = {"train.checkpoint_every": 1}
    full = Engine(_cfg(True, dtype="float32", rounds=4, **over), tmp_path / "full", progress=False).run()
    assert sizes
    Engine(_cfg(True, dtype="float32", rounds=4, **over), tmp_path / "cut", progress=False, stop_after=2).run()
    resumed = Engine(None, tmp_path / "cut", progress=False, resume=True).run()
    assert [r.get("accuracy") for r in resumed.metrics] == [r.get("accuracy") for r in full.metrics]
    a, b = _final(tmp_path / "full"), _final(tmp_path / "cut")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the CPU runs are the tests above)")
def test_on_a_gpu_dynamicfl_batches_by_default_with_one_by_one_numbers(tmp_path, monkeypatch):
    """On a GPU ``engine.vectorize: null`` batches coinciding segments (cohorts of two or more),
    with the one-by-one numbers up to the order of sums (float64)."""
    sizes = _spied(monkeypatch)
    one = Engine(_cfg(False, device="cuda"), tmp_path / "one", progress=False).run()
    together = Engine(_cfg(None, device="cuda"), tmp_path / "all", progress=False).run()
    assert sizes and min(sizes) >= 2
    _close(_final(tmp_path / "one"), _final(tmp_path / "all"))
    for x, y in zip(_clients(one), _clients(together), strict=True):
        assert {k: x.get(k) for k in STRUCTURE} == {k: y.get(k) for k in STRUCTURE}
