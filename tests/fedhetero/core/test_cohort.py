"""The vectorised cohort trainer (fedhetero.core.cohort, ``engine.vectorize``): clients trained together
give each client the numbers it gets trained alone, and the cohort is used where it can be and
falls back where it cannot."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedhetero.core.engine import Engine
from _util import SESSION_BASE, session_cfg


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


def test_flat_linear_cohort_matches_autograd():
    """A model that declares ``flat_linear`` runs as one batched product with a hand-written
    backward: the cohort's forward passes gradcheck and gives each client its own linear map."""
    from types import SimpleNamespace

    from fedhetero.core.cohort import Cohort

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
    from fedhetero.core import cohort

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
