"""DynamicFL's ablation choices with the lossless-transfer checks on: BN statistics kept or reset, DYMM
with both saliencies, random saliency, a restricted branch set."""

import json

import pytest
import torch

import reparam
from fedhetero.core.common.config import from_dict
from fedhetero.core.common.options import ConfigError
from fedhetero.core.run.engine import Engine
from fedhetero.core.exchange.store import ClientStateStore


def _cfg(**algo):
    return from_dict({
        "seed": 1,
        "dtype": "float64",
        "data": {"dataset": "synthetic", "synthetic_size": 240, "num_clients": 4, "min_partition_size": 5},
        "model": {"name": "lenet5", "width": 0.5},
        "train": {"rounds": 3, "sample_rate": 1.0, "local_epochs": 3, "batch_size": 16, "lr": 0.02},
        "budget": {"tiers": [{"name": "small", "ratio": 1.0, "share": 0.5}, {"name": "large", "ratio": 3.0, "share": 0.5}]},
        "algorithm": {"name": "dynamicfl", "options": {"verify": True, **algo}},
    })


def _clients(path):
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    return [c for r in rows for c in r["clients"]]


def _final(path):
    saved = torch.load(path / "final_model.pt", weights_only=True)
    return saved.get("state", saved)


# ---------------------------------------------------------------------------- DynamicFL choices
def test_bn_statistics_private_or_reset_both_lossless(tmp_path):
    out = {}
    for mode in ("private", "reset"):
        Engine(_cfg(bn_stats=mode), tmp_path / mode, progress=False).run()
        clients = _clients(tmp_path / mode)
        assert any(c["mode"] == "dymm" for c in clients)  # returning clients re-solve their anchors
        for c in clients:
            assert c["lossless_in"] <= 1e-10 and c["lossless_out"] <= 1e-10, c
        out[mode] = _final(tmp_path / mode)
    assert any(not torch.equal(out["private"][k], out["reset"][k]) for k in out["private"])


def test_bn_statistics_reset_restarts_the_anchor_norm(tmp_path):
    """With ``reset`` a returning client's anchor BN starts from mu=0, v=1-eps; with ``private`` it
    keeps the statistics it stored (REP ``gamma``), or measures them anew on its own batches
    (REP ``calibrated``, the default)."""
    from fedhetero.algorithms.dynamicfl.algorithm import DynamicFL, DynamicFLOptions
    from fedhetero.core.exchange.types import ClientTask
    from fedhetero.core.local.context import client_context

    cfg = _cfg()
    Engine(cfg, tmp_path / "r", progress=False).run()
    store = ClientStateStore(tmp_path / "r" / "client_state")
    cid = store.clients()[0]
    stored = store.get(cid)
    ctx = client_context(cfg)
    glob = _final(tmp_path / "r")
    seen = 0
    for mode, scale in (("private", "gamma"), ("reset", "gamma"), ("private", "calibrated")):
        algo = DynamicFL(DynamicFLOptions(bn_stats=mode, rep_scale=scale))
        task = ClientTask(cid=cid, round=4, tier="large", ratio=3.0, budget_macs=3.0 * ctx.plain_macs,
                          num_samples=10, payload={"state": glob})
        model = algo.client_model(ctx, task, stored)
        names = {id(m): n for n, m in model.named_modules()}
        for _, blk in reparam.iter_blocks(model):
            bn = blk.anchor.bn
            kept = stored["state"][names[id(bn)] + ".running_mean"]
            if mode == "reset":
                assert torch.count_nonzero(bn.running_mean) == 0
                assert torch.allclose(bn.running_var, torch.full_like(bn.running_var, 1 - bn.eps))
            elif scale == "gamma":
                assert torch.count_nonzero(kept) > 0 and torch.equal(bn.running_mean, kept)
            else:  # measured on the client's data: neither the stored nor the reset statistics
                assert torch.count_nonzero(bn.running_mean) > 0 and not torch.equal(bn.running_mean, kept)
            seen += 1
    assert seen >= 3


def test_dymm_sees_both_saliencies_and_modulates(tmp_path, monkeypatch):
    """DYMM gets S_g of the global epoch and S_l of the previous round (a reset at the end of the
    global epoch once emptied S_g, so DYMM never folded or grew a branch), and folds branches."""
    import fedhetero.algorithms.dynamicfl.algorithm as dfl

    seen = []
    real = dfl.dymm

    def spy(model, s_local, s_global, *a, **k):
        rep = real(model, s_local, s_global, *a, **k)
        seen.append((len(s_local), len(s_global), len(rep.folded)))
        return rep

    monkeypatch.setattr(dfl, "dymm", spy)
    Engine(_cfg(), tmp_path / "r", progress=False).run()
    assert seen and all(g > 0 and g == n for n, g, _ in seen)
    assert sum(f for _, _, f in seen) > 0
    assert sum(c.get("folded", 0) for c in _clients(tmp_path / "r")) > 0


@pytest.mark.slow  # run by: python -m pytest -m slow
def test_random_saliency_is_seeded_and_changes_the_structure_choice(tmp_path):
    for name in ("a", "b"):
        Engine(_cfg(saliency="random"), tmp_path / name, progress=False).run()
    a, b = _clients(tmp_path / "a"), _clients(tmp_path / "b")
    assert [c["branches"] for c in a] == [c["branches"] for c in b]
    fa, fb = _final(tmp_path / "a"), _final(tmp_path / "b")
    assert all(torch.equal(fa[k], fb[k]) for k in fa)  # same seed, same numbers
    Engine(_cfg(), tmp_path / "synflow", progress=False).run()
    fs = _final(tmp_path / "synflow")
    assert any(not torch.equal(fa[k], fs[k]) for k in fa)  # saliency decides what DYMM folds
    for c in a:
        assert c["lossless_in"] <= 1e-10 and c["lossless_out"] <= 1e-10, c


def test_branch_set_restricts_every_client_structure(tmp_path):
    Engine(_cfg(branches=["1x1_kxk"]), tmp_path / "r", progress=False).run()
    clients = _clients(tmp_path / "r")
    for c in clients:
        assert c["lossless_in"] <= 1e-10 and c["lossless_out"] <= 1e-10, c
        assert c["macs"] <= c["budget_macs"] * (1 + 1e-12)
    store = ClientStateStore(tmp_path / "r" / "client_state")
    kinds = set()
    for cid in store.clients():
        for kinds_of_block in store.get(cid)["structure"]["blocks"].values():
            kinds.update(kinds_of_block if isinstance(kinds_of_block, list) else kinds_of_block.get("branches", []))
    assert kinds and kinds <= {"kxk", "1x1_kxk"}, kinds


@pytest.mark.parametrize("bad, match", [(["1x9"], "must be one of 'kxk'"), (["kxk"], "besides the anchor"), ("1x1", "list")])
def test_bad_branch_set_is_one_clear_error(bad, match):
    from fedhetero.algorithms import build_algorithm

    with pytest.raises(ConfigError, match="algorithm.options.branches") as err:
        build_algorithm(_cfg(branches=bad))
    assert match in str(err.value)
