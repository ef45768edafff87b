"""FedGen (the generator-based knowledge distillation method).

End to end on a small digits run: it reduces to FedAvg bit for bit when its extra terms are switched
off (α = β = 0; the terms are computed and multiplied by zero), gives the same numbers on the process
back end as on local, resumes to the numbers of an uninterrupted run and learns (accuracy well above
chance after 3 rounds). Unit level: the generator's state round trip, its learning rate schedule
and the option checks.
"""

from __future__ import annotations


import pytest
import torch

from fedhetero.core.common.options import ConfigError
from fedhetero.core.run.engine import Engine
from fedhetero.core.method.registry import build_algorithm
from _util import SharedRuns, equal_states, fedavg_cfg, strip_wall


METHODS = ["fedgen"]


OFF = {  # the options that switch each method's extra term off
    "fedgen": {"alpha": 0.0, "beta": 0.0},
}


_cfg = fedavg_cfg


def _state(eng: Engine) -> dict[str, torch.Tensor]:
    return eng.algorithm.global_model.state_dict()


_assert_equal_states = equal_states
_Runs = SharedRuns


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> _Runs:
    return _Runs(tmp_path_factory.mktemp("fedgen"))


# ---------------------------------------------------------------------- end to end
@pytest.mark.parametrize("name", METHODS)
def test_switched_off_equals_fedavg_bit_for_bit(runs, name):
    ref, ref_res = runs.get("fedavg", _cfg("fedavg"))
    eng, res = runs.get(f"{name}-off", _cfg(name, options=OFF[name]))
    state = _state(eng)
    _assert_equal_states(_state(ref), state)
    assert [r["accuracy"] for r in res.metrics] == [r["accuracy"] for r in ref_res.metrics]
    clients = [c for r in res.metrics for c in r["clients"]]
    # the switched-off term was computed (multiplied by zero), not skipped
    if name == "fedgen":
        assert any("teacher_loss" in c and "latent_loss" in c for c in clients)
        assert eng.algorithm.gen_rounds == 3


@pytest.mark.parametrize("name", METHODS)
def test_learns_and_process_backend_matches_local(runs, name):
    local, rl = runs.get(f"{name}-local", _cfg(name))
    assert rl.summary["final_accuracy"] > 0.3  # 10 classes: chance is 0.1
    proc, rp = runs.get(f"{name}-process", _cfg(name, "process", workers=2))
    assert strip_wall(rp.metrics) == strip_wall(rl.metrics)
    _assert_equal_states(_state(local), _state(proc))


@pytest.mark.parametrize("name", METHODS)
def test_resume_equals_uninterrupted(runs, name):
    full, rf = runs.get(f"{name}-local", _cfg(name))
    Engine(_cfg(name), runs.root / f"{name}-cut", progress=False, stop_after=1).run()
    resumed = Engine(None, runs.root / f"{name}-cut", progress=False, resume=True)
    rr = resumed.run()
    assert strip_wall(rr.metrics) == strip_wall(rf.metrics)
    _assert_equal_states(_state(full), _state(resumed))
    if name == "fedgen":
        _assert_equal_states(full.algorithm.generator.state_dict(), resumed.algorithm.generator.state_dict())


def test_fedgen_generator_state_and_options(runs):
    eng, _ = runs.get("fedgen-local", _cfg("fedgen"))
    algo = eng.algorithm
    assert algo.head_key == "fc3"
    assert algo.gen_rounds == 3 and len(algo.labels) == 10
    # the generator travels as a state dict (tensors only), never as a module
    task = algo.configure(eng.ctx, [eng.client_info(0, 4)])[0]
    assert all(isinstance(v, torch.Tensor) for v in task.payload["generator"].values())
    assert task.payload["generator"]["out.weight"].shape == (84, algo.options.hidden_dim)
    lr = algo.gen_optimizer.param_groups[0]["lr"]
    assert lr == pytest.approx(algo.options.gen_lr * algo.options.gen_lr_decay**2)
    saved = algo.state_dict()
    assert len(saved["adam"]["exp_avg"]) == len(list(algo.generator.parameters()))


@pytest.mark.parametrize(
    "name, options, field",
    [
        ("fedgen", {"gen_lr": 0.0}, "gen_lr"),
        ("fedgen", {"reg_decay": 1.5}, "reg_decay"),
        ("fedgen", {"gen_batch_size": 1}, "gen_batch_size"),
    ],
)
def test_option_ranges_are_checked(name, options, field):
    with pytest.raises(ConfigError, match=f"algorithm.options.{field}"):
        build_algorithm(_cfg(name, options=options))
