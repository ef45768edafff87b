"""Mean ± std over seeds of finished `fedhetero train` runs, as a markdown table.

    python examples/seed_table.py runs/dynamicfl-paper-v2/*

Runs whose resolved configs (`config.yaml`, with every method option as `run.json` records it) are
equal but for the seed form one row; a row is named
by the settings in which it differs from the other rows (the method, `data.alpha`, a method
option…). Columns: test accuracy of the last round, the mean of the last five evaluations, the
best evaluation and the validation accuracy of the last round (%), each as mean ± std over the
row's seeds (the sample standard deviation; a single seed has none), then every seed's test /
validation figures. Runs without a `summary.json` (not finished) are listed after the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import yaml

#: Settings that do not make runs different experiments: where the data and the run live, and
#: how the clients are run (the same numbers up to the order of float sums).
IGNORED = ("seed", "data.data_dir", "engine", "threads", "device", "tune_malloc")


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flat(v, key + "."))
        else:
            out[key] = json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else v
    return out


def _ignored(key: str) -> bool:
    return any(key == i or key.startswith(i + ".") for i in IGNORED)


def _pct(values: list[float]) -> str:
    m = 100 * statistics.fmean(values)
    return f"{m:.2f}" + (f" ± {100 * statistics.stdev(values):.2f}" if len(values) > 1 else "")


def table(dirs: list[Path]) -> tuple[list[str], list[Path]]:
    """The table's lines, and the runs left out (no summary)."""
    runs, unfinished = [], []
    for d in dirs:
        summary, config = d / "summary.json", d / "config.yaml"
        if not config.is_file():
            raise FileNotFoundError(f"{config} not found: pass run directories written by `fedhetero train --out`")
        if not summary.is_file():
            unfinished.append(d)
            continue
        raw = yaml.safe_load(config.read_text())
        meta = d / "run.json"  # every method option with its default filled in (config.yaml: those given)
        options = json.loads(meta.read_text()).get("algorithm_options") if meta.is_file() else None
        if isinstance(options, dict):
            raw.setdefault("algorithm", {})["options"] = options
        cfg = _flat(raw)
        runs.append((d, cfg, json.loads(summary.read_text())))
    groups: dict[tuple[tuple[str, Any], ...], list[tuple[Path, dict[str, Any], dict[str, Any]]]] = {}
    for d, cfg, s in runs:
        key = tuple(sorted((k, v) for k, v in cfg.items() if not _ignored(k)))
        groups.setdefault(key, []).append((d, cfg, s))
    keys = sorted({k for key in groups for k, _ in key})
    # a method's options name a row only among the rows of that method
    differing = [k for k in keys if not k.startswith("algorithm.options.")
                 and len({dict(key).get(k) for key in groups}) > 1]
    by_method: dict[Any, list[dict[str, Any]]] = {}
    for key in groups:
        by_method.setdefault(dict(key).get("algorithm.name"), []).append(dict(key))
    options = {m: [k for k in keys if k.startswith("algorithm.options.") and len({c.get(k) for c in cs}) > 1]
               for m, cs in by_method.items()}
    lines = ["| run | seeds | test % (last round) | mean of the last 5 evaluations | best test % | val % | per seed (test / val) |",
             "|---|---|---:|---:|---:|---:|---|"]
    for key, members in sorted(groups.items(), key=lambda kv: [str(dict(kv[0]).get(k)) for k in keys]):
        members.sort(key=lambda m: m[1].get("seed", 0))
        c = dict(key)
        shown = differing + options.get(c.get("algorithm.name"), [])
        name = ", ".join(f"{k}={c.get(k)}" for k in shown) or "all runs"
        col = {f: [float(m[2][f]) for m in members if m[2].get(f) is not None]
               for f in ("final_accuracy", "mean_last5_accuracy", "best_accuracy", "final_val_accuracy")}
        per = ", ".join(
            f"{100 * m[2]['final_accuracy']:.2f} / "
            + (f"{100 * m[2]['final_val_accuracy']:.2f}" if m[2].get("final_val_accuracy") is not None else "–")
            for m in members)
        cells = [_pct(v) if v else "–" for v in col.values()]
        lines.append(f"| {name} | {', '.join(str(m[1].get('seed')) for m in members)} | " + " | ".join(cells) + f" | {per} |")
    return lines, unfinished


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python examples/seed_table.py",
        description="Mean ± std over seeds of finished `fedhetero train` runs (one row per config but the seed).",
    )
    parser.add_argument("dirs", nargs="+", metavar="DIR", help="a `fedhetero train --out` run directory")
    args = parser.parse_args(argv)
    try:
        lines, unfinished = table([Path(d) for d in args.dirs])
    except FileNotFoundError as e:
        print(f"seed_table: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    for d in unfinished:
        print(f"not finished (no summary.json): {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
