"""Turn `fedhetero compare` outputs (comparison.json) into the markdown tables of docs/results.md.

    python examples/results_table.py runs/table-beta0.1 runs/table-beta1 runs/table-beta5

One column per comparison directory (its Dirichlet beta), one row per algorithm: final accuracy
mean ± std over seeds; then a per-tier table (the fairness view) for each directory.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _pct(m, s=None) -> str:
    if m is None:
        return "N/A"
    return f"{100 * m:.2f}" + (f" ± {100 * s:.2f}" if s is not None else "")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python examples/results_table.py",
        description="Markdown tables from `fedhetero compare` output directories (one column per directory).",
    )
    parser.add_argument("dirs", nargs="+", metavar="DIR", help="a `fedhetero compare --out` directory (holds comparison.json)")
    dirs = parser.parse_args(argv).dirs
    runs = []
    for d in dirs:
        path = Path(d) / "comparison.json"
        if not path.is_file():
            print(f"results_table: {path} not found; pass directories written by `fedhetero compare --out`", file=sys.stderr)
            return 2
        data = json.loads(path.read_text())
        runs.append((data["config"]["data"]["alpha"], data))
    algos = [r["algorithm"] for r in runs[0][1]["rows"]]
    print("| method | " + " | ".join(f"β = {b:g}" for b, _ in runs) + " |")
    print("|---|" + "---:|" * len(runs))
    for a in algos:
        cells = []
        for _, data in runs:
            row = next(r for r in data["rows"] if r["algorithm"] == a)
            cells.append("N/A" if row["status"] != "ok" else _pct(row["final_accuracy_mean"], row["final_accuracy_std"]))
        print(f"| {a} | " + " | ".join(cells) + " |")
    for b, data in runs:
        tiers = [t["name"] for t in data["config"]["budget"]["tiers"]]
        print(f"\nPer-tier accuracy of the deployed model and trained MMACs (β = {b:g}, mean over seeds):\n")
        print("| method | " + " | ".join(f"{t} acc %" for t in tiers) + " | " + " | ".join(f"{t} MMACs" for t in tiers) + " |")
        print("|---|" + "---:|" * (2 * len(tiers)))
        for r in data["rows"]:
            if r["status"] != "ok":
                print(f"| {r['algorithm']} | " + " | ".join(["N/A"] * 2 * len(tiers)) + " |")
                continue
            accs = [_pct(r[f"acc_{t}_mean"]) for t in tiers]
            macs = ["—" if r[f"macs_{t}_mean"] is None else f"{r[f'macs_{t}_mean'] / 1e6:.3f}" for t in tiers]
            print(f"| {r['algorithm']} | " + " | ".join(accs + macs) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
