"""Markdown tables of the DynaComm Table 3 grid (docs/results.md, "DynaComm Table 3 on
Fashion-MNIST (scaled down)") from its run directories.

    python examples/dynacomm_table3.py runs/t3

Expects, under the given directory, the run directories the commands in docs/results.md write:
``sgd-s<seed>`` (DynamicSGD), ``<x>-g-<fix|dynamic>-<beta>-s<seed>`` for x in a, b, c and beta in
0.3, 0.6, 0.9, and ``baselines/<algorithm>/seed<seed>`` (``fedhetero compare --out …/baselines``).
Accuracy is the best test accuracy over the rounds (``best_accuracy`` in summary.json), mean ± std
(population) over the seeds found; κ is ``kappa_code`` from summary.json. A baseline's κ is its bytes
relative to FedAvg's (one model exchange per client and round) divided by L. The paper's columns are
the CNN, K = 2 rows of its Tables 12 (CIFAR-10) and 16 (CIFAR-100): mean (standard error) over two
seeds after 800 rounds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import yaml

INTERVALS = ("a", "b", "c")
BETAS = ("0.3", "0.6", "0.9")
BASELINES = (
    ("fedprox", "FedProx"),
    ("fedensemble", "FedEnsemble"),
    ("scaffold", "SCAFFOLD"),
    ("fedgen", "FedGen"),
    ("feddyn", "FedDyn"),
    ("fednova", "FedNova"),
    ("fedavg", "FedAvg"),
)

# The paper's CNN, K = 2 numbers: accuracy Fix, accuracy Dynamic, κ Fix, κ Dynamic (a baseline or
# DynamicSGD has one accuracy and one κ for both columns).
PAPER_C10 = {
    "sgd": ("77.2 (0.3)", None, "0.996", None),
    ("a", "0.3"): ("70.1 (0.2)", "70.9 (0.0)", "0.264", "0.302"),
    ("a", "0.6"): ("72.7 (0.2)", "75.4 (0.4)", "0.438", "0.512"),
    ("a", "0.9"): ("74.6 (0.1)", "75.7 (0.0)", "0.539", "0.567"),
    ("b", "0.3"): ("66.9 (1.1)", "67.4 (0.0)", "0.070", "0.078"),
    ("b", "0.6"): ("68.8 (0.1)", "68.4 (0.6)", "0.112", "0.131"),
    ("b", "0.9"): ("68.3 (0.1)", "68.6 (1.0)", "0.137", "0.144"),
    ("c", "0.3"): ("66.9 (1.6)", "66.2 (0.8)", "0.018", "0.022"),
    ("c", "0.6"): ("66.7 (0.3)", "68.2 (1.1)", "0.030", "0.035"),
    ("c", "0.9"): ("66.3 (1.1)", "68.2 (0.7)", "0.036", "0.038"),
    "fedprox": ("65.4 (0.2)", None, "0.004", None),
    "fedensemble": ("66.0 (0.9)", None, "0.004", None),
    "scaffold": ("66.2 (0.0)", None, "0.008", None),
    "fedgen": ("64.3 (0.1)", None, "0.009", None),
    "feddyn": ("63.6 (0.3)", None, "0.004", None),
    "fednova": ("66.5 (0.6)", None, "0.004", None),
    "fedavg": ("66.3 (0.0)", None, "0.004", None),
}
PAPER_C100 = {
    "sgd": ("27.0 (0.5)", None, "0.996", None),
    ("a", "0.3"): ("25.5 (0.0)", "24.9 (0.1)", "0.308", "0.302"),
    ("a", "0.6"): ("27.5 (1.2)", "25.4 (0.3)", "0.594", "0.599"),
    ("a", "0.9"): ("28.9 (0.2)", "29.4 (0.1)", "0.905", "0.897"),
    ("b", "0.3"): ("21.8 (0.2)", "21.7 (0.2)", "0.083", "0.078"),
    ("b", "0.6"): ("20.8 (0.2)", "17.2 (0.1)", "0.150", "0.153"),
    ("b", "0.9"): ("16.5 (1.1)", "14.0 (0.1)", "0.226", "0.227"),
    ("c", "0.3"): ("20.6 (0.2)", "19.7 (0.1)", "0.022", "0.022"),
    ("c", "0.6"): ("21.3 (0.1)", "17.5 (0.1)", "0.041", "0.040"),
    ("c", "0.9"): ("15.9 (0.3)", "14.3 (0.2)", "0.058", "0.058"),
    "fedprox": ("18.1 (0.3)", None, "0.004", None),
    "fedensemble": ("18.0 (0.3)", None, "0.004", None),
    "scaffold": ("23.8 (0.1)", None, "0.008", None),
    "fedgen": ("17.3 (0.3)", None, "0.011", None),
    "feddyn": ("16.4 (0.0)", None, "0.004", None),
    "fednova": ("17.7 (0.6)", None, "0.004", None),
    "fedavg": ("18.4 (0.6)", None, "0.004", None),
}


def _summaries(dirs: list[Path]) -> list[dict]:
    return [json.loads((d / "summary.json").read_text()) for d in dirs if (d / "summary.json").is_file()]


def _acc(values: list[float]) -> str:
    if not values:
        return "—"
    return f"{100 * np.mean(values):.1f} ± {100 * np.std(values):.1f}"


def _num(values: list[float], digits: int = 3) -> str:
    return f"{np.mean(values):.{digits}f}" if values else "—"


def _paper(table: dict, key, dynamic_too: bool) -> list[str]:
    fix, dyn, k_fix, k_dyn = table[key]
    if not dynamic_too:
        return [fix, "″", k_fix]
    return [fix, dyn, f"{k_fix} / {k_dyn}"]


def _local_steps(run: Path) -> int:
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    return int(cfg["train"]["local_steps"])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python examples/dynacomm_table3.py",
        description="Markdown tables of the DynaComm Table 3 grid from its run directories.",
    )
    parser.add_argument("root", metavar="DIR", help="the folder holding sgd-s*, <x>-g-<mode>-<beta>-s* and baselines/")
    root = Path(parser.parse_args(argv).root)
    sgd = sorted(root.glob("sgd-s*"))
    if not _summaries(sgd):
        print(f"dynacomm_table3: no finished sgd-s<seed> run under {root}", file=sys.stderr)
        return 2
    seeds = [d.name.rsplit("-s", 1)[1] for d in sgd]

    def cell(name: str) -> list[dict]:
        return _summaries([root / f"{name}-s{s}" for s in seeds])

    L = _local_steps(sgd[0])
    best, final, size = [], [], []
    header = (
        "| Method | Interval | β | Fix | Dynamic | κ Fix / Dynamic | paper CIFAR-10 Fix | paper CIFAR-10 Dynamic "
        "| paper CIFAR-10 κ | paper CIFAR-100 Fix | paper CIFAR-100 Dynamic | paper CIFAR-100 κ |"
    )
    best.append(header)
    best.append("|---|---|---|" + "---:|" * 9)
    s = cell("sgd")
    best.append(
        f"| DynamicSGD | – | – | {_acc([x['best_accuracy'] for x in s])} | ″ | {_num([x['kappa_code'] for x in s])} | "
        + " | ".join(_paper(PAPER_C10, "sgd", False) + _paper(PAPER_C100, "sgd", False)) + " |"
    )
    final.append("| Method | Interval | β | Fix | Dynamic |")
    final.append("|---|---|---|---:|---:|")
    final.append(f"| DynamicSGD | – | – | {_acc([x['final_accuracy'] for x in s])} | ″ |")
    size.append("| Interval | β | Fix mean \\|z\\| | Dynamic mean \\|z\\| |")
    size.append("|---|---|---:|---:|")
    for x in INTERVALS:
        for b in BETAS:
            fix, dyn = cell(f"{x}-g-fix-{b}"), cell(f"{x}-g-dynamic-{b}")
            kappa = f"{_num([r['kappa_code'] for r in fix])} / {_num([r['kappa_code'] for r in dyn])}"
            best.append(
                f"| DynamicAvg | {x}-g | {b} | {_acc([r['best_accuracy'] for r in fix])} | "
                f"{_acc([r['best_accuracy'] for r in dyn])} | {kappa} | "
                + " | ".join(_paper(PAPER_C10, (x, b), True) + _paper(PAPER_C100, (x, b), True)) + " |"
            )
            final.append(
                f"| DynamicAvg | {x}-g | {b} | {_acc([r['final_accuracy'] for r in fix])} | "
                f"{_acc([r['final_accuracy'] for r in dyn])} |"
            )
            size.append(
                f"| {x}-g | {b} | {_num([r['mean_high_group_size'] for r in fix], 2)} | "
                f"{_num([r['mean_high_group_size'] for r in dyn], 2)} |"
            )
    base = root / "baselines"
    fedavg_bytes = [x["bytes_total"] for x in _summaries([base / "fedavg" / f"seed{s}" for s in seeds])]
    for algo, label in BASELINES:
        runs = _summaries([base / algo / f"seed{s}" for s in seeds])
        ok = [r for r in runs if r.get("best_accuracy") is not None]
        failed = len(runs) - len(ok)  # a run that diverged leaves a summary without accuracies
        kappa = "—"
        if ok and fedavg_bytes:
            kappa = _num([r["bytes_total"] / float(np.mean(fedavg_bytes)) / L for r in ok])
        acc = _acc([r["best_accuracy"] for r in ok]) + (f" ({failed} failed)" if failed else "")
        best.append(
            f"| {label} | – | – | {acc} | ″ | {kappa} | "
            + " | ".join(_paper(PAPER_C10, algo, False) + _paper(PAPER_C100, algo, False)) + " |"
        )
        final.append(f"| {label} | – | – | {_acc([r['final_accuracy'] for r in ok])} | ″ |")
    paired = ["| Interval | mode | β = 0.3 | β = 0.6 | β = 0.9 |", "|---|---|---:|---:|---:|"]
    ref = {s: _summaries([base / "fedavg" / f"seed{s}"]) for s in seeds}
    for x in INTERVALS:
        for mode, label in (("fix", "Fix"), ("dynamic", "Dynamic")):
            cells = []
            for b in BETAS:
                diffs = []
                for s in seeds:
                    run = _summaries([root / f"{x}-g-{mode}-{b}-s{s}"])
                    if run and ref[s]:
                        diffs.append(f"{100 * (run[0]['best_accuracy'] - ref[s][0]['best_accuracy']):+.1f}")
                cells.append(" / ".join(diffs) if diffs else "—")
            paired.append(f"| {x}-g | {label} | " + " | ".join(cells) + " |")
    print(f"Best test accuracy over the rounds in %, mean ± std over seeds {', '.join(seeds)} (L = {L}):\n")
    print("\n".join(best))
    print("\nFinal-round accuracy in %, mean ± std over the same seeds:\n")
    print("\n".join(final))
    print("\nMean size of the high-frequency group per round (of 10 active clients), mean over seeds:\n")
    print("\n".join(size))
    print(f"\nDynamicAvg minus FedAvg, best accuracy in points, per seed ({' / '.join('seed ' + s for s in seeds)}):\n")
    print("\n".join(paired))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
