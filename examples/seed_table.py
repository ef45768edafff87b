"""Mean ± std over seeds of finished `fedhetero train` runs, as a markdown table.

    python examples/seed_table.py runs/dynamicfl-paper-v2/*

Runs whose resolved configs (`config.yaml`, with every method option as `run.json` records it) are
equal but for the seed form one row; a row is named
by the settings in which it differs from the other rows (the method, `data.alpha`, a method
option…). Columns: test accuracy of the last round, the mean of the last five evaluations, the
best evaluation and the validation accuracy of the last round (%), each as mean ± std over the
row's seeds (the sample standard deviation; a single seed has none), then every seed's test /
validation figures. Runs without a `summary.json` (not finished) are listed after the table.

    python examples/seed_table.py runs/dynamicfl-paper-v2/* --against algorithm.name=dynamicfl

adds a second table: the rows that match `--against` (KEY=VALUE, repeatable) minus each other row
with the same settings outside the method (the same `data.alpha`, …), seed by seed over the seeds
both ran, as mean ± std of the paired differences in points.
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
        if isinstance(v, dict):  # an empty mapping sets nothing (`options: {}` is no options)
            out.update(_flat(v, key + "."))
        else:
            out[key] = json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else v
    return out


def _shown(value: Any) -> Any:
    """A setting's value as a row name shows it: a tier list as `[small 1.0× (0.33), …]`."""
    if isinstance(value, str) and value.startswith("[{"):
        items = json.loads(value)
        if all(isinstance(t, dict) and "name" in t and "ratio" in t for t in items):
            return "[" + ", ".join(f"{t['name']} {t['ratio']}×" + (f" ({t['share']:.2g})" if "share" in t else "")
                                   for t in items) + "]"
    return value


def _ignored(key: str) -> bool:
    return any(key == i or key.startswith(i + ".") for i in IGNORED)


def _pct(values: list[float], signed: bool = False) -> str:
    """Fractions as percent (points, with a sign, for differences): mean ± sample std."""
    m = 100 * statistics.fmean(values)
    return f"{m:{'+' if signed else ''}.2f}" + (f" ± {100 * statistics.stdev(values):.2f}" if len(values) > 1 else "")


Run = tuple[Path, dict[str, Any], dict[str, Any]]
FIELDS = ("final_accuracy", "mean_last5_accuracy", "best_accuracy", "final_val_accuracy")


def table(dirs: list[Path], against: dict[str, str] | None = None) -> tuple[list[str], list[Path]]:
    """The table's lines (and the paired-difference table's, with `against`), and the runs left
    out (no summary)."""
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
    groups: dict[tuple[tuple[str, Any], ...], list[Run]] = {}
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
    names: dict[tuple[tuple[str, Any], ...], str] = {}
    lines = ["| run | seeds | test % (last round) | mean of the last 5 evaluations | best test % | val % | per seed (test / val) |",
             "|---|---|---:|---:|---:|---:|---|"]
    for key, members in sorted(groups.items(), key=lambda kv: [str(dict(kv[0]).get(k)) for k in keys]):
        members.sort(key=lambda m: m[1].get("seed", 0))
        c = dict(key)
        shown = differing + options.get(c.get("algorithm.name"), [])
        name = names[key] = ", ".join(f"{k}={_shown(c.get(k))}" for k in shown) or "all runs"
        col = {f: [float(m[2][f]) for m in members if m[2].get(f) is not None] for f in FIELDS}
        per = ", ".join(
            f"{100 * m[2]['final_accuracy']:.2f} / "
            + (f"{100 * m[2]['final_val_accuracy']:.2f}" if m[2].get("final_val_accuracy") is not None else "–")
            for m in members)
        cells = [_pct(v) if v else "–" for v in col.values()]
        lines.append(f"| {name} | {', '.join(str(m[1].get('seed')) for m in members)} | " + " | ".join(cells) + f" | {per} |")
    if against:
        context = [k for k in differing if k not in against and not k.startswith("algorithm.")]
        lines += ["", *_paired(groups, names, against, context)]
    return lines, unfinished


def _paired(groups: dict[tuple[tuple[str, Any], ...], list[Run]], names: dict[tuple[tuple[str, Any], ...], str],
            against: dict[str, str], context: list[str]) -> list[str]:
    """Each reference row (matching `against`) minus each other row with the same `context`
    settings, paired by seed."""
    settings = {key: dict(key) for key in groups}
    refs = [key for key in groups if all(str(settings[key].get(k)) == v for k, v in against.items())]
    if not refs:
        wanted = ", ".join(f"{k}={v}" for k, v in against.items())
        raise ValueError(f"no finished run has {wanted} (--against)")
    lines = ["| reference | minus | seeds | Δ test (points) | Δ mean of the last 5 | Δ best | Δ val |",
             "|---|---|---|---:|---:|---:|---:|"]
    for ref in sorted(refs, key=names.__getitem__):
        by_seed = {m[1].get("seed"): m[2] for m in groups[ref]}
        for key in sorted(groups, key=names.__getitem__):
            if key in refs or any(settings[key].get(k) != settings[ref].get(k) for k in context):
                continue
            pairs = [(m[1].get("seed"), by_seed[m[1].get("seed")], m[2]) for m in groups[key] if m[1].get("seed") in by_seed]
            if not pairs:
                continue
            diffs = {f: [a[f] - b[f] for _, a, b in pairs if a.get(f) is not None and b.get(f) is not None] for f in FIELDS}
            cells = [_pct(d, signed=True) if d else "–" for d in diffs.values()]
            seeds = ", ".join(str(seed) for seed, _, _ in pairs)
            lines.append(f"| {names[ref]} | {names[key]} | {seeds} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python examples/seed_table.py",
        description="Mean ± std over seeds of finished `fedhetero train` runs (one row per config but the seed).",
    )
    parser.add_argument("dirs", nargs="+", metavar="DIR", help="a `fedhetero train --out` run directory")
    parser.add_argument("--against", action="append", default=[], metavar="KEY=VALUE",
                        help="also tabulate the rows with this setting (e.g. algorithm.name=dynamicfl) minus "
                             "every other row of the same settings, paired by seed; repeatable")
    args = parser.parse_args(argv)
    against = {}
    for item in args.against:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--against takes KEY=VALUE, got {item!r}")
        against[key] = value
    try:
        lines, unfinished = table([Path(d) for d in args.dirs], against)
    except (FileNotFoundError, ValueError) as e:
        print(f"seed_table: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    for d in unfinished:
        print(f"not finished (no summary.json): {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
