"""``fedhetero bench reparam`` is not silent: it says up front roughly how long it takes and what
"upstream" is, reports each step (and each timed training repeat) on stderr while it runs, and
explains "upstream" under its table. Run here on a tiny model with the smallest settings."""

from __future__ import annotations

import re

import pytest
from torch import nn

from fedhetero.cli import bench as bench_cli
from fedhetero.cli import build_parser, main

bench = pytest.importorskip("fedhetero.lab.bench_reparam")

SMALLEST = ["--batch", "2", "--input-size", "8", "--repeats", "1", "--train-repeats", "2", "--merge-repeats", "1",
            "--warmup", "0", "--threads", "1", "--no-tune-malloc"]


def _net() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    )


def test_run_benchmark_reports_every_step():
    lines: list[str] = []
    bench.run_benchmark(batch=2, repeats=1, warmup=0, merge_repeats=1, train_repeats=2, model=_net(), input_size=8,
                        threads=None, tune_allocator=False, progress=lines.append)
    steps = [line for line in lines if line.startswith("[")]
    assert [s[:5] for s in steps] == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"]
    assert "building" in steps[0] and "merge" in steps[1] and "upstream's" in steps[1]
    assert "inference" in steps[2] and "training steps" in steps[3]
    assert re.search(r"estimate for the training steps: ~\d+ (s|min)", steps[3])
    assert [line.strip() for line in lines if not line.startswith("[")] == [
        "merge: repeat 1/1 timed", "inference: repeat 1/1 timed",
        "training, allocator as found: repeat 1/2 timed", "training, allocator as found: repeat 2/2 timed"]
    assert lines.index(steps[2]) < lines.index("      inference: repeat 1/1 timed") < lines.index(steps[3])


def test_with_the_allocator_tuned_there_is_one_more_step():
    lines: list[str] = []
    res = bench.run_benchmark(batch=2, repeats=1, warmup=0, merge_repeats=1, train_repeats=1, model=_net(),
                              input_size=8, threads=None, progress=lines.append)
    steps = [line for line in lines if line.startswith("[")]
    assert [s[:5] for s in steps] == ["[1/5]", "[2/5]", "[3/5]", "[4/5]", "[5/5]"]
    assert ("after tuning the C allocator" in steps[4]) == res["malloc_tuned"]


def test_command_prints_duration_upstream_and_progress(monkeypatch, capsys):
    monkeypatch.setattr(bench, "_build_model", lambda name, num_classes=10: (_net(), f"tiny stand-in for {name}"))
    assert main(["bench", "reparam", *SMALLEST]) == 0
    out, err = capsys.readouterr()
    head = err.splitlines()
    assert head[0].startswith("fedhetero bench reparam: resnet18, batch 2, 8×8 input; with the default settings this "
                              f"takes roughly {bench.DEFAULT_DURATION}")
    assert head[1] == bench.UPSTREAM and "DiverseBranchBlock" in head[1] and "re-implemented" in head[1]
    progress = [line for line in head[2:] if re.match(r"\s*\d+\.\d s  ", line)]
    assert [line.split("s  ", 1)[1][:5] for line in progress if "s  [" in line] == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"]
    assert progress[-1].endswith("s  done")
    assert "whole-model merge, in place (ms)" in out and "tiny stand-in for resnet18" in out
    assert " ".join(out.split()).find("upstream: the public reference implementation of the Diverse Branch Block") > 0


def test_the_estimate_names_the_default_settings(capsys):
    args = build_parser().parse_args(["bench", "reparam"])
    assert {k: getattr(args, k) for k in bench_cli._REPARAM_DEFAULTS} == bench_cli._REPARAM_DEFAULTS
    assert bench.duration_note(defaults=True).startswith(f"this takes roughly {bench.DEFAULT_DURATION}")
    assert "with the default settings" in bench.duration_note(defaults=False)
    with pytest.raises(SystemExit):
        main(["bench", "reparam", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "upstream: the public reference implementation of the Diverse Branch Block" in help_text
    assert "2-5 minutes" in help_text and "progress goes to stderr" in help_text
