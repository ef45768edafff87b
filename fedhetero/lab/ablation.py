"""``fedhetero dynamicfl-ablation``: DynamicFL against FedAvg and the width baselines, and each of
DynamicFL's design choices, on a data set you have (by default Fashion-MNIST with LeNet-5,
``examples/configs/fmnist_dynamicfl.yaml``).

Three groups of runs, each over the same seeds (every method of a seed sees the same partition,
tiers, sampled clients and budgets):

* **methods**: FedAvg, DynamicFL, HeteroFL, FedRolex, SplitMix at every Dirichlet β, tiers as in
  the config (1 : 2 : 3 by default; the width methods' full model is the largest tier's budget);
* **choices**: DynamicFL variants (:data:`CHOICES`: anchor BN set-up, BN statistics kept or reset,
  saliency on/off, branch set, nested growth, budget fill, REP's scale, the block step…) at each β
  of ``--choice-betas``, judged on the validation hold-out (``data.val_fraction``), never on the
  test set. Each variant is stated in full, not relative to the shipped default, so a table keeps
  its meaning when a default changes; the methods table's DynamicFL is the variant
  ``--dynamicfl-choice`` names (the shipped one by default);
* **fedap**: FedAvg and FedAP (one-shot adaptive pruning) on the BN-free FedDUMAP CNN: the FLOPs
  cut and the accuracy it costs.

Writes ``table_methods.md``, ``table_tiers.md`` (accuracy of the model each tier deploys),
``table_choices.md``, ``table_fedap.md`` and ``results.json`` in
``--out`` and prints them. Finished runs are reused: an interrupted grid continues where it stopped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from fedhetero.core.common.configfile import load_config
from fedhetero.core.common.console import make_console
from fedhetero.core.common.rundir import finite_json
from fedhetero.lab.grid import run_grid

__all__ = ["CHOICES", "METHODS", "build_tables", "plan", "run_ablation"]

METHODS = ("fedavg", "dynamicfl", "heterofl", "fedrolex", "splitmix")

#: The form DynamicFL had before its default changed (REP puts the global kernel's scale into the
#: anchor BN's γ; a block steps by the sum of its branches' steps). Every variant below that was
#: measured against that form states it, so that the tables made with it still regenerate.
FIRST_FORM = ["algorithm.options.rep_scale=gamma", "algorithm.options.block_step=sum"]

#: DynamicFL variants: name -> (what changes, overrides), each stated in full (not relative to the
#: shipped default, which may change). "default" is the shipped configuration.
CHOICES: dict[str, tuple[str, list[str]]] = {
    "default": ("as shipped (block step mean, REP calibrated)", []),
    "sum-gamma": ("the first-built form: REP gamma, a block steps by the sum of its branches' steps "
                  "(the default before it changed)", FIRST_FORM),
    "bn-reset": ("sum-gamma with the anchor BN statistics reset every round (not kept in the client's private state)",
                 ["algorithm.options.bn_stats=reset", *FIRST_FORM]),
    "anchor-calibrated": ("sum-gamma with the anchor BN calibrated on client batches",
                          ["algorithm.options.anchor_norm=calibrated", *FIRST_FORM]),
    "anchor-frozen": ("sum-gamma with the anchor BN a frozen identity",
                      ["algorithm.options.anchor_norm=frozen_identity", *FIRST_FORM]),
    "saliency-random": ("sum-gamma with saliency off: branches folded / grown at random",
                        ["algorithm.options.saliency=random", *FIRST_FORM]),
    "branches-1x1_kxk": ("sum-gamma with the branch set 1x1_kxk only", ["algorithm.options.branches=[1x1_kxk]", *FIRST_FORM]),
    "grow-block": ("sum-gamma without nested growth (branches of the host convs only)",
                   ["algorithm.options.grow_mode=block", *FIRST_FORM]),
    "no-fill": ("sum-gamma without budget fill", ["algorithm.options.fill_budget=false", *FIRST_FORM]),
    "tiers-1x": ("every tier at 1× (the control: what re-parameterisation adds over FedAvg), as shipped",
                 ["budget.tiers=[{name: small, ratio: 1.0, share: 1.0}]"]),
    "global-bn": ("the global model keeps its BatchNorm (host form; at 1× this is FedAvg), block step sum",
                  ["algorithm.options.global_form=host", "algorithm.options.block_step=sum"]),
    "rep-weights": ("REP puts the global kernel's scale into the anchor conv weights (γ kept; the old REP), block step sum",
                    ["algorithm.options.rep_scale=weights", "algorithm.options.block_step=sum"]),
    "rep-calibrated": ("after REP the anchor BN statistics are measured on the client's own batches, block step sum",
                       ["algorithm.options.rep_scale=calibrated", "algorithm.options.block_step=sum"]),
    "branches-reset": ("sum-gamma with a returning client's stored branches restarting from a zero output (structure kept)",
                       ["algorithm.options.stored_branches=reset", *FIRST_FORM]),
    "block-mean": ("a block's SGD step moves its merged kernel by the mean of its branches' steps, REP gamma",
                   ["algorithm.options.block_step=mean", "algorithm.options.rep_scale=gamma"]),
    "block-mean-calibrated": ("block-mean and rep-calibrated together (the shipped form)",
                              ["algorithm.options.block_step=mean", "algorithm.options.rep_scale=calibrated"]),
}

FEDAP = ["model.name=cnn", "model.norm=none", "budget.tiers=[{name: all, ratio: 1.0, share: 1.0}]"]


def _fmt(x: float) -> str:
    return f"{x:g}"


def _dynamicfl_dir(choice: str) -> str:
    """The methods table's DynamicFL folder: ``dynamicfl`` as shipped, ``dynamicfl-<choice>`` otherwise."""
    return "dynamicfl" if choice == "default" else f"dynamicfl-{choice}"


def plan(betas: list[float], seeds: list[int], choice_betas: list[float], choices: list[str],
         fedap: bool, dynamicfl_choice: str = "default") -> dict[str, tuple[str, dict[str, Any], list[str]]]:
    """Run name -> (group, facts, overrides). The choices run at every β of ``choice_betas``;
    FedAP at the first. The methods table's DynamicFL is the variant ``dynamicfl_choice`` (the
    shipped one by default), and that choice's runs are the same runs."""
    runs: dict[str, tuple[str, dict[str, Any], list[str]]] = {}
    for b in betas:
        for m in METHODS:
            for s in seeds:
                folder = _dynamicfl_dir(dynamicfl_choice) if m == "dynamicfl" else m
                extra = CHOICES[dynamicfl_choice][1] if m == "dynamicfl" else []
                name = f"methods/beta{_fmt(b)}/{folder}/s{s}"
                facts: dict[str, Any] = {"beta": b, "method": m, "seed": s}
                if m == "dynamicfl":
                    facts["form"] = dynamicfl_choice
                runs[name] = ("methods", facts, [f"algorithm.name={m}", f"data.alpha={b}", f"seed={s}", *extra])
    for cb in choice_betas:
        for c in choices:
            for s in seeds:
                name = f"choices/beta{_fmt(cb)}/{c}/s{s}"
                if c == dynamicfl_choice and cb in betas:
                    name = f"methods/beta{_fmt(cb)}/{_dynamicfl_dir(c)}/s{s}"  # the same run
                if name in runs:  # shared with the methods table
                    runs[name][1].update(choice=c)
                    continue
                runs[name] = ("choices", {"beta": cb, "choice": c, "seed": s},
                              ["algorithm.name=dynamicfl", f"data.alpha={cb}", f"seed={s}", *CHOICES[c][1]])
    if fedap and choice_betas:
        fb = choice_betas[0]
        for m in ("fedavg", "fedap"):
            for s in seeds:
                name = f"fedap/beta{_fmt(fb)}/{m}/s{s}"
                extra = ["algorithm.options.prune_round=10"] if m == "fedap" else []
                runs[name] = ("fedap", {"beta": fb, "method": m, "seed": s},
                              [f"algorithm.name={m}", f"data.alpha={fb}", f"seed={s}", *FEDAP, *extra])
    return runs


def _summary(path: Path) -> dict[str, Any] | None:
    f = path / "summary.json"
    return json.loads(f.read_text()) if f.is_file() else None


def _ms(vals: list[float]) -> str:
    if not vals:
        return "–"
    return f"{np.mean(vals):.2f} ± {np.std(vals):.2f}"


def _tier_use(s: dict[str, Any]) -> dict[str, float]:
    """Trained MACs / budget per tier (mean over the tier's client rounds)."""
    out = {}
    for name, t in s.get("tiers", {}).items():
        if t.get("macs") and t.get("budget_macs"):
            out[name] = float(t["macs"]) / float(t["budget_macs"])
    return out


def _use_cell(uses: list[dict[str, float]]) -> str:
    """Mean budget use per tier, tiers in config order (as summary.json lists them)."""
    tiers = list(dict.fromkeys(t for u in uses for t in u))
    return " / ".join(f"{np.mean([u[t] for u in uses if t in u]):.2f}" for t in tiers)


def _accuracies(ss: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """Final test and validation accuracies (%) of some runs' summaries."""
    return ([100 * s["final_accuracy"] for s in ss],
            [100 * s["final_val_accuracy"] for s in ss if s.get("final_val_accuracy") is not None])


def _label(runs: dict[str, tuple[str, dict[str, Any], list[str]]]) -> str:
    """The methods table's DynamicFL row: ``dynamicfl``, with its variant when that is not the shipped one."""
    forms = {f.get("form", "default") for g, f, _ in runs.values() if g == "methods" and f.get("method") == "dynamicfl"}
    form = forms.pop() if len(forms) == 1 else "default"
    return "dynamicfl" if form == "default" else f"dynamicfl ({form})"


def build_tables(out: Path, runs: dict[str, tuple[str, dict[str, Any], list[str]]]) -> dict[str, Any]:
    """Read the finished runs; write and return the three tables and the numbers."""
    got: dict[str, dict[str, Any]] = {}
    for name in runs:
        found = _summary(out / name)
        if found is not None:
            got[name] = found
    numbers: dict[str, Any] = {"methods": {}, "choices": {}, "fedap": {}, "missing_runs": sorted(n for n in runs if n not in got)}

    def select(**facts: Any) -> list[str]:
        """Names of the finished runs whose group and facts match."""
        return [n for n, (g, f, _) in runs.items() if n in got and all((g if k == "group" else f.get(k)) == v for k, v in facts.items())]
    # ---- methods
    betas = sorted({f["beta"] for g, f, _ in runs.values() if g == "methods"})
    lines = ["| method | " + " | ".join(f"β = {_fmt(b)} test %" for b in betas) + " | "
             + " | ".join(f"β = {_fmt(b)} val %" for b in betas) + " | tier use (small / medium / large) |",
             "|---|" + "---:|" * (2 * len(betas)) + "---|"]
    for m in METHODS:
        test_cells: list[str] = []
        val_cells: list[str] = []
        uses: list[dict[str, float]] = []
        for b in betas:
            ss = [got[n] for n in select(group="methods", method=m, beta=b)]
            test, val = _accuracies(ss)
            test_cells.append(_ms(test))
            val_cells.append(_ms(val))
            uses.extend(_tier_use(s) for s in ss)
            numbers["methods"].setdefault(m, {})[_fmt(b)] = {
                "test": test, "val": val,
                "mean_macs": {t: float(np.mean([s["tiers"][t]["macs"] for s in ss if s["tiers"][t].get("macs")]))
                              for t in (ss[0]["tiers"] if ss else {})},
            }
        if not any(t != "–" for t in test_cells):
            continue
        use = _use_cell(uses)
        label = m if m != "dynamicfl" else _label(runs)
        lines.append(f"| {label} | " + " | ".join(test_cells) + " | " + " | ".join(val_cells) + f" | {use} |")
    t_methods = "\n".join(lines)
    # ---- accuracy of the model each tier deploys (width methods: a narrower sub-model below the top tier)
    lines = ["| method | " + " | ".join(f"β = {_fmt(b)}: test % per tier" for b in betas) + " |",
             "|---|" + "---|" * len(betas)]
    for m in METHODS:
        cells = []
        for b in betas:
            ss = [got[n] for n in select(group="methods", method=m, beta=b)]
            names = list(ss[0]["tiers"]) if ss else []
            per = {t: [100 * s["tiers"][t]["accuracy"] for s in ss if s["tiers"][t].get("accuracy") is not None] for t in names}
            cells.append(" / ".join(f"{np.mean(v):.2f}" for v in per.values() if v) or "–")
            numbers["methods"].setdefault(m, {}).setdefault(_fmt(b), {})["tier_test"] = per
        if any(c != "–" for c in cells):
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
    t_tiers = "\n".join(lines)
    # ---- choices (one column pair per β)
    cbetas = sorted({f["beta"] for _, f, _ in runs.values() if "choice" in f})
    lines = ["| DynamicFL variant | change | " + " | ".join(f"β = {_fmt(b)} val % | β = {_fmt(b)} test %" for b in cbetas)
             + " | tier use (small / medium / large) |",
             "|---|---|" + "---:|---:|" * len(cbetas) + "---|"]
    for c, (what, _) in CHOICES.items():
        cells = []
        uses = []
        for b in cbetas:
            ss = [got[n] for n in select(choice=c, beta=b)]
            test, val = _accuracies(ss)
            cells += [_ms(val), _ms(test)]
            uses += [_tier_use(s) for s in ss]
            if ss:
                numbers["choices"].setdefault(c, {})[_fmt(b)] = {"val": val, "test": test}
        if not uses:
            continue
        lines.append(f"| {c} | {what} | " + " | ".join(cells) + f" | {_use_cell(uses)} |")
    t_choices = "\n".join(lines)
    # ---- fedap
    lines = ["| method | test % | val % | client MMACs per sample | MACs vs FedAvg |", "|---|---:|---:|---:|---:|"]
    base_macs = None
    for m in ("fedavg", "fedap"):
        names = select(group="fedap", method=m)
        if not names:
            continue
        # the pruned model's MACs: the last round's clients (after the cut)
        last = []
        for n in names:
            rows = [json.loads(x) for x in (out / n / "metrics.jsonl").read_text().splitlines() if x.strip()]
            last.append(float(np.mean([c["macs"] for c in rows[-1]["clients"]])))
        macs = float(np.mean(last))
        base_macs = macs if m == "fedavg" else base_macs
        rel = f"{100 * (macs / base_macs - 1):+.1f} %" if base_macs else "–"
        test, val = _accuracies([got[n] for n in names])
        lines.append(f"| {m} | {_ms(test)} | {_ms(val)} | {macs / 1e6:.3f} | {rel} |")
        numbers["fedap"][m] = {"test": test, "val": val, "final_macs": macs}
    t_fedap = "\n".join(lines)
    for name, text in (("table_methods.md", t_methods), ("table_tiers.md", t_tiers), ("table_choices.md", t_choices),
                       ("table_fedap.md", t_fedap)):
        (out / name).write_text(text + "\n")
    (out / "results.json").write_text(json.dumps(finite_json(numbers), indent=2))
    return {"methods": t_methods, "tiers": t_tiers, "choices": t_choices, "fedap": t_fedap, "numbers": numbers}


def run_ablation(*, config: str, overrides: list[str], out: str | Path, betas: list[float], seeds: list[int],
                 choice_betas: list[float], choices: list[str], fedap: bool, jobs: int, run: bool,
                 dynamicfl_choice: str = "default") -> int:
    """``fedhetero dynamicfl-ablation``: run (with ``run``) the unfinished runs of :func:`plan` from the
    base ``config`` with ``overrides``, ``jobs`` at a time, into ``out``; write and print the tables;
    returns the exit status (1 when runs are missing, 2 for an unknown choice)."""
    console = make_console()
    load_config(config, overrides=overrides)  # one clear error for a bad base config
    bad = [c for c in [*choices, dynamicfl_choice] if c not in CHOICES]
    if bad:
        console.print(f"unknown choice(s) {', '.join(bad)}; choose from {', '.join(CHOICES)}", markup=False)
        return 2
    runs = plan(betas, seeds, choice_betas, choices, fedap, dynamicfl_choice)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    wall = 0.0
    if run:
        done = run_grid(config, {n: list(overrides) + ov for n, (_, _, ov) in runs.items()}, out, jobs,
                        report=lambda line: console.print(line, markup=False, highlight=False))
        wall = done["wall_s"]
    res = build_tables(out, runs)
    for key in ("methods", "tiers", "choices", "fedap"):
        console.print(res[key], markup=False, highlight=False, soft_wrap=True)
    console.print(f"runs took {wall / 60:.1f} min; tables in {out}", highlight=False)
    return 0 if not res["numbers"]["missing_runs"] else 1
