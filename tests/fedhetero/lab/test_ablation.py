"""``fedhetero ablation`` (fedhetero.lab.ablation, fedhetero.lab.grid): the plan shares the default runs,
the command runs, reuses and tables the grid, and the grid goes on past a failed run and leaves a
locked one alone."""

import json

import pytest

from fedhetero.cli import main
from fedhetero.lab.ablation import CHOICES, build_tables, plan
from fedhetero.lab.grid import pending, run_grid


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


def _options(overrides):
    """The DynamicFL options a choice's overrides set, as a dict."""
    prefix = "algorithm.options."
    return dict(o[len(prefix):].split("=", 1) for o in overrides if o.startswith(prefix))


def test_every_variant_is_stated_in_full_so_a_new_default_keeps_its_tables():
    """A variant measured against the first-built form names that form's options itself: REP's
    scale and the block step (where they apply), never "whatever the default is"."""
    from fedhetero.algorithms.dynamicfl.algorithm import DynamicFLOptions
    from fedhetero.lab.ablation import FIRST_FORM

    shipped = DynamicFLOptions()
    assert (shipped.rep_scale, shipped.block_step) == ("calibrated", "mean")  # chosen at the paper's protocol
    assert _options(CHOICES["block-mean-calibrated"][1]) == {"rep_scale": "calibrated", "block_step": "mean"}
    assert _options(CHOICES["sum-gamma"][1]) == _options(FIRST_FORM) == {"rep_scale": "gamma", "block_step": "sum"}
    follows_the_default = {"default", "tiers-1x"}
    for name, (what, overrides) in CHOICES.items():
        opts = _options(overrides)
        if name in follows_the_default:
            assert "rep_scale" not in opts and "block_step" not in opts, name
            continue
        assert "block_step" in opts, name
        if opts.get("global_form") != "host":  # REP's scale does not apply to the host form
            assert "rep_scale" in opts, name
        assert what, name


def test_plan_takes_the_methods_dynamicfl_from_the_named_variant():
    runs = plan([0.5], [0], [0.5], ["sum-gamma", "bn-reset"], False, dynamicfl_choice="sum-gamma")
    name = "methods/beta0.5/dynamicfl-sum-gamma/s0"
    group, facts, overrides = runs[name]
    assert group == "methods" and facts["choice"] == "sum-gamma" and facts["form"] == "sum-gamma"
    assert "algorithm.options.rep_scale=gamma" in overrides and "algorithm.options.block_step=sum" in overrides
    assert "choices/beta0.5/sum-gamma/s0" not in runs  # shared with the methods table
    assert "methods/beta0.5/dynamicfl/s0" not in runs
    from fedhetero.lab.ablation import _label

    assert _label(runs) == "dynamicfl (sum-gamma)"
    assert _label(plan([0.5], [0], [0.5], ["default"], False)) == "dynamicfl"


@pytest.mark.slow  # run by: python -m pytest -m slow
def test_ablation_command_runs_reuses_and_tables(tmp_path, capsys):
    args = ["--config", "examples/configs/digits_table.yaml", "--set", "train.rounds=2", "--set", "data.public_fraction=0",
            "--set", "data.val_fraction=0.2", "--set", "threads=1", "--betas", "0.5", "--seeds", "0",
            "--choices", "default,bn-reset", "--no-fedap", "--jobs", "1", "--out", str(tmp_path)]
    assert main(["dynamicfl-ablation", *args]) == 0
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
    assert main(["dynamicfl-ablation", *args]) == 0  # everything reused
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
    from fedhetero.core.common.rundir import RunLock

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


def test_the_tiers_1x_control_trains_every_client_at_the_plain_budget():
    """The control that isolates re-parameterisation: DynamicFL with one tier at 1× (no branch can grow)."""
    from fedhetero.core.common.configfile import load_config

    runs = plan([0.5], [0], [0.5], ["tiers-1x"], fedap=False)
    (name, (group, facts, overrides)), = [(n, r) for n, r in runs.items() if r[0] == "choices"]
    assert name == "choices/beta0.5/tiers-1x/s0" and facts["choice"] == "tiers-1x"
    cfg = load_config("examples/configs/fmnist_dynamicfl_paper.yaml", overrides=overrides)
    assert cfg.algorithm.name == "dynamicfl"
    assert [(t.ratio, t.share) for t in cfg.budget.tiers] == [(1.0, 1.0)]
    # the paper's protocol: 90 devices, 10 % a round, 200 rounds of 3 local epochs at lr 0.01
    assert (cfg.data.num_clients, cfg.train.sample_rate, cfg.train.rounds, cfg.train.local_epochs, cfg.train.lr) == (
        90, 0.1, 200, 3, 0.01)
