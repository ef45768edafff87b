"""Run a grid of training runs from one base config, several at a time, reusing finished ones.

The table commands (``fedhetero dyninit-table``, ``fedhetero dynamicfl-ablation``) describe their
grid as ``{run name: --set overrides}``; :func:`run_grid` trains every run whose directory has no
``summary.json`` yet, ``jobs`` at a time in worker processes (one thread each), and reports each
as it ends. A run that fails is reported and the others go on, so an interrupted or partly failed
grid is continued by running the command again.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from fedhetero.core.common.config import config_hashes
from fedhetero.core.common.configfile import load_config
from fedhetero.core.run.engine import Engine
from fedhetero.core.run.resume import changed_options
from fedhetero.core.method.registry import build_algorithm

__all__ = ["FINISHED_ELSEWHERE", "pending", "run_grid", "run_one"]


#: what :func:`run_one` returns when another process finished the run after the grid was listed
FINISHED_ELSEWHERE = "finished meanwhile by another process; reused"


def run_one(base: str, overrides: Sequence[str], out_dir: str) -> tuple[str, float, str | None]:
    """Train one run (in a worker process): ``(out_dir, seconds, error or None)``.

    The directory is checked again first: a grid listed before another command on the same folder
    finished this run reuses it (``error`` is :data:`FINISHED_ELSEWHERE`) instead of overwriting
    it, and a run another process is still writing fails on its lock instead of being restarted."""
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    if _finished(Path(out_dir), base, overrides):
        return out_dir, 0.0, FINISHED_ELSEWHERE
    try:
        cfg = load_config(base, overrides=list(overrides))
        Engine(cfg, out_dir, progress=False, overwrite=True).run()
    except Exception as exc:  # reported with the grid, the other runs go on
        return out_dir, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"
    return out_dir, time.perf_counter() - t0, None


def _finished(path: Path, config: str | None, overrides: Sequence[str]) -> bool:
    """A finished run of this very config (its hash, recorded in ``run.json``, matches, and so
    do the method options it was made with: a default that changed since makes another run)."""
    if not (path / "summary.json").is_file():
        return False
    if config is None:
        return True
    try:
        made = json.loads((path / "run.json").read_text()).get("config_hash")
    except (OSError, ValueError):
        return False
    cfg = load_config(config, overrides=list(overrides))
    return made in config_hashes(cfg) and not changed_options(path, cfg, build_algorithm(cfg).options)


def pending(out: Path, runs: Mapping[str, Sequence[str]], config: str | None = None) -> dict[str, list[str]]:
    """The runs of ``runs`` whose directory under ``out`` holds no finished run (with ``config``:
    no finished run of the same config; a run made with other settings is done again)."""
    return {name: list(ov) for name, ov in runs.items() if not _finished(out / name, config, ov)}


def run_grid(config: str, runs: Mapping[str, Sequence[str]], out: Path, jobs: int,
             report: Callable[[str], Any] = print) -> dict[str, Any]:
    """Train the runs of ``runs`` (name → overrides; the directory is ``out/name``) that have no
    finished run of the same config, ``jobs`` at a time. Returns ``{"ran", "reused", "failed": {name: error}, "wall_s"}``."""
    todo = pending(out, runs, config)
    t0 = time.perf_counter()
    failed: dict[str, str] = {}
    reused: list[str] = []
    if todo:
        report(f"{len(todo)} runs to do ({len(runs) - len(todo)} reused), {jobs} at a time")
        with ProcessPoolExecutor(max_workers=max(1, int(jobs))) as pool:
            futs = {pool.submit(run_one, config, ov, str(out / name)): name for name, ov in todo.items()}
            for i, fut in enumerate(as_completed(futs), 1):
                _, secs, err = fut.result()
                name = futs[fut]
                if err == FINISHED_ELSEWHERE:
                    reused.append(name)
                    report(f"[{i}/{len(futs)}] {name}: {err}")
                    continue
                if err:
                    failed[name] = err
                report(f"[{i}/{len(futs)}] {name}: " + (f"failed: {err}" if err else f"{secs:.1f} s"))
    return {"ran": len(todo) - len(reused), "reused": len(runs) - len(todo) + len(reused), "failed": failed,
            "wall_s": time.perf_counter() - t0}
