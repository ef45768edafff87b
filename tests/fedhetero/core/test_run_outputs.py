"""What a run leaves and reports: the summary's smoothed accuracy, a divergence stopped with valid JSON,
plain progress lines, the final and best models, the server and public splits a method needs or
would withhold, compacted client state."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch

import fedhetero
from fedhetero.core.common.config import from_dict
from fedhetero.core.common.options import ConfigError
from fedhetero.core.common.configfile import load_config
from fedhetero.core.local.context import RunError
from fedhetero.core.run.engine import Engine
from fedhetero.core.run.summary import summarize


SMALL = [
    "data.dataset=synthetic", "data.synthetic_size=120", "data.num_clients=4", "data.min_partition_size=5",
    "model.width=0.25", "train.rounds=3", "train.local_epochs=1", "algorithm.name=fedavg",
]


def _cfg(*extra: str):
    return load_config(None, SMALL + list(extra))


def _summary_of(accs):
    hist = [{"round": i + 1, "accuracy": a, "clients": [], "sim_time_s": 0.0, "bytes_total": 0, "bytes_up": 0,
             "bytes_down": 0, "tier_accuracy": {}} for i, a in enumerate(accs)]
    return summarize(from_dict({}), hist, 1, 0.0)


def test_smoothed_accuracy_never_exceeds_what_a_round_reached():
    # a curve that rises and levels off within 40 evaluations: the fitted cubic overshoots the plateau
    accs = [float(a) for a in 0.9 * (1 - np.exp(-np.arange(1, 41) / 5))]
    s = _summary_of(accs)
    assert s["smoothed_final_accuracy"] == max(accs) == s["best_accuracy"]


def test_smoothed_accuracy_is_the_peak_of_the_smoothed_curve_over_39_evaluations():
    """The definition in the README: the highest point of the accuracy curve smoothed by a
    Savitzky-Golay filter (window 39 evaluations, cubic), rounded to 3 decimals; below the best
    accuracy when the best was a lucky spike; none for a run of fewer than 39 evaluations."""
    from scipy.signal import savgol_filter

    rng = np.random.default_rng(0)
    clean = 0.9 * (1 - np.exp(-np.arange(1, 61) / 8))
    accs = [float(a) for a in clean + 0.01 * rng.standard_normal(60)]
    accs[45] = 0.99  # one lucky evaluation
    s = _summary_of(accs)
    expected = float(np.round(savgol_filter(accs, 39, 3, mode="interp"), 3).max())
    assert s["smoothed_final_accuracy"] == expected
    assert s["best_accuracy"] == 0.99 and s["smoothed_final_accuracy"] < 0.93
    assert _summary_of(accs[:38])["smoothed_final_accuracy"] is None  # 38 evaluations: no window
    assert _summary_of(accs[:39])["smoothed_final_accuracy"] is not None


def test_divergence_stops_with_a_message_and_valid_json(tmp_path):
    with pytest.raises(RunError, match="non-finite"):
        Engine(_cfg("train.lr=1e30"), tmp_path / "r", progress=False).run()
    for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines() if (tmp_path / "r" / "metrics.jsonl").exists() else []:
        json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in metrics.jsonl"))


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
