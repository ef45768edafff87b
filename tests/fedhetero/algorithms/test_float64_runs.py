"""Every built-in method runs in float64 (``dtype: float64``, as the equivalence tests use it):
what a method feeds its models on the server or the client (HRank inputs, static-BN statistics,
distillation batches) takes the run's dtype."""

from __future__ import annotations

import pytest
import torch

from fedhetero.core.run.engine import Engine
from fedhetero.core.method.registry import get_algorithm, list_algorithms
from _util import local_cfg

#: options that make a one-round run reach the method's server-side step
_OPTIONS = {
    "fedap": {"prune_round": 0, "prune_rate_mode": "fixed", "fixed_prune_rate": 0.4},
    "fedduap": {"prune_round": 0, "prune_rate_mode": "fixed", "fixed_prune_rate": 0.4},
    "feddumap": {"prune_round": 0, "prune_rate_mode": "fixed", "fixed_prune_rate": 0.4},
    "hrank_fl": {"prune_round": 0},
    "imc": {"prune_round": 0, "prune_rate_mode": "fixed", "fixed_prune_rate": 0.4},
    # a few distillation steps: the dtype is what is checked
    "feddf": {"kd_steps": 5},
    "fedet": {"server_steps": 5},
    "dsfl": {"kd_epochs": 1},
}


#: the default run covers one method of each code path that fed float32 inputs before; the slow
#: set (python -m pytest -m slow) runs every built-in method
_DEFAULT = {"fedavg", "fedap", "feddu", "heterofl", "feddf", "fedet", "dsfl", "imc"}


@pytest.mark.parametrize("name", [n if n in _DEFAULT else pytest.param(n, marks=pytest.mark.slow)
                                  for n in list_algorithms() if n != "dyninit"])
def test_method_runs_in_float64(tmp_path, name):
    cls = get_algorithm(name)
    data = {"server_fraction": 0.1 if cls.server_data != "unused" else 0.0, "public_fraction": 0.1 if cls.public_data != "unused" else 0.0}
    cfg = local_cfg(name, rounds=2, options=_OPTIONS.get(name), train={"local_steps": 2}, data=data, dtype="float64")
    res = Engine(cfg, tmp_path / name, progress=False).run()
    assert res.metrics and all(not r["dropped"] for r in res.metrics)
    assert all(v.dtype in (torch.float64, torch.int64, torch.bool, torch.long)
               for v in torch.load(tmp_path / name / "final_model.pt", weights_only=True).get("state", {}).values()
               if isinstance(v, torch.Tensor))
