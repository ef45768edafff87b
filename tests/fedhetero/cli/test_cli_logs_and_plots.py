"""What the commands print and draw when their output goes to a log: whole tables off a terminal
(``| tee``, ``nohup``, a pipe; ``COLUMNS`` still honoured), the run's plot (accuracy.png) named
after ``train``, the comparison's PNGs named in its closing line, and a final table that shows only
what means something for the run (a DynInit run: no per-tier accuracy beside a final accuracy
measured on another set)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

from fedhetero.cli import main
from fedhetero.core.common.console import LOG_WIDTH, make_console
from _util import SESSION_BASE

SMALL = [
    "data.dataset=synthetic", "data.synthetic_size=120", "data.num_clients=4", "data.min_partition_size=5",
    "model.width=0.25", "train.rounds=2", "train.local_epochs=1", "algorithm.name=fedavg", "threads=1",
]


def _sets(items: list[str]) -> list[str]:
    return [a for s in items for a in ("--set", s)]


def _log_env() -> dict[str, str]:
    """The environment of a job whose output goes to a file: no COLUMNS, nothing forcing a terminal."""
    env = dict(os.environ)
    for k in ("COLUMNS", "LINES", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "JUPYTER_COLUMNS"):
        env.pop(k, None)
    return env


def _run(args: list[str], tmp_path) -> str:
    r = subprocess.run([sys.executable, "-m", "fedhetero.cli", *args], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, env=_log_env(), cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr
    return r.stdout


# ---------------------------------------------------------------------------- the console
def test_console_off_a_terminal_is_wide_enough_and_columns_still_wins(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    assert make_console(file=io.StringIO()).width == LOG_WIDTH
    assert make_console(file=io.StringIO(), width=90).width == 90
    # a terminal keeps the terminal's width (rich's own: 80 when it cannot ask the terminal)
    assert make_console(file=io.StringIO(), force_terminal=True).width != LOG_WIDTH
    monkeypatch.setenv("COLUMNS", "123")
    assert make_console(file=io.StringIO()).width == 123


def test_wide_table_is_not_cut_in_a_log(monkeypatch):
    from rich.table import Table

    monkeypatch.delenv("COLUMNS", raising=False)
    buf = io.StringIO()
    table = Table()
    for i in range(14):
        table.add_column(f"a rather long column header {i}")
    table.add_row(*[f"value {i} of the only row" for i in range(14)])
    make_console(file=buf).print(table)
    text = buf.getvalue()
    assert "…" not in text
    assert all(f"a rather long column header {i}" in text for i in range(14))
    assert len(text.splitlines()) == 5  # top rule, header, rule, row, bottom rule: nothing wrapped


# ---------------------------------------------------------------------------- train and compare in a log
def test_train_output_in_a_pipe_holds_the_whole_table(tmp_path):
    out = _run(["train", *_sets(SMALL), "--out", str(tmp_path / "run")], tmp_path)
    assert "…" not in out
    header = ("tier", "ratio", "budget MMACs", "trained MMACs", "fits", "client-rounds", "sent up", "sent down")
    assert all(h in out for h in header), out
    assert "fedhetero train: fedavg on synthetic" in out and "round 2/2" in out
    # one line each: the closing line and the line naming the plot end the output
    last = out.strip().splitlines()
    assert last[-2].startswith("best accuracy") and last[-2].endswith(f"run directory {tmp_path / 'run'}")
    assert last[-1] == f"plot: {tmp_path / 'run' / 'accuracy.png'} (accuracy and loss by round)"
    assert (tmp_path / "run" / "accuracy.png").stat().st_size > 0


def test_compare_output_in_a_pipe_holds_the_whole_table_and_names_the_plots(tmp_path):
    out = _run(["compare", "--algorithms", "fedavg,heterofl", "--out", str(tmp_path / "cmp"), *_sets(SMALL)],
               tmp_path)
    assert "…" not in out
    header = ("algorithm", "final acc %", "small acc %", "medium acc %", "large acc %", "small MMACs",
              "large MMACs", "client MMACs", "bytes/run", "dropped", "errors", "wall s")
    assert all(h in out for h in header), out
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert any("│ fedavg " in r for r in rows) and any("│ heterofl " in r for r in rows)
    cmp = tmp_path / "cmp"
    written = [str(cmp / f) for f in ("comparison.csv", "comparison.json", "accuracy.png", "tiers.png")]
    assert out.strip().splitlines()[-1] == "written: " + ", ".join(written)
    assert all((cmp / f).stat().st_size > 0 for f in ("accuracy.png", "tiers.png"))


def test_compare_without_plots_names_only_its_tables(tmp_path, capsys):
    assert main(["compare", "--algorithms", "fedavg", "--out", str(tmp_path / "c"), "--quiet", "--no-plot",
                 *_sets(SMALL)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"written: {tmp_path / 'c' / 'comparison.csv'}, {tmp_path / 'c' / 'comparison.json'}"
    assert not (tmp_path / "c" / "accuracy.png").exists()


# ---------------------------------------------------------------------------- what the table shows
def _session_sets() -> list[str]:
    b = SESSION_BASE
    sets = [f"seed={b['seed']}", "threads=1", "model.name=logreg", "algorithm.name=dyninit",
            "algorithm.options.host=fedavg"]
    sets += [f"data.{k}={v}" for k, v in b["data"].items()]
    sets += ["train.rounds=6", "train.sample_rate=1.0", "train.batch_size=32", "train.lr=0.05",
             "train.weight_decay=0.0", "train.local_epochs=1"]
    return sets + ["sessions.count=3", "sessions.rounds=2", "sessions.transition_window=1"]


def test_dyninit_table_has_no_per_tier_accuracy_and_names_the_sets(tmp_path, capsys):
    run = tmp_path / "dyn"
    assert main(["train", *_sets(_session_sets()), "--out", str(run), "--quiet"]) == 0
    out = capsys.readouterr().out
    summary = json.loads((run / "summary.json").read_text())
    tiers = summary["tiers"]
    full = tiers["small"]["accuracy"]
    assert len({t["accuracy"] for t in tiers.values()}) == 1 and full != summary["final_accuracy"]
    title = next(line for line in out.splitlines() if "final accuracy" in line).strip()
    assert title == (f"dyninit: final accuracy {100 * summary['final_accuracy']:.2f} % on the session's test classes, "
                     f"{100 * full:.2f} % on the full test set")
    header = next(line for line in out.splitlines() if "trained MMACs" in line)
    assert "accuracy" not in header  # one model everywhere: no per-tier accuracy column
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert [r.split("│")[1].strip() for r in rows] == list(tiers)  # the budgets differ: one row each
    assert f"{100 * full:.2f}" not in "".join(rows)
    assert "every tier deploys the same model (its accuracy is in the title): no per-tier column" in out
    assert "mean of last 5" in out and "(on the session's test classes)" in out


def test_tiers_that_differ_in_nothing_share_one_row(tmp_path, capsys):
    same = 'budget.tiers=[{name: a, ratio: 1, share: 0.5}, {name: b, ratio: 1, share: 0.5}]'
    assert main(["train", *_sets(SMALL + [same, "train.sample_rate=1.0"]), "--out", str(tmp_path / "r"), "--quiet"]) == 0
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert len(rows) == 1 and rows[0].split("│")[1].strip() == "a, b"
    assert all(t["client_rounds"] for t in summary["tiers"].values())
    total = sum(t["client_rounds"] for t in summary["tiers"].values())
    assert rows[0].split("│")[6].strip() == str(total)
    title = next(line for line in out.splitlines() if "final accuracy" in line).strip()
    assert title == f"fedavg: final accuracy {100 * summary['final_accuracy']:.2f} %"  # the test set: no label

