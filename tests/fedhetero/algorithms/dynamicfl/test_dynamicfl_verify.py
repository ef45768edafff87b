"""``algorithm.options.verify`` checks DynamicFL's structural invariants in every task and stops a
task that breaks one: each check is shown to fire on the bug it exists for (an optimizer not
updated after a structural change, a client model not re-solved to the global model, an upload
that is not the trained model), and to stay silent on the real code."""

from __future__ import annotations

import copy

import pytest
import torch

import reparam
from fedhetero.core.common.config import from_dict
from fedhetero.core.local.context import RunError
from fedhetero.core.run.engine import Engine


def _cfg(**options):
    return from_dict(
        {
            "seed": 0,
            "threads": 1,
            "data": {"num_clients": 4},
            "train": {"rounds": 2, "sample_rate": 1.0, "local_epochs": 2},
            "algorithm": {"name": "dynamicfl", "options": {"verify": True, **options}},
        }
    )


def test_verify_passes_on_the_real_code_and_records_both_errors(tmp_path):
    res = Engine(_cfg(), tmp_path / "run", progress=False).run()
    clients = [c for r in res.metrics for c in r["clients"]]
    assert len(clients) == 8 and res.summary["dropped_clients"] == 0
    assert all(0 <= c["lossless_out"] <= 1e-5 for c in clients)
    returning = [c for c in clients if c["mode"] == "dymm"]
    assert returning and all(0 <= c["lossless_in"] <= 1e-5 for c in returning)


def test_an_optimizer_left_behind_by_a_structural_change_stops_the_task(tmp_path, monkeypatch):
    monkeypatch.setattr("fedhetero.algorithms.dynamicfl.algorithm.apply_to_optimizer", lambda opt, change: None)
    with pytest.raises(RunError, match=r"InvariantError: optimizer out of step with the model after DYMM"):
        Engine(_cfg(), tmp_path / "run", progress=False).run()


def test_a_client_model_not_equal_to_the_global_model_stops_the_task(tmp_path, monkeypatch):
    monkeypatch.setattr(reparam, "rep_to_local", lambda *a, **k: None)  # REP forgotten
    with pytest.raises(RunError, match=r"InvariantError: functions differ after REP"):
        Engine(_cfg(), tmp_path / "run", progress=False).run()


def test_an_upload_that_is_not_the_trained_model_stops_the_task(tmp_path, monkeypatch):
    real = reparam.merge

    def wrong_merge(model, *a, **k):
        plain = real(model, *a, **k)
        for m in plain.modules():
            if isinstance(m, reparam.DiverseBranchBlock) or getattr(m, "bias", None) is None:
                continue
            m.bias.data.add_(1.0)  # a merge that loses a branch's bias
            break
        return plain

    monkeypatch.setattr(reparam, "merge", wrong_merge)
    with pytest.raises(RunError, match=r"InvariantError: functions differ at upload"):
        Engine(_cfg(), tmp_path / "run", progress=False).run()


@pytest.mark.slow  # run by: python -m pytest -m slow
def test_without_verify_the_checks_do_not_run(tmp_path, monkeypatch, lenient):
    """Without ``verify`` the checks cost nothing, and the run does not stop (what a user's run
    does); the invariant tests and verify runs are where such a bug is caught."""
    monkeypatch.setattr("fedhetero.algorithms.dynamicfl.algorithm.apply_to_optimizer", lambda opt, change: None)
    res = Engine(_cfg(verify=False), tmp_path / "run", progress=False).run()
    assert res.summary["dropped_clients"] == 0


def test_a_rep_that_grows_the_anchor_convs_stops_the_task(tmp_path, monkeypatch):
    """Invariant 5: REP with ``rep_scale: gamma`` keeps each anchor filter's norm; a REP that puts
    the global kernel's scale into the conv weights instead (``anchor_stats="keep"``, the code that
    diverged over 200 rounds) is caught on a returning client."""
    real = reparam.rep_to_local

    def keep_scale_in_weights(g, model, anchor_stats="keep", **k):
        change = real(g, model, anchor_stats="keep", **k)
        with torch.no_grad():  # a global kernel larger than the client's own: the conv grows
            for m in model.modules():
                if isinstance(m, reparam.DiverseBranchBlock) and not m.is_merged:
                    bn = m.anchor.bn
                    if isinstance(bn, torch.nn.BatchNorm2d) and not isinstance(bn, reparam.FrozenIdentityBN):
                        k_t, b_t = (t.detach() for t in m.get_equivalent_kernel_bias())
                        m.load_plain(1.5 * k_t, b_t, anchor_stats="keep")
        return change

    monkeypatch.setattr(reparam, "rep_to_local", keep_scale_in_weights)
    with pytest.raises(RunError, match=r"InvariantError: anchor conv filters grew by REP \(dymm\)"):
        Engine(_cfg(), tmp_path / "run", progress=False).run()


@pytest.mark.parametrize("bn_stats, rep_scale, expected", [
    ("private", "gamma", "rescale"), ("private", "weights", "keep"), ("private", "calibrated", "rescale"),
    ("reset", "gamma", "identity"),
])
def test_rep_scale_chooses_what_rep_does_with_the_anchor_bn(bn_stats, rep_scale, expected):
    from fedhetero.algorithms.dynamicfl.algorithm import DynamicFL, DynamicFLOptions

    assert DynamicFL(DynamicFLOptions(bn_stats=bn_stats, rep_scale=rep_scale))._rep_anchor_stats() == expected


def _anchor_running_var_max(run_dir) -> float:
    """The largest running variance of any main-branch BatchNorm in the clients' stored models."""
    import glob

    top = 0.0
    for f in glob.glob(str(run_dir / "client_state" / "*" / "*.pt")):
        state = torch.load(f, weights_only=False)["state"]
        top = max([top] + [float(v.max()) for k, v in state.items() if k.endswith("kxk.bn.running_var")])
    return top


@pytest.mark.slow
def test_over_rounds_rep_keeps_the_anchor_scale_and_the_old_rep_compounds_it(tmp_path):
    """The divergence of the paper-length run, in 12 rounds on digits: clients at 3× returning every
    round. REP that puts the global kernel's scale into the conv weights (``rep_scale: weights``)
    lets the main branch's running variance grow round after round; the default keeps it where
    training puts it."""
    tops = {}
    for scale in ("gamma", "weights"):
        cfg = from_dict({
            "seed": 0, "threads": 1, "data": {"num_clients": 4},
            "train": {"rounds": 12, "sample_rate": 1.0, "local_epochs": 3, "eval_every": 12},
            "budget": {"tiers": [{"name": "large", "ratio": 3.0, "share": 1.0}]},
            # blocks stepping by the sum of their branches' steps, the form the divergence ran in
            "algorithm": {"name": "dynamicfl", "options": {"rep_scale": scale, "block_step": "sum"}},
        })
        res = Engine(cfg, tmp_path / scale, progress=False).run()
        assert res.summary["dropped_clients"] == 0
        tops[scale] = _anchor_running_var_max(tmp_path / scale)
    assert tops["gamma"] < 50  # measured 8.1 (7.4 after 5 rounds)
    assert tops["weights"] > 20 * tops["gamma"]  # measured 2.6e3 (5.2e1 after 5 rounds, 2.3e6 after 20)


def test_calibrated_rep_passes_verify_and_starts_training_from_the_global_function(tmp_path):
    """``rep_scale: calibrated``: after REP each anchor BN's statistics are measured on the client's
    own batches and the anchor re-solved, exactly (verify's function checks pass)."""
    res = Engine(_cfg(rep_scale="calibrated"), tmp_path / "run", progress=False).run()
    clients = [c for r in res.metrics for c in r["clients"]]
    assert res.summary["dropped_clients"] == 0 and res.summary["internal_errors"] == 0
    returning = [c for c in clients if c["mode"] == "dymm"]
    assert returning and all(0 <= c["lossless_in"] <= 1e-5 for c in returning)
    assert all(0 <= c["lossless_out"] <= 1e-5 for c in clients)


def test_calibrate_anchors_makes_training_mode_equal_eval_mode_on_the_batch():
    """A model whose blocks hold only their anchors, with stale statistics: after
    ``reparam.calibrate_anchors`` on a batch, the whole model's training-mode output on that batch
    is its eval-mode output, which did not change."""
    from fedhetero.models import build_model

    torch.manual_seed(0)
    model = reparam.expand(build_model("lenet5", num_classes=10, in_channels=1).double(), branches=[]).eval()
    reparam.randomize_bn_(model, torch.Generator().manual_seed(1))
    x = torch.randn(32, 1, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        before = model(x)
        assert reparam.testing.rel_err(copy.deepcopy(model).train()(x), before) > 1e-2
    change = reparam.calibrate_anchors(model, [x[:16], x[16:]])
    assert change.overwritten and not change.added and not change.removed
    with torch.no_grad():
        assert reparam.testing.rel_err(model.eval()(x), before) <= 1e-10
        assert reparam.testing.rel_err(copy.deepcopy(model).train()(x), before) <= 1e-10


def test_reset_stored_branches_start_from_zero_and_rep_stays_exact(tmp_path, monkeypatch):
    """``stored_branches: reset``: a returning client's non-anchor branches output 0 when REP
    re-solves its anchor (their last BN's γ and β are zero), so the anchor alone carries the global
    model; `verify` checks the client then equals the global model, and it trains as usual."""
    from fedhetero.algorithms.dynamicfl.algorithm import DynamicFL

    zeroed: list[bool] = []
    real = DynamicFL._reset_branches

    def spying(model):
        real(model)
        lasts = [blk.branches[n].last_bn for p, blk in reparam.iter_blocks(model) if ".branches." not in p
                 for n in blk.branch_names if n != "kxk"]
        zeroed.append((len(lasts), all(float(b.weight.abs().max()) == 0 and float(b.bias.abs().max()) == 0 for b in lasts)))

    monkeypatch.setattr(DynamicFL, "_reset_branches", staticmethod(spying))
    res = Engine(_cfg(stored_branches="reset"), tmp_path / "run", progress=False).run()
    clients = [c for r in res.metrics for c in r["clients"]]
    returning = [c for c in clients if c["mode"] in ("dymm", "shrink")]
    assert returning and len(zeroed) == len(returning) and all(ok for _, ok in zeroed)
    assert any(n > 0 for n, _ in zeroed)  # some returning client had branches to reset
    assert all(0 <= c["lossless_in"] <= 1e-5 for c in returning)
    assert res.summary["dropped_clients"] == 0 and res.summary["final_accuracy"] > 0.5


def test_init_random_resolve_reaches_the_first_expansion_and_keeps_every_invariant(tmp_path, monkeypatch):
    """``init`` applies to every branch a client grows, the first expansion's included (it used to
    apply to DYMM's growth only): with ``random_resolve`` the first-visit client's branches start
    from an ordinary init (no zero last-BN γ), and the client still starts equal to the global
    model (eval mode) and uploads what it trained."""
    seen: list[float] = []
    real = reparam.expand

    def watch(model, *a, **k):
        out = real(model, *a, **k)
        for m in out.modules():
            if isinstance(m, reparam.DiverseBranchBlock):
                for name, branch in m.branches.items():
                    if name != reparam.kinds.anchor_name():
                        bns = [b for b in branch.modules() if isinstance(b, torch.nn.BatchNorm2d)]
                        seen.extend(float(bn.weight.abs().min()) for bn in bns[-1:])
        return out

    monkeypatch.setattr(reparam, "expand", watch)
    res = Engine(_cfg(init="random_resolve"), tmp_path / "run", progress=False).run()
    assert seen and min(seen) > 0  # every first-expansion branch has an ordinary γ
    clients = [c for r in res.metrics for c in r["clients"]]
    assert res.summary["dropped_clients"] == 0 and res.summary["internal_errors"] == 0
    assert all(0 <= c["lossless_out"] <= 1e-5 for c in clients)
    assert all(0 <= c["lossless_in"] <= 1e-5 for c in clients if c["mode"] == "dymm")
