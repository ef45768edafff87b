"""Fingerprints of a fixed set of short runs, to prove that a change kept every number.

``python -m fedhetero.lab.fingerprint run OUT`` trains the reference runs into ``OUT`` — the
default job, a DynInit session run, a DynaComm run with persistent momentum, and every built-in
method three ways (``<name>-local`` one client at a time, ``<name>-process`` on two worker
processes, ``<name>-batched`` in batched cohorts where the method allows them), each a few rounds
on the bundled digits — and writes ``OUT/fingerprint.json``: per run, the SHA-256 of its metrics without wall-clock fields and of its
final model. ``python -m fedhetero.lab.fingerprint compare A.json B.json`` exits 1, naming the
runs that differ, unless both hold the same fingerprints. Run it before a refactor (from a checkout
of the old commit) and after it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from fedhetero.algorithms import BUILTIN
from fedhetero.core.common.configfile import load_config
from fedhetero.core.run.engine import Engine

__all__ = ["RUNS", "fingerprint", "main"]

_SHORT = ["train.rounds=4", "threads=1"]
_DYNINIT = [
    "data.partition=session_groups", "model.name=logreg", "train.rounds=12", "train.sample_rate=1.0",
    "train.lr_schedule=polynomial", "train.lr_min=0.01", "train.weight_decay=0.0", "train.local_epochs=1",
    "sessions.count=3", "sessions.rounds=4", "sessions.transition_window=2", "algorithm.name=dyninit",
    "algorithm.options.host=fedavg", "threads=1",
]
_DYNACOMM = [
    "algorithm.name=dynacomm", "data.num_clients=8", "train.local_epochs=1", "train.local_steps=6",
    "train.optimizer_state=persistent", "train.nesterov=true", "train.clip_grad_norm=1.0", *_SHORT,
]

# what a method needs besides the default config to run at all
_NEEDS: dict[str, list[str]] = {
    **{m: ["data.public_fraction=0.1"] for m in ("fedet", "dsfl")},
    "feddf": ["data.public_fraction=0.1", "algorithm.options.kd_steps=40"],  # 10,000 server steps a round by default
    **{m: ["data.server_fraction=0.1"] for m in (
        "feddu", "feddu_static", "feddum", "fedduap", "feddumap", "data_sharing", "hybrid_fl",
        "feddu_sm", "feddu_dm", "feddu_da")},
}
_WAYS: dict[str, list[str]] = {
    "local": ["engine.vectorize=false"],
    "process": ["engine.backend=process", "engine.workers=2", "engine.vectorize=false"],
    "batched": ["engine.vectorize=true"],
}


def _method_runs() -> dict[str, list[str]]:
    runs: dict[str, list[str]] = {}
    for method in BUILTIN:
        if method == "dyninit":
            base = [o for o in _DYNINIT if not o.startswith("threads=")] + ["threads=1"]
        else:
            base = [f"algorithm.name={method}", *_NEEDS.get(method, []), *_SHORT]
        for way, overrides in _WAYS.items():
            runs[f"{method}-{way}"] = [*base, *overrides]
    return runs


#: name -> overrides of the default config
RUNS: dict[str, list[str]] = {
    "default": list(_SHORT),
    "dyninit-sessions": _DYNINIT,
    "dynacomm": _DYNACOMM,
    **_method_runs(),
}

_WALL = ("wall_s", "timers")


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def fingerprint(run_dir: Path) -> dict[str, Any]:
    """The run's metrics (wall-clock fields left out) and final model, as SHA-256 digests."""
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = {k: v for k, v in json.loads(line).items() if k not in _WALL}
        row["clients"] = [{k: v for k, v in c.items() if k not in _WALL} for c in row.get("clients", [])]
        rows.append(row)
    state = torch.load(run_dir / "final_model.pt", weights_only=True, map_location="cpu")
    model = hashlib.sha256()
    for key in sorted(state):
        value = state[key]
        model.update(key.encode())
        if isinstance(value, torch.Tensor):
            model.update(str(value.dtype).encode() + str(tuple(value.shape)).encode())
            model.update(value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            model.update(json.dumps(value, default=str).encode())
    return {"rounds": len(rows), "metrics": _digest(rows), "model": model.hexdigest(),
            "final_accuracy": next((r["accuracy"] for r in reversed(rows) if "accuracy" in r), None)}


def _run(out: Path, only: Sequence[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {}
    for name, overrides in RUNS.items():
        if only and name not in only:
            continue
        print(f"[{len(result) + 1}] {name}: {' '.join(overrides)}", flush=True)
        Engine(load_config(None, overrides), out / name, progress=False, overwrite=True).run()
        result[name] = fingerprint(out / name)
    (out / "fingerprint.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    print(f"written: {out / 'fingerprint.json'}")
    return 0


def _compare(a: Path, b: Path) -> int:
    fa, fb = json.loads(a.read_text()), json.loads(b.read_text())
    differ = sorted(n for n in set(fa) | set(fb) if fa.get(n) != fb.get(n))
    for name in sorted(set(fa) | set(fb)):
        print(f"{name}: {'DIFFERS' if name in differ else 'same'}")
    return 1 if differ else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedhetero.lab.fingerprint", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="train the reference runs into OUT and write OUT/fingerprint.json")
    p.add_argument("out", type=Path)
    p.add_argument("--only", default="", help="comma-separated run names (default: all); names are 'default', "
                   "'dyninit-sessions', 'dynacomm' and '<method>-local|process|batched'")
    p = sub.add_parser("compare", help="exit 1 unless two fingerprint files hold the same runs and digests")
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    args = parser.parse_args(argv)
    if args.command == "run":
        return _run(args.out, [n for n in args.only.split(",") if n])
    return _compare(args.a, args.b)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
