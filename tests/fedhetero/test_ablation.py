"""The DynamicFL ablation's pieces: the validation hold-out, DynamicFL's new choices (BN statistics
kept or reset, random saliency, a restricted branch set) with the lossless-transfer checks on,
and the ablation command's grid and tables."""

import json

import numpy as np
import pytest
import torch

import reparam
from fedhetero.lab.ablation import CHOICES, build_tables, plan
from fedhetero.lab.ablation import main as ablation_main
from fedhetero.config import ConfigError, from_dict
from fedhetero.context import build_data
from fedhetero.engine import Engine
from fedhetero.lab.grid import pending, run_grid
from fedhetero.store import ClientStateStore


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


# ---------------------------------------------------------------------------- validation hold-out
def _data_cfg(val):
    return from_dict({"seed": 3, "data": {"dataset": "digits", "num_clients": 8, "val_fraction": val,
                                          "public_fraction": 0.1}})


def test_validation_split_is_stratified_disjoint_and_leaves_no_trace_at_zero():
    with_val = build_data(_data_cfg(0.2))
    without = build_data(_data_cfg(0.0))
    val = with_val.val_indices
    assert without.val_indices is None and val is not None
    labels = with_val.train.labels_np
    # stratified: each class holds its share (rounding to whole samples)
    pool = np.setdiff1d(np.arange(len(labels)), with_val.public_indices)
    for c in np.unique(labels):
        assert abs(int(np.sum(labels[val] == c)) - 0.2 * int(np.sum(labels[pool] == c))) <= 0.5
    used = np.concatenate(with_val.client_indices + [with_val.public_indices])
    assert not np.intersect1d(val, used).size  # no client (and not the public split) sees it
    assert len(np.unique(used)) + len(val) == len(labels)
    # without a hold-out nothing is drawn: the public split is that of a run without the option
    assert np.array_equal(without.public_indices, with_val.public_indices)
    assert np.array_equal(build_data(_data_cfg(0.2)).val_indices, val)  # reproducible


def test_validation_accuracy_is_logged_and_summarised(tmp_path):
    cfg = from_dict({"seed": 0, "threads": 1, "data": {"dataset": "digits", "num_clients": 6, "val_fraction": 0.15},
                     "train": {"rounds": 2, "local_epochs": 1}, "algorithm": {"name": "fedavg"}})
    res = Engine(cfg, tmp_path / "r", progress=False).run()
    rows = [r for r in res.metrics if "accuracy" in r]
    assert all(0.0 <= r["val_accuracy"] <= 1.0 for r in rows)
    assert res.summary["final_val_accuracy"] == rows[-1]["val_accuracy"]
    assert res.summary["best_val_accuracy"] == max(r["val_accuracy"] for r in rows)


@pytest.mark.parametrize("bad", [-0.1, 0.6])
def test_validation_fraction_out_of_range_is_one_clear_error(bad):
    with pytest.raises(ConfigError, match="data.val_fraction"):
        from_dict({"data": {"val_fraction": bad}})


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
    keeps the statistics it stored."""
    from fedhetero.algorithms.dynamicfl import DynamicFL, DynamicFLOptions
    from fedhetero.algorithms.base import ClientTask
    from fedhetero.context import client_context

    cfg = _cfg()
    Engine(cfg, tmp_path / "r", progress=False).run()
    store = ClientStateStore(tmp_path / "r" / "client_state")
    cid = store.clients()[0]
    stored = store.get(cid)
    ctx = client_context(cfg)
    glob = _final(tmp_path / "r")
    seen = 0
    for mode in ("private", "reset"):
        algo = DynamicFL(DynamicFLOptions(bn_stats=mode))
        task = ClientTask(cid=cid, round=4, tier="large", ratio=3.0, budget_macs=3.0 * ctx.plain_macs,
                          num_samples=10, payload={"state": glob})
        model = algo.client_model(ctx, task, stored)
        names = {id(m): n for n, m in model.named_modules()}
        for _, blk in reparam.iter_blocks(model):
            bn = blk.anchor.bn
            if mode == "reset":
                assert torch.count_nonzero(bn.running_mean) == 0
                assert torch.allclose(bn.running_var, torch.full_like(bn.running_var, 1 - bn.eps))
            else:
                kept = stored["state"][names[id(bn)] + ".running_mean"]
                assert torch.count_nonzero(kept) > 0 and torch.equal(bn.running_mean, kept)
            seen += 1
    assert seen >= 2


def test_dymm_sees_both_saliencies_and_modulates(tmp_path, monkeypatch):
    """DYMM gets S_g of the global epoch and S_l of the previous round (a reset at the end of the
    global epoch once emptied S_g, so DYMM never folded or grew a branch), and folds branches."""
    import fedhetero.algorithms.dynamicfl as dfl

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


@pytest.mark.parametrize("bad, match", [(["1x9"], "unknown kinds"), (["kxk"], "besides the anchor"), ("1x1", "list")])
def test_bad_branch_set_is_one_clear_error(bad, match):
    from fedhetero.algorithms import build_algorithm

    with pytest.raises(ConfigError, match="algorithm.options.branches") as err:
        build_algorithm(_cfg(branches=bad))
    assert match in str(err.value)


# ---------------------------------------------------------------------------- the ablation command
def test_plan_shares_the_default_runs_and_counts_the_grid():
    runs = plan([0.1, 0.5], [0, 1], [0.5], list(CHOICES), fedap=True)
    groups = [g for g, _, _ in runs.values()]
    assert groups.count("methods") == 5 * 2 * 2
    assert groups.count("choices") == (len(CHOICES) - 1) * 2  # "default" is the methods' DynamicFL run
    assert groups.count("fedap") == 2 * 2
    shared = [f for g, f, _ in runs.values() if f.get("choice") == "default"]
    assert len(shared) == 2 and all(f["method"] == "dynamicfl" for f in shared)
    # a choice beta outside the methods grid gets its own default runs
    assert sum(1 for _, f, _ in plan([0.1], [0], [5.0], ["default"], False).values() if f.get("choice") == "default") == 1
    both = plan([0.1, 0.5], [0], [0.1, 0.5], ["default", "bn-reset"], False)
    assert sum(1 for g, _, _ in both.values() if g == "choices") == 2  # bn-reset at each beta


def test_ablation_command_runs_reuses_and_tables(tmp_path, capsys):
    args = ["--config", "examples/configs/digits_table.yaml", "--set", "train.rounds=2", "--set", "data.public_fraction=0",
            "--set", "data.val_fraction=0.2", "--set", "threads=1", "--betas", "0.5", "--seeds", "0",
            "--choices", "default,bn-reset", "--no-fedap", "--jobs", "1", "--out", str(tmp_path)]
    assert ablation_main(args) == 0
    methods = (tmp_path / "table_methods.md").read_text()
    choices = (tmp_path / "table_choices.md").read_text()
    for m in ("fedavg", "dynamicfl", "heterofl", "fedrolex", "splitmix"):
        assert f"| {m} |" in methods
    assert "| default |" in choices and "| bn-reset |" in choices
    numbers = json.loads((tmp_path / "results.json").read_text())
    acc = numbers["methods"]["dynamicfl"]["0.5"]["test"]
    assert len(acc) == 1 and 0 <= acc[0] <= 100
    assert numbers["choices"]["default"]["0.5"]["test"] == acc  # the shared run
    capsys.readouterr()
    assert ablation_main(args) == 0  # everything reused
    assert "runs to do" not in capsys.readouterr().out


def test_grid_reports_a_failed_run_and_goes_on(tmp_path):
    runs = {"ok": ["train.rounds=1", "threads=1", "data.public_fraction=0"], "bad": ["train.rounds=1", "model.name=nosuchmodel"]}
    lines = []
    done = run_grid("examples/configs/digits_compare.yaml", runs, tmp_path, jobs=1, report=lines.append)
    assert set(done["failed"]) == {"bad"} and done["ran"] == 2
    assert (tmp_path / "ok" / "summary.json").is_file()
    assert list(pending(tmp_path, runs)) == ["bad"]
    config = "examples/configs/digits_compare.yaml"
    assert list(pending(tmp_path, runs, config)) == ["bad"]  # the finished run is of this config
    changed = {"ok": ["train.rounds=2", "threads=1", "data.public_fraction=0"]}
    assert list(pending(tmp_path, changed, config)) == ["ok"]  # other settings: done again
    assert any("bad: failed" in line for line in lines)
    tables = build_tables(tmp_path, {"x": ("methods", {"beta": 0.5, "method": "fedavg", "seed": 0}, [])})
    assert tables["numbers"]["missing_runs"] == ["x"]


def test_grid_reuses_a_run_finished_meanwhile_and_leaves_a_locked_one_alone(tmp_path, monkeypatch):
    """Two table commands on one folder: a run the other finished after this grid was listed is
    reused, not overwritten; one the other is still writing fails on its lock, untouched."""
    import fedhetero.lab.grid as grid
    from fedhetero.rundir import RunLock

    config = "examples/configs/digits_compare.yaml"
    ov = ["train.rounds=1", "threads=1", "data.public_fraction=0"]
    runs = {"done": ov, "busy": ov + ["seed=5"]}
    assert grid.run_one(config, ov, str(tmp_path / "done"))[2] is None
    summary = tmp_path / "done" / "summary.json"
    before = (summary.stat().st_mtime_ns, summary.read_bytes())
    assert grid.run_one(config, ov, str(tmp_path / "done")) == (str(tmp_path / "done"), 0.0, grid.FINISHED_ELSEWHERE)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "metrics.jsonl").write_text('{"round": 1}\n')  # the other process's rows
    monkeypatch.setattr(grid, "pending", lambda out, r, c=None: {k: list(v) for k, v in r.items()})  # listed stale
    lines: list[str] = []
    with RunLock(tmp_path / "busy"):
        done = grid.run_grid(config, runs, tmp_path, jobs=1, report=lines.append)
    assert (summary.stat().st_mtime_ns, summary.read_bytes()) == before
    assert done["ran"] == 1 and done["reused"] == 1 and set(done["failed"]) == {"busy"}
    assert "in use by another fedhetero run" in done["failed"]["busy"]
    assert (tmp_path / "busy" / "metrics.jsonl").read_text() == '{"round": 1}\n'

    assert any("done: finished meanwhile" in line for line in lines)
