"""The Python API: ``fedhetero.run`` and ``fedhetero.compare`` do what ``fedhetero train`` and
``fedhetero compare`` do (same directory, lock, resume and overwrite rules) and hand back the
numbers and the model; ``import fedhetero`` stays free of torch; the README's example runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _util import ROOT, strip_wall
from torch import nn

import fedhetero
from fedhetero.core.run import api
from fedhetero.core.common.config import RunConfig, to_dict
from fedhetero.core.common.options import ConfigError
from fedhetero.core.common.configfile import dump_config, load_config
from fedhetero.core.run.engine import Engine
from fedhetero.core.common.rundir import RunDirError, read_metrics

#: a small synthetic job, as the dotted keys of ``overrides``
SMALL = {
    "data.dataset": "synthetic", "data.synthetic_size": 120, "data.num_clients": 4, "data.min_partition_size": 5,
    "model.width": 0.25, "train.rounds": 2, "train.local_epochs": 1, "algorithm.name": "fedavg", "threads": 1,
}


def test_run_returns_history_summary_model_and_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = fedhetero.run(overrides=SMALL, progress=False)
    # the default directory, under the working directory, named as fedhetero train names it
    assert res.out == api.default_out_dir(res.config) and res.out.is_dir()
    assert res.summary == json.loads((res.out / "summary.json").read_text())
    assert res.history == read_metrics(res.out / "metrics.jsonl") and len(res.history) == 2
    assert res.config == load_config(None, [f"{k}={v}" for k, v in SMALL.items()])
    # the model is the trained global model: the one final_model.pt holds, in eval mode
    assert isinstance(res.model, nn.Module) and not res.model.training
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(res.model(x), fedhetero.load_model(res.out)(x))


def test_overrides_mean_what_set_means_and_every_config_form_is_accepted(tmp_path):
    sets = [f"{k}={v}" for k, v in SMALL.items()]
    want = load_config(None, sets)
    assert api.set_items(SMALL) == sets
    # a string is read as --set reads it; other values are taken as they are
    assert api.load(None, api.set_items({**SMALL, "train.rounds": "2"})) == want
    assert api.set_items({"budget.tiers": ({"name": "a", "ratio": 1, "share": 1},), "train.clip_grad_norm": None}) == [
        'budget.tiers=[{"name": "a", "ratio": 1, "share": 1}]', "train.clip_grad_norm=null"]
    assert api.set_items(["train.rounds=2"]) == ["train.rounds=2"]
    # config: a YAML file, a dict of sections, a RunConfig, each with overrides on top
    path = tmp_path / "job.yaml"
    path.write_text(dump_config(want))
    assert api.load(path) == want
    assert api.load(to_dict(want)) == want
    assert api.load(want, ["train.rounds=5"]).train.rounds == 5
    with pytest.raises(ConfigError, match="train.rounds"):
        fedhetero.run(overrides={**SMALL, "train.rounds": 0}, out=tmp_path / "bad", progress=False)
    with pytest.raises(ConfigError, match="unknown config key 'train.roundz'"):
        fedhetero.run(overrides={"train.roundz": 2}, out=tmp_path / "bad", progress=False)
    with pytest.raises(ConfigError, match="overrides"):
        api.set_items("train.rounds=2")  # type: ignore[arg-type]
    assert not (tmp_path / "bad").exists()


def test_run_directory_rules_are_those_of_train(tmp_path):
    out = tmp_path / "r"
    first = fedhetero.run(overrides=SMALL, out=out, progress=False)
    with pytest.raises(RunDirError, match="already holds.*resume=True.*overwrite=True.*out=") as refused:
        fedhetero.run(overrides={**SMALL, "train.lr": 0.02}, out=out, progress=False)  # another run
    assert "--" not in str(refused.value)  # Python advice: the keyword arguments, not the flags
    with pytest.raises(ConfigError, match="choose one"):
        fedhetero.run(out=out, resume=True, overwrite=True, progress=False)
    again = fedhetero.run(overrides=SMALL, out=out, overwrite=True, progress=False)
    assert strip_wall(again.history) == strip_wall(first.history)


def test_resume_continues_a_stopped_run_to_the_numbers_of_an_uninterrupted_one(tmp_path):
    ref = fedhetero.run(RunConfig(), overrides={**SMALL, "train.rounds": 3}, out=tmp_path / "ref", progress=False)
    cfg = api.load(None, api.set_items({**SMALL, "train.rounds": 3}))
    Engine(cfg, tmp_path / "cut", progress=False, stop_after=1).run()
    # the saved config, with a field that may change on resume given again (the back end)
    res = fedhetero.run(out=tmp_path / "cut", resume=True, overrides={"engine.backend": "local"}, progress=False)
    assert res.summary["resumed_from_round"] == 1
    assert strip_wall(res.history) == strip_wall(ref.history)
    assert res.summary["final_accuracy"] == ref.summary["final_accuracy"]
    with pytest.raises(ConfigError, match="train.lr differs"):
        fedhetero.run(out=tmp_path / "cut", resume=True, overrides={"train.lr": 0.5}, progress=False)


def test_compare_returns_the_table_it_writes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    table = fedhetero.compare("fedavg,heterofl", overrides={**SMALL, "train.rounds": 1}, plot=False, progress=False)
    assert table.out.parent == Path("runs") and table.out.name.startswith("compare-synthetic-lenet5-")
    assert [r["algorithm"] for r in table.rows] == ["fedavg", "heterofl"]
    assert table.rows == json.loads((table.out / "comparison.json").read_text())["rows"]
    # resume reuses the finished runs; options are --option's
    again = fedhetero.compare(["fedavg", "heterofl"], overrides={**SMALL, "train.rounds": 1}, resume=True,
                              plot=False, progress=False)
    assert again.rows == table.rows
    with pytest.raises(RunDirError) as refused:  # a second comparison into the same directory
        fedhetero.compare(["fedavg", "heterofl"], overrides={**SMALL, "train.rounds": 1}, plot=False, progress=False)
    assert "--" not in str(refused.value) and ("resume=True" in str(refused.value) or "overwrite=True" in str(refused.value))
    with pytest.raises(ConfigError, match="not among --algorithms"):
        fedhetero.compare(["fedavg"], overrides=SMALL, options={"feddf.kd_steps": 5}, progress=False)


def test_import_fedhetero_imports_no_torch_and_names_the_api():
    code = (
        "import sys, fedhetero\n"
        "assert 'torch' not in sys.modules, 'torch imported eagerly'\n"
        "assert {'run', 'compare', 'RunResult', 'CompareResult', 'load_model'} <= set(dir(fedhetero))\n"
        "from fedhetero.core.run import api\n"
        "assert fedhetero.run is api.run and fedhetero.compare is api.compare\n"
        "try:\n    fedhetero.nosuch\nexcept AttributeError:\n    pass\nelse:\n    raise SystemExit('no AttributeError')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------------------- the README's example


def readme_api_example() -> str:
    """The ```python block of the README's "Python API" section."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Python API\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"^```python\n(.*?)^```", section, re.M | re.S)
    assert match, "README.md's Python API section has no ```python block"
    return match.group(1)


def test_the_readme_api_example_runs(tmp_path):
    """The README's code, as written, on a smaller job: the synthetic set, 4 clients, 2 rounds
    (``fedhetero.run``'s and ``fedhetero.compare``'s ``overrides`` get the small settings added)."""
    code = readme_api_example()
    assert "fedhetero.run(" in code and "fedhetero.compare(" in code
    small = {k: v for k, v in SMALL.items() if k not in ("train.rounds", "algorithm.name")}
    prelude = (
        "import fedhetero\n"
        f"SMALL = {small!r}\n"
        "def _small(f):\n"
        "    def call(*a, overrides=None, **kw):\n"
        "        return f(*a, overrides={**SMALL, **(overrides or {}), 'train.rounds': 2}, **kw)\n"
        "    return call\n"
        "fedhetero.run, fedhetero.compare = _small(fedhetero.run), _small(fedhetero.compare)\n"
    )
    check = (
        "\nassert len(result.history) == 2 and result.out.is_dir() and model is result.model\n"
        "assert [r['algorithm'] for r in table.rows] == ['fedavg', 'heterofl']\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", prelude + code + check], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "runs").is_dir()


def test_the_same_run_twice_returns_the_finished_result_without_training(tmp_path, capsys):
    """A directory holding this very run, finished (the same config hash), is not an error: its
    result comes back, read from the run's files; nothing is trained or written."""
    out = tmp_path / "r"
    first = fedhetero.run(overrides=SMALL, out=out, progress=False)
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir() if p.is_file()}
    again = fedhetero.run(overrides=SMALL, out=out)
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir() if p.is_file()} == before
    assert again.summary == json.loads((out / "summary.json").read_text())
    assert again.summary["final_accuracy"] == first.summary["final_accuracy"]
    assert again.history == first.history and again.config == first.config and again.out == out
    for (k, a), (k2, b) in zip(first.model.state_dict().items(), again.model.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    said = capsys.readouterr().out
    assert "already holds this run, finished" in said and "overwrite=True" in said and "--" not in said
    # an unfinished run of the same config is still refused, with the advice to resume it
    Engine(api.load(None, api.set_items({**SMALL, "train.rounds": 3})), tmp_path / "cut", progress=False,
           stop_after=1).run()
    with pytest.raises(RunDirError, match="unfinished run.*resume=True"):
        fedhetero.run(overrides={**SMALL, "train.rounds": 3}, out=tmp_path / "cut", progress=False)
