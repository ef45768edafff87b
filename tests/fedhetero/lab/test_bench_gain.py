"""``fedhetero bench reparam-gain``: the paired plain / expanded-and-merged comparison."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import reparam
from fedhetero.cli import main
from fedhetero.cli import bench as bench_cli
from fedhetero.lab import bench_gain


def test_the_cli_names_the_librarys_inits():
    assert tuple(bench_cli.GAIN_INITS) == reparam.block.INITS
    assert reparam.SCRATCH_INIT in reparam.block.INITS


def test_reparam_gain_writes_every_field_of_the_grid(tmp_path, capsys):
    out = tmp_path / "gain.json"
    rc = main(["bench", "reparam-gain", "--models", "lenet5", "--widths", "0.125,0.25", "--seeds", "2",
               "--epochs", "1", "--inits", "random,zero_gamma", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["dataset"] == "digits" and res["seeds"] == [0, 1] and res["default_init"] == "random"
    assert "partial" not in res
    widths = res["models"]["lenet5"]["widths"]
    assert set(widths) == {"0.125", "0.25"}
    for e in widths.values():
        for key in ("plain", "expanded", "gain", "gain_std", "seeds", "width_gain", "macs_plain", "macs_expanded"):
            assert key in e, key
        assert e["gain"] == pytest.approx(e["expanded"] - e["plain"])
        assert e["gain"] == pytest.approx(sum(e["gains"]) / 2)
        assert e["macs_expanded"] > 2 * e["macs_plain"]  # the default kinds more than double the MACs
        assert 0 <= e["plain"] <= 100 and 0 <= e["expanded"] <= 100
        assert set(e["inits"]) == {"random", "zero_gamma"}
        assert e["inits"]["random"]["gain"] == e["gain"]
    # width gain: the plain model at twice the width minus at this width, the same plain runs
    assert widths["0.125"]["width_gain"] == pytest.approx(widths["0.25"]["plain"] - widths["0.125"]["plain"])
    assert widths["0.25"]["width_gain"] is not None  # from a plain run at 0.5
    kinds = res["models"]["lenet5"]["kinds_alone"]
    assert kinds["width"] in (0.125, 0.25) and {"1x1", "1x1_kxk"} <= set(kinds["kinds"])
    assert [r["gain"] for r in res["dbb_paper"]][:2] == [0.67, 1.67]
    text = capsys.readouterr().out
    assert "width gain" in text and "the DBB paper" in text


def test_both_arms_see_the_same_start_and_the_same_data_order():
    data = bench_gain.load_splits("digits", None)
    setup = bench_gain.GainSetup(epochs=1)
    a = bench_gain.train_pair("lenet5", 0.25, data, setup, 3, inits=["zero_gamma"])
    b = bench_gain.train_pair("lenet5", 0.25, data, setup, 3, inits=["zero_gamma"])
    assert a == b  # deterministic per seed
    # zero-γ expansion keeps the function and its branches get no gradient in the first step, so
    # one step later the merged model still differs from the plain one only through the branches
    base = bench_gain._plain("lenet5", 0.25, data, 3)
    big = bench_gain.expanded_from(base, init="zero_gamma", branches=None, seed=3)
    base.eval(), big.eval()
    assert torch.equal(base(data.test_x[:8]), big(data.test_x[:8]))


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--models", "logreg"], ["logreg", "no conv"]),
        (["--models", "no-such-model"], ["unknown model", "no-such-model"]),
        (["--dataset", "fashion_mnist", "--data-dir", "{tmp}"], ["Fashion-MNIST"]),
        (["--dataset", "no-such-set"], ["unknown dataset"]),
    ],
)
def test_a_set_up_it_cannot_run_is_one_line_and_exit_2(argv, words, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    rc = main(["bench", "reparam-gain", "--widths", "0.125", "--seeds", "1", "--epochs", "1", *argv])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2  # the banner, then the one line
    assert err[-1].startswith("fedhetero bench reparam-gain: ")
    for word in words:
        assert word in err[-1]


def test_a_bad_init_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "reparam-gain", "--inits", "zero"])
    assert exc.value.code == 2
    assert "accepted: zero_gamma, random_resolve, random" in capsys.readouterr().err


def test_the_candidate_set_ups_do_what_they_say():
    data = bench_gain.load_splits("digits", None)
    base = bench_gain._plain("lenet5", 0.25, data, 0)
    big = bench_gain.expanded_from(base, init="random", branches=None, seed=0)
    # the branch parameters are exactly those of the non-anchor branches
    branch = {id(p) for p in bench_gain._branch_parameters(big)}
    anchors = {id(p) for m in big.modules() if isinstance(m, reparam.DiverseBranchBlock) for p in m.anchor.parameters()}
    assert branch and not branch & anchors
    assert branch < {id(p) for p in big.parameters()}
    # BatchNorm recalibration: the exact average of the per-batch statistics
    bench_gain._recalibrate_bn(big, data.train_x, 32, 3, 0)
    perm = torch.randperm(len(data.train_x), generator=torch.Generator().manual_seed(20_000))
    norms = [m for m in big.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert all(m.num_batches_tracked == 3 and m.momentum == 0.1 for m in norms)
    x = data.train_x[perm[:96]]
    block = next(m for m in big.modules() if isinstance(m, reparam.DiverseBranchBlock))  # the first conv's
    anchor_bn = block.anchor.bn
    means = []
    for i in range(3):
        with torch.no_grad():
            y = block.anchor.conv(x[i * 32:(i + 1) * 32])
        means.append(y.mean(dim=(0, 2, 3)))
    torch.testing.assert_close(anchor_bn.running_mean, torch.stack(means).mean(0), rtol=1e-5, atol=1e-6)
    setup = bench_gain.GainSetup(epochs=1, branch_weight_decay=0.0, recalibrate_bn=2)
    r = bench_gain.train_pair("lenet5", 0.25, data, setup, 0, inits=["random"])
    assert r["random"]["merge_error"] < 1e-4
    # block_step "mean": with plain SGD (no momentum, no decay) one step moves each block's merged
    # kernel by the mean of its branches' steps, so a zero-γ block (only the anchor has a gradient)
    # moves its kernel by the anchor's step over the branch count
    one = bench_gain.GainSetup(epochs=1, momentum=0.0, weight_decay=0.0, schedule="constant", block_step="mean")
    small = bench_gain.Splits(data.train_x[:8], data.train_y[:8], data.val_x, data.val_y, data.test_x,
                              data.test_y, data.num_classes, "digits")
    steps = {}
    for step in ("sum", "mean"):
        model = bench_gain.expanded_from(base, init="zero_gamma", branches=None, seed=0)
        blk = next(m for m in model.modules() if isinstance(m, reparam.DiverseBranchBlock))
        before = blk.anchor.conv.weight.detach().clone()
        bench_gain._train(model, small, dataclasses.replace(one, block_step=step), 0)
        steps[step] = blk.anchor.conv.weight.detach() - before
    torch.testing.assert_close(steps["mean"] * len(blk.branch_names), steps["sum"], rtol=1e-4, atol=1e-7)


MY_MODEL = '''
from torch import nn


def make(num_classes, in_channels):
    return nn.Sequential(nn.Conv2d(in_channels, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(64, num_classes))
'''


def test_a_model_of_your_own_is_measured_by_its_path(tmp_path, capsys):
    path = tmp_path / "my_model.py"
    path.write_text(MY_MODEL)
    out = tmp_path / "gain.json"
    rc = main(["bench", "reparam-gain", "--models", f"{path}:make", "--widths", "1", "--seeds", "2",
               "--epochs", "1", "--no-kinds", "--json", str(out)])
    assert rc == 0
    entry = json.loads(out.read_text())["models"][f"{path}:make"]["widths"]["1"]
    assert entry["macs_expanded"] > entry["macs_plain"] > 0 and len(entry["gains"]) == 2
    # it takes no width: another width is one line naming the argument
    rc = main(["bench", "reparam-gain", "--models", f"{path}:make", "--widths", "0.5", "--seeds", "1",
               "--epochs", "1"])
    assert rc == 2 and "takes no 'width' argument" in capsys.readouterr().err
    rc = main(["bench", "reparam-gain", "--models", f"{path}:nothing", "--widths", "1", "--seeds", "1"])
    assert rc == 2 and "cannot load the model" in capsys.readouterr().err


def test_a_long_run_hands_over_what_it_measured_after_every_seed():
    snapshots = []
    res = bench_gain.run_benchmark(models=["lenet5"], widths=[0.125], seeds=2, kinds=False,
                                   setup=bench_gain.GainSetup(epochs=1), threads=None,
                                   checkpoint=lambda r: snapshots.append(json.loads(json.dumps(r))))
    first = snapshots[0]["partial"]["lenet5"]["0.125"]
    assert list(first) == ["0"] and set(first["0"]) >= {"plain", "random"}
    assert list(snapshots[1]["partial"]["lenet5"]["0.125"]) == ["0", "1"]
    assert "lenet5" in snapshots[-1]["models"] and "lenet5" not in snapshots[-1].get("partial", {})
    assert res["models"]["lenet5"]["widths"]["0.125"]["gains"] == [
        snapshots[1]["partial"]["lenet5"]["0.125"][s]["random"]["test"]
        - snapshots[1]["partial"]["lenet5"]["0.125"][s]["plain"]["test"] for s in ("0", "1")]


def test_the_internal_width_candidate_widens_only_the_1x1_kxk_branches():
    data = bench_gain.load_splits("digits", None)
    base = bench_gain._plain("lenet5", 0.25, data, 0)
    shapes = {}
    for scale in (None, 2.0):
        model = bench_gain.expanded_from(base, init="random", branches=None, seed=0, internal_scale=scale)
        shapes[scale] = {path: (sorted(blk.branches), blk.branches["1x1_kxk"].internal)
                         for path, blk in reparam._tree.iter_blocks(model)}
    assert {p: k for p, (k, _) in shapes[None].items()} == {p: k for p, (k, _) in shapes[2.0].items()}
    assert all(shapes[2.0][p][1] == 2 * shapes[None][p][1] for p in shapes[None])
    r = bench_gain.train_pair("lenet5", 0.25, data, bench_gain.GainSetup(epochs=1, internal_scale=2.0), 0,
                              inits=["random"])
    assert r["macs_expanded"] > bench_gain.train_pair("lenet5", 0.25, data, bench_gain.GainSetup(epochs=1), 0,
                                                      inits=["random"])["macs_expanded"]
