"""Run directories, bad inputs, results and outputs: each check would have caught a defect."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fedhetero
from fedhetero.cli import default_out_dir, main
from fedhetero.config import ConfigError, from_dict, load_config
from fedhetero.context import RunError
from fedhetero.engine import Engine, summarize
from fedhetero.rundir import RunDirError, RunLock, read_metrics

SMALL = [
    "data.dataset=synthetic", "data.synthetic_size=120", "data.num_clients=4", "data.min_partition_size=5",
    "model.width=0.25", "train.rounds=3", "train.local_epochs=1", "algorithm.name=fedavg",
]


def _cfg(*extra: str):
    return load_config(None, SMALL + list(extra))


def _sets(*extra: str) -> list[str]:
    out = []
    for s in SMALL + list(extra):
        out += ["--set", s]
    return out


# ---------------------------------------------------------------------------- run directories


def test_empty_config_refuses_resume(tmp_path):
    Engine(_cfg(), tmp_path / "r", progress=False, stop_after=2).run()
    (tmp_path / "r" / "config.yaml").write_text("")
    with pytest.raises(RunDirError, match="empty"):
        Engine(None, tmp_path / "r", resume=True, progress=False)


def test_edited_config_refuses_resume(tmp_path):
    Engine(_cfg(), tmp_path / "r", progress=False, stop_after=2).run()
    p = tmp_path / "r" / "config.yaml"
    p.write_text(p.read_text().replace("rounds: 3", "rounds: 5"))
    with pytest.raises(RunDirError, match="changed after the run started"):
        Engine(None, tmp_path / "r", resume=True, progress=False)


def test_partial_last_metrics_line_is_dropped_and_run_resumes(tmp_path):
    full = Engine(_cfg(), tmp_path / "full", progress=False).run()
    Engine(_cfg(), tmp_path / "r", progress=False, stop_after=2).run()
    with open(tmp_path / "r" / "metrics.jsonl", "a") as fh:
        fh.write('{"round": 3, "accur')  # killed inside an append
    res = Engine(None, tmp_path / "r", resume=True, progress=False).run()
    assert res.summary["rounds"] == 3
    assert res.summary["final_accuracy"] == full.summary["final_accuracy"]
    assert res.summary["bytes_total"] == full.summary["bytes_total"]
    assert res.summary["resumed_from_round"] == 2
    assert [r["round"] for r in read_metrics(tmp_path / "r" / "metrics.jsonl")] == [1, 2, 3]


def test_damaged_middle_metrics_line_is_an_error(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"round": 1}\nxx\n{"round": 3}\n')
    with pytest.raises(RunDirError, match="line 2"):
        read_metrics(p)


def test_existing_run_is_not_overwritten_without_asking(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["train", *_sets(), "--out", str(out), "--quiet"]) == 0
    before = (out / "summary.json").read_text()
    rc = main(["train", *_sets(), "--out", str(out), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "--resume" in err and "--overwrite" in err and len(err.splitlines()) == 1
    assert (out / "summary.json").read_text() == before
    assert main(["train", *_sets(), "--out", str(out), "--quiet", "--overwrite"]) == 0


def test_default_dir_depends_on_overrides():
    assert default_out_dir(_cfg()) != default_out_dir(_cfg("train.lr=0.01"))
    assert default_out_dir(_cfg()) == default_out_dir(_cfg())


def test_run_directory_is_locked(tmp_path):
    (tmp_path / "r").mkdir()
    lock = RunLock(tmp_path / "r").acquire()
    try:
        with pytest.raises(RunDirError, match="in use"):
            Engine(_cfg(), tmp_path / "r", progress=False).run()
    finally:
        lock.release()
    Engine(_cfg(), tmp_path / "r", progress=False).run()  # free again


def test_stale_temp_files_are_removed(tmp_path):
    Engine(_cfg(), tmp_path / "r", progress=False, stop_after=1).run()
    stale = [tmp_path / "r" / ".checkpoint.pt.tmp123", tmp_path / "r" / "client_state" / ".x.pt.tmp9"]
    for p in stale:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"partial")
    Engine(None, tmp_path / "r", resume=True, progress=False).run()
    assert not any(p.exists() for p in stale)


def test_resume_reports_where_it_starts_and_counts_all_wall_time(tmp_path):
    from rich.console import Console

    buf = io.StringIO()
    Engine(_cfg(), tmp_path / "r", progress=False, stop_after=2).run()
    res = Engine(None, tmp_path / "r", resume=True, progress=True, console=Console(file=buf)).run()
    assert "resumed from round 2" in buf.getvalue()
    assert res.summary["wall_s"] >= sum(r["wall_s"] for r in res.metrics)


def test_resume_without_checkpoint_says_so(tmp_path):
    from rich.console import Console

    Engine(_cfg("train.checkpoint_every=5"), tmp_path / "r", progress=False, stop_after=1).run()
    buf = io.StringIO()
    res = Engine(None, tmp_path / "r", resume=True, progress=True, console=Console(file=buf)).run()
    assert "no checkpoint yet" in buf.getvalue()
    assert res.summary["rounds"] == 3


@pytest.mark.parametrize("forge", ["nan", "round"])
def test_forged_checkpoint_is_refused(tmp_path, forge):
    Engine(_cfg(), tmp_path / "r", progress=False, stop_after=2).run()
    path = tmp_path / "r" / "checkpoint.pt"
    state = torch.load(path, weights_only=True)
    if forge == "nan":
        key = next(iter(state["algorithm"]["global_model"]))
        state["algorithm"]["global_model"][key].fill_(float("nan"))
    else:
        state["round"] = 10**6
    torch.save(state, path)
    with pytest.raises(RunDirError, match="damaged"):
        Engine(None, tmp_path / "r", resume=True, progress=False).run()


def test_checkpoint_every_round_by_default():
    assert from_dict({}).train.checkpoint_every == 1


# ---------------------------------------------------------------------------- results


def test_threads_are_part_of_the_config():
    cfg = from_dict({})
    assert cfg.threads == 1  # a fixed default: the same config means the same numbers


def test_smoothed_accuracy_never_exceeds_what_a_round_reached():
    cfg = from_dict({})
    accs = [0.1, 0.5, 0.8, 0.9, 0.95, 0.96, 0.969, 0.969]
    hist = [{"round": i + 1, "accuracy": a, "clients": [], "sim_time_s": 0.0, "bytes_total": 0, "bytes_up": 0, "bytes_down": 0, "tier_accuracy": {}} for i, a in enumerate(accs)]
    s = summarize(cfg, hist, 1, 0.0)
    assert s["smoothed_final_accuracy"] <= max(accs)


def test_divergence_stops_with_a_message_and_valid_json(tmp_path):
    with pytest.raises(RunError, match="non-finite"):
        Engine(_cfg("train.lr=1e30"), tmp_path / "r", progress=False).run()
    for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines() if (tmp_path / "r" / "metrics.jsonl").exists() else []:
        json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in metrics.jsonl"))


def test_final_table_names_macs_and_bytes_per_tier(tmp_path, capsys):
    assert main(["train", *_sets(), "--out", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "MMACs" in out and "MFLOPs" not in out and "sent up" in out and "MiB" in out or "KiB" in out
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    for t in summary["tiers"].values():
        assert t["bytes_up"] > 0 and t["bytes_down"] > 0
    assert summary["bytes_up"] + summary["bytes_down"] == summary["bytes_total"]


def test_plain_progress_lines_when_not_a_terminal(tmp_path):
    from rich.console import Console

    buf = io.StringIO()
    Engine(_cfg(), tmp_path / "r", progress=True, console=Console(file=buf, force_terminal=False)).run()
    lines = [line for line in buf.getvalue().splitlines() if line.startswith("round ")]
    assert len(lines) == 3 and "accuracy" in lines[-1]


@pytest.mark.parametrize("algo", ["fedavg", "dynamicfl"])
def test_final_model_loads_with_one_call(tmp_path, algo):
    eng = Engine(_cfg(f"algorithm.name={algo}"), tmp_path / "r", progress=False)
    eng.run()
    model = fedhetero.load_model(tmp_path / "r")
    best = fedhetero.load_model(tmp_path / "r", which="best")
    ref = eng.algorithm.eval_models(eng.ctx)["global"].eval()
    x = torch.randn(4, *eng.ctx.input_shape)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
        assert best(x).shape == ref(x).shape


def test_best_model_is_written_with_the_checkpoints(tmp_path):
    """best_model.pt is the model of the best evaluated round, written with the checkpoint that
    covers that round (never ahead of it: a resume restarts from a checkpoint)."""
    cfg = _cfg("train.rounds=4", "train.eval_every=1", "train.checkpoint_every=2")
    Engine(cfg, tmp_path / "r", progress=False, stop_after=1).run()
    assert (tmp_path / "r" / "metrics.jsonl").is_file() and not (tmp_path / "r" / "best_model.pt").exists()
    eng = Engine(cfg, tmp_path / "r", progress=False, resume=True)
    res = eng.run()
    best = fedhetero.load_model(tmp_path / "r", which="best")
    assert res.summary["best_accuracy"] == max(r["accuracy"] for r in res.metrics)
    assert eng.ctx.evaluate(best)["accuracy"] == res.summary["best_accuracy"]


# ---------------------------------------------------------------------------- bad inputs

BAD = [
    "train.lr=.inf", "train.lr=1e400", "model.width=1e-9", "seed=-1", "device=cudafoo", "threads=100000",
    "train.rounds=100000000000000000000", "train.local_epochs=100000000", "budget.tiers=[{name: '', ratio: 1, share: 1}]",
    "budget.tiers=[{name: a, ratio: .inf, share: 1}]", "algorithm.options.small_q=5", "algorithm.options.large_q=.nan",
    "algorithm.options.calibration_batches=0", "algorithm.options.max_new_per_round=-1", "model.name=resnet50",
    "data.num_clients=5000", "algorithm.name=nosuch", "budget.scenario=random\n",
]


@pytest.mark.parametrize("bad", BAD)
def test_bad_value_is_one_line_exit_2_and_leaves_nothing(tmp_path, capsys, bad):
    out = tmp_path / "never"
    sets = ["--set", "train.rounds=1", "--set", bad] if "rounds" not in bad else ["--set", bad]
    if bad.startswith("budget.scenario"):
        sets = ["--set", "algorithm.name=fedavg", "--set", "budget.scenario=random"]
    rc = main(["train", *sets, "--out", str(out), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()


def test_yaml_number_forms_and_duplicate_keys(tmp_path):
    assert load_config(None, ["train.lr=1e-3"]).train.lr == pytest.approx(1e-3)
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  lr: 1e-3\n")
    assert load_config(p).train.lr == pytest.approx(1e-3)
    p.write_text("train:\n  lr: 0.1\n  lr: 0.2\n")
    with pytest.raises(ConfigError, match="duplicate key 'lr'"):
        load_config(p)
    p.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    with pytest.raises(ConfigError, match="not a text file"):
        load_config(p)


def test_unreadable_config_is_one_line(tmp_path, capsys):
    if os.geteuid() == 0:
        pytest.skip("root reads every file; permission errors cannot be produced")
    p = tmp_path / "c.yaml"
    p.write_text("seed: 1\n")
    p.chmod(0)
    assert main(["train", "--config", str(p), "--quiet"]) == 2


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and fedhetero.__version__ in capsys.readouterr().out


def test_bad_compare_option_fails_before_any_run(tmp_path, capsys):
    rc = main(["compare", "--algorithms", "fedavg,dynamicfl", "--option", "dynamicfl.anchr_norm=x",
               "--out", str(tmp_path / "c"), "--quiet", *_sets()])
    assert rc == 2 and "anchr_norm" in capsys.readouterr().err
    assert not (tmp_path / "c" / "fedavg").exists()


def test_bench_help_names_the_command():
    for what in ("round", "engines", "reparam"):
        r = subprocess.run([sys.executable, "-m", "fedhetero.cli", "bench", what, "--help"], capture_output=True, text=True)
        assert r.returncode == 0 and f"fedhetero bench {what}" in r.stdout and "python -m" not in r.stdout
        assert len(r.stdout.strip().splitlines()) > 3


@pytest.mark.parametrize("algo", ["hybrid_fl", "data_sharing", "feddumap"])
def test_server_data_methods_need_server_data(tmp_path, algo):
    with pytest.raises(ConfigError, match="data.server_fraction"):
        Engine(_cfg(f"algorithm.name={algo}"), tmp_path / "r", progress=False).run()
    assert not (tmp_path / "r").exists()


def test_unused_split_is_refused_unless_shared(tmp_path):
    with pytest.raises(ConfigError, match="withheld"):
        Engine(_cfg("data.server_fraction=0.5"), tmp_path / "r", progress=False).run()
    # a comparison holds the same split out for every method
    res = Engine(_cfg("data.server_fraction=0.5"), tmp_path / "r", progress=False, shared_splits=True).run()
    assert res.summary["rounds"] == 3


def test_client_state_versions_are_compacted(tmp_path):
    Engine(_cfg("algorithm.name=dynamicfl", "data.num_clients=4", "train.sample_rate=1.0"), tmp_path / "r",
           progress=False).run()
    dirs = list((tmp_path / "r" / "client_state").iterdir())
    assert dirs and all(len(list(d.glob("r*.pt"))) == 1 for d in dirs)


def test_results_table_without_arguments_is_a_usage_message():
    script = Path(__file__).resolve().parents[2] / "examples" / "results_table.py"
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert r.returncode == 2 and "usage:" in r.stderr and "Traceback" not in r.stderr
