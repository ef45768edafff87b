"""The algorithm interface: the client half runs on a fresh instance, client metrics stay JSON, a method
from a user's file runs on every back end, and the engine and the methods import no circle."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedhetero.algorithms import build_algorithm
from fedhetero.core.common.config import from_dict
from fedhetero.core.common.options import ConfigError
from fedhetero.core.run.engine import Engine
from _util import ROOT, fedavg_cfg




_cfg = fedavg_cfg


def _run(tmp_path: Path, cfg, tag: str, **kw):
    eng = Engine(cfg, tmp_path / tag, progress=False, **kw)
    res = eng.run()
    return eng, res


def _assert_same_model(a: Engine, b: Engine) -> None:
    sa, sb = a.algorithm.global_model.state_dict(), b.algorithm.global_model.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


PROBE = '''
import torch

from fedhetero.algorithms import Algorithm


class Probe(Algorithm):
    """Reports, in its client metrics, what its client half saw."""

    name = "probe"

    def client_update(self, ctx, task, state):
        seen = {"saw_global_model": self.global_model is not None, "saw_store": hasattr(ctx, "store"),
                "visits_before": None if state is None else int(state["visits"])}
        out = super().client_update(ctx, task, state)
        out.client_state = {"visits": torch.tensor((state or {}).get("visits", torch.tensor(0)).item() + 1)}
        out.metrics.update(seen)
        return out
'''


def test_client_half_runs_on_a_fresh_instance(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    _, res = _run(tmp_path, _cfg(f"{path}:Probe", rounds=3), "probe")
    seen = [c for row in res.metrics for c in row["clients"]]
    assert seen and all(not c["saw_global_model"] and not c["saw_store"] for c in seen)
    # private state came back to the client that wrote it
    visits = [c["visits_before"] for c in seen if c["visits_before"] is not None]
    assert visits and max(visits) >= 1


def test_no_optimizer_or_non_json_in_client_metrics(tmp_path):
    _, res = _run(tmp_path, _cfg("dynamicfl"), "m")
    for row in res.metrics:
        for c in row["clients"]:
            assert "optimizer" not in c
    text = (tmp_path / "m" / "metrics.jsonl").read_text()
    for line in text.splitlines():
        json.loads(line)


def test_user_algorithm_from_a_file_runs_on_local_and_process(tmp_path):
    """The worked example of docs/write_your_own_algorithm.md runs as written on both back ends."""
    name = f"{ROOT / 'examples' / 'my_algorithm.py'}:FedAvgM"
    results = {}
    for backend in ("local", "process"):
        cfg = _cfg(name, backend, rounds=3, workers=2)
        eng, res = _run(tmp_path, cfg, backend)
        results[backend] = (eng, res)
        assert res.summary["final_accuracy"] > 0.3
    _assert_same_model(results["local"][0], results["process"][0])
    assert build_algorithm(_cfg(name)).options.server_momentum == 0.9
    with pytest.raises(ConfigError, match="server_momentum"):
        build_algorithm(from_dict({"algorithm": {"name": name, "options": {"server_momentum": 1.5}}}))
    with pytest.raises(ConfigError, match="algorithm.name"):
        build_algorithm(from_dict({"algorithm": {"name": "no/such/file.py:X"}}))


def _modules_after_import(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_no_import_circle_between_engine_and_algorithms():
    """The context algorithms code against lives in its own module: importing it, or an algorithm,
    does not import the engine, and the context does not import the algorithms."""
    assert not any(m.startswith("fedhetero.algorithms") for m in _modules_after_import("fedhetero.core.local.context"))
    for algo in ("fedhetero.algorithms.dynamicfl.algorithm", "fedhetero.algorithms.feddumap.feddum", "fedhetero.algorithms.width.heterofl"):
        assert "fedhetero.core.run.engine" not in _modules_after_import(algo), algo
    assert "fedhetero.algorithms.feddumap.feddum" not in _modules_after_import("fedhetero.algorithms.feddumap.feddu")



def test_the_method_interface_is_small_and_has_no_hidden_flags():
    """``Algorithm`` defines at most 20 methods, and no method decides what to do by checking
    whether another method was overridden (``type(self).x is Base.x``): local training is a value
    (``local_plan``), not a set of overrides to detect."""
    import ast
    import re

    from fedhetero.algorithms import Algorithm

    methods = [n for n, v in vars(Algorithm).items() if callable(v) and not isinstance(v, type) and n != "__init__"]
    assert len(methods) <= 20, methods
    identity = re.compile(r"\bis(?: not)? [A-Z]\w*\.[a-z_]\w*\b")
    for path in [*(ROOT / "fedhetero" / "algorithms").rglob("*.py"), ROOT / "fedhetero" / "core" / "method" / "algorithm.py",
                 ROOT / "fedhetero" / "core" / "local" / "runner.py", ROOT / "examples" / "my_algorithm.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
                src = ast.unparse(node)
                assert not identity.search(src), f"{path.name}: {src}"


def test_a_module_of_the_working_directory_runs_on_local_and_process(tmp_path):
    """``algorithm.name=module:Class`` finds ``module`` in the directory the command runs in (as
    uvicorn and flask find an app), on the server and in worker processes; a name that is in no
    folder stays one config error naming the field."""
    import shutil

    command = shutil.which("fedhetero")  # the installed command: its own folder is on its path, not the working one
    assert command is not None, "the fedhetero command is not installed (pip install -e .)"
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "my_algorithm.py").write_text((ROOT / "examples" / "my_algorithm.py").read_text())
    finals = {}
    for backend in ("local", "process"):
        out = tmp_path / backend
        r = subprocess.run(
            [command, "train", "--set", "algorithm.name=my_algorithm:FedAvgM",
             "--set", "train.rounds=2", "--set", f"engine.backend={backend}", "--set", "engine.workers=2",
             "--set", "threads=1", "--out", str(out), "--quiet"],
            cwd=folder, capture_output=True, text=True, timeout=600,
        )
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        finals[backend] = torch.load(out / "final_model.pt", weights_only=True)
    assert all(torch.equal(finals["local"][k], finals["process"][k]) for k in finals["local"])
    r = subprocess.run([command, "train", "--set", "algorithm.name=not_here:FedAvgM",
                        "--out", str(tmp_path / "bad"), "--quiet"], cwd=folder, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "algorithm.name: cannot load 'not_here:FedAvgM'" in r.stderr
