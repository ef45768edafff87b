"""The README's first steps, as a new user takes them: ``fedhetero train`` needs only the base
dependencies (and matplotlib for its plot), the documented back-end command works right after the
quick start, and the run-directory listing names every file a run writes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata

from _util import ROOT, strip_wall

from fedhetero.cli import main
from fedhetero.core.common.rundir import LOGGER_DIRS, RUN_ENTRIES

SMALL = [
    "data.dataset=synthetic", "data.synthetic_size=120", "data.num_clients=4", "data.min_partition_size=5",
    "model.width=0.25", "train.rounds=2", "train.local_epochs=1", "algorithm.name=fedavg", "threads=1",
]


def _sets(*extra: str) -> list[str]:
    return [a for s in SMALL + list(extra) for a in ("--set", s)]


# ---------------------------------------------------------------------------- what train imports

#: what the quick start's command installs besides the base dependencies
QUICK_START_EXTRAS = ("plot",)
#: modules of the other extras' tools, none of which a training run may import
NEVER = ("flwr", "ray", "mypy", "ruff", "pytest", "hypothesis", "importlinter", "grpc", "tensorboard", "mlflow")


def _requirements(dist: str, extras: tuple[str, ...] = ()) -> set[str]:
    """The distributions ``dist`` needs with ``extras`` (names normalised), recursively, among
    those installed."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: set[str] = set()
    todo = [(canonicalize_name(dist), tuple(extras))]
    while todo:
        name, wanted = todo.pop()
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        seen.add(name)
        for text in requires:
            req = Requirement(text)
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in ("", *wanted)):
                continue
            dep = canonicalize_name(req.name)
            if dep not in seen:
                todo.append((dep, tuple(req.extras)))
    return seen


def _other_extras_modules() -> set[str]:
    """The top-level modules of the distributions that only fedhetero's other extras bring in
    (installed here: the test suite runs with them)."""
    from packaging.utils import canonicalize_name

    allowed = _requirements("fedhetero", QUICK_START_EXTRAS)
    extras = tuple(metadata.metadata("fedhetero").get_all("Provides-Extra") or [])
    others = _requirements("fedhetero", extras) - allowed
    return {top for top, dists in metadata.packages_distributions().items()
            if {canonicalize_name(d) for d in dists} <= others}


#: ``fedhetero train ARGS`` in a fresh interpreter; with modules named (JSON), every import or
#: look-up of those fails as in an environment without them. Prints the exit status and the modules
#: the run imported.
_RUN = """
import json, sys
blocked = set(json.loads(sys.argv[1]))

class Absent:
    \"\"\"A meta-path finder that finds nothing of the blocked modules.\"\"\"
    def __init__(self, finder):
        self.finder = finder
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            return None
        return self.finder.find_spec(name, path, target) if hasattr(self.finder, "find_spec") else None
    def invalidate_caches(self):
        getattr(self.finder, "invalidate_caches", lambda: None)()

before = set(sys.modules)
sys.meta_path[:] = [Absent(f) for f in sys.meta_path]
from fedhetero.cli import main
rc = main(["train", "--quiet", *sys.argv[2:]])
print(json.dumps({"rc": rc, "modules": sorted(set(sys.modules) - before)}))
"""


def _train_in_a_fresh_interpreter(tmp_path, blocked: set[str], *args: str) -> set[str]:
    proc = subprocess.run([sys.executable, "-c", _RUN, json.dumps(sorted(blocked)), *args],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["rc"] == 0, proc.stderr[-4000:]
    return {m.split(".")[0] for m in report["modules"]}


def test_train_imports_no_tool_of_the_other_extras(tmp_path):
    """The default job (one round) imports none of the tools the test, flower and loggers extras
    bring (Flower, Ray, mypy, ruff, pytest ...), though they are installed here."""
    imported = _train_in_a_fresh_interpreter(tmp_path, set(), "--out", str(tmp_path / "r"), "--set", "train.rounds=1")
    assert "torch" in imported and (tmp_path / "r" / "summary.json").is_file()
    assert imported.isdisjoint(NEVER), sorted(imported & set(NEVER))


def test_train_runs_without_the_other_extras(tmp_path):
    """With every module that only the other extras install made absent, as in an environment
    made by the quick start's ``pip install -e ".[plot]"``, a run completes and writes its plot. (A
    library may look for an optional module and go on without it, as NumPy's f2py does with
    charset_normalizer; those are absent too.)"""
    blocked = _other_extras_modules() | set(NEVER)
    assert {"flwr", "pytest"} <= blocked  # the test suite's environment has the extras
    imported = _train_in_a_fresh_interpreter(tmp_path, blocked, "--out", str(tmp_path / "r"), *_sets())
    assert imported.isdisjoint(blocked)
    assert (tmp_path / "r" / "summary.json").is_file() and (tmp_path / "r" / "accuracy.png").is_file()


# ---------------------------------------------------------------------------- back ends


def test_the_documented_process_command_works_right_after_the_quick_start(tmp_path, monkeypatch, capsys):
    """``fedhetero train``, then ``fedhetero train --set engine.backend=process …``: both run (the
    back end is not in the config hash, so the second gets the default name plus ``-process``),
    with the same numbers."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--quiet", *_sets()]) == 0
    assert main(["train", "--quiet", *_sets("engine.backend=process", "engine.workers=2")]) == 0
    capsys.readouterr()
    local, process = sorted((tmp_path / "runs").iterdir(), key=lambda p: len(p.name))
    assert process.name == f"{local.name}-process"
    rows = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (local, process)]
    assert strip_wall(rows[0]) == strip_wall(rows[1])
    # the same command again prints the finished run's table and trains nothing
    assert main(["train", "--quiet", *_sets("engine.backend=process", "engine.workers=2")]) == 0
    assert "already held this run, finished" in capsys.readouterr().out
    # --resume without --out: the config's directory, else the one of the same config on another
    # back end (here the local run, continued on the process back end)
    (local / "summary.json").unlink()
    (local / "checkpoint.pt").unlink()
    (process / "config.yaml").rename(process / "config.yaml.away")
    try:
        assert main(["train", "--quiet", "--resume", *_sets("engine.backend=process", "engine.workers=2")]) == 0
    finally:
        (process / "config.yaml.away").rename(process / "config.yaml")
    assert json.loads((local / "summary.json").read_text())["final_accuracy"] == json.loads(
        (process / "summary.json").read_text())["final_accuracy"]


# ---------------------------------------------------------------------------- the README's listing


def test_the_readme_lists_every_file_a_run_writes():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n### The run directory\n", 1)[1].split("\n### ", 1)[0]
    listed = set(re.findall(r"^\| `([^`]+)`", section, re.M))
    listed |= {name for row in re.findall(r"^\| (`[^|]+)\|", section, re.M) for name in re.findall(r"`([^`]+)`", row)}
    # the loggers' folders are documented with the loggers
    missing = [e for e in RUN_ENTRIES if e not in LOGGER_DIRS and e not in listed and f"{e}/" not in listed]
    assert not missing, f"README.md's run-directory table does not list {missing}"
