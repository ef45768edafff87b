"""Local training in segments (fedhetero.core.local.segments): a method of one's own, written as
docs/write_your_own_algorithm.md shows it, trains alone and in cohorts with the same numbers, and
a segment the cohort cannot run as configured trains alone."""

from __future__ import annotations

import textwrap

import pytest
import torch

from fedhetero.core.common.config import from_dict
from fedhetero.core.run.engine import Engine

METHOD = textwrap.dedent('''
    from fedhetero.algorithms import LocalSegment, SegmentRule, run_segments
    from fedhetero.algorithms.classic.fedavg import FedAvg

    class TwoPhase(FedAvg):
        """FedAvg whose momentum restarts after the first local epoch: two segments."""

        name = "two_phase"
        LR_SCALE = 1.0

        def client_update(self, ctx, task, state):
            return run_segments(ctx, task, self.local_segments(ctx, task, state))

        def local_segments(self, ctx, task, state):
            model = self.client_model(ctx, task, state)
            opt = ctx.make_optimizer(model)
            for group in opt.param_groups:
                group["lr"] *= self.LR_SCALE
            yield LocalSegment(model, opt, 0, 1, cohort=self.rule)
            opt.state.clear()  # the change between segments: momentum starts again
            report = yield LocalSegment(model, opt, 1, ctx.cfg.train.local_epochs, cohort=self.rule)
            return self.upload(ctx, task, model, report)

        @staticmethod
        def rule(segments):
            def grad(params, grads):  # the stacked gradients, (clients, *shape) by name
                assert all(g.shape[0] == len(segments) for g in grads.values())

            return SegmentRule(grad=grad, epoch_end=lambda: None)


    class TwoPhaseSlow(TwoPhase):
        """The same at half the configured learning rate: not the SGD a cohort runs."""

        name = "two_phase_slow"
        LR_SCALE = 0.5
''')


def _cfg(path, vectorize, cls="TwoPhase"):
    return from_dict({
        "seed": 3, "threads": 1, "dtype": "float64",
        "data": {"dataset": "digits", "num_clients": 6, "partition": "dirichlet", "alpha": 0.5},
        "model": {"name": "lenet5", "norm": "bn"},
        "train": {"rounds": 2, "sample_rate": 1.0, "batch_size": 16, "lr": 0.05, "local_epochs": 3,
                  "momentum": 0.9, "weight_decay": 0.001},
        "engine": {"vectorize": vectorize},
        "algorithm": {"name": f"{path}:{cls}"},
    })


def _spied(monkeypatch) -> list[int]:
    from fedhetero.core.local import cohort

    sizes: list[int] = []
    real = cohort.Cohort.train
    monkeypatch.setattr(cohort.Cohort, "train", lambda self, *a, **k: sizes.append(len(self.tasks)) or real(self, *a, **k))
    return sizes


@pytest.fixture
def method(tmp_path, monkeypatch):
    path = tmp_path / "two_phase.py"
    path.write_text(METHOD)
    return path


def _final(path):
    saved = torch.load(path / "final_model.pt", weights_only=True)
    return saved.get("state", saved)


def test_a_segmented_method_of_ones_own_trains_alone_and_in_cohorts_alike(tmp_path, method, monkeypatch):
    sizes = _spied(monkeypatch)
    one = Engine(_cfg(method, False), tmp_path / "one", progress=False).run()
    together = Engine(_cfg(method, True), tmp_path / "all", progress=False).run()
    assert sizes and min(sizes) >= 2  # its segments trained as cohorts (FedAvg's model: one structure)
    a, b = _final(tmp_path / "one"), _final(tmp_path / "all")
    for k, v in a.items():
        if v.is_floating_point():
            assert torch.allclose(v, b[k], rtol=1e-9, atol=1e-9 * float(v.abs().max())), k
    for ra, rb in zip(one.metrics, together.metrics):
        for ca, cb in zip(ra["clients"], rb["clients"], strict=True):
            assert cb["loss"] == pytest.approx(ca["loss"], rel=1e-9) and cb["wall_s"] > 0


def test_a_segment_whose_optimizer_is_not_the_configured_sgd_trains_alone(tmp_path, method, monkeypatch):
    """The cohort runs the configured SGD; a segment whose optimizer differs (another learning
    rate) trains alone, and the run is its one-by-one run bit for bit."""
    sizes = _spied(monkeypatch)
    Engine(_cfg(method, False, "TwoPhaseSlow"), tmp_path / "one", progress=False).run()
    Engine(_cfg(method, True, "TwoPhaseSlow"), tmp_path / "all", progress=False).run()
    assert sizes == []
    a, b = _final(tmp_path / "one"), _final(tmp_path / "all")
    assert all(torch.equal(a[k], b[k]) for k in a)
