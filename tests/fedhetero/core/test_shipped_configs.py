"""Every shipped configuration runs without a dropped client.

An exception from the project's own code in a client task is a bug, never a device fault: the
default job (all 30 rounds, where DynamicFL's nested growth, DYMM and budget fill all happen) and
every ``examples/configs/*.yaml`` at reduced size must finish with zero dropped client-rounds.
DynamicFL configurations run with ``algorithm.options.verify`` on, so the structural invariants
are checked in every task as well.

Configurations whose data is not on this machine (CIFAR-10/100, DermaMNIST) run on the synthetic
set (CIFAR's image shape, 10 classes): the models, budgets, budget scenarios and structural changes
are the configuration's own; Fashion-MNIST configurations need the data folder named by
``FEDHETERO_FASHION_MNIST`` (default: ``../shared/data/fashion-mnist`` beside the repository) and are
skipped without it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from fedhetero.core.common.configfile import load_config
from fedhetero.core.run.engine import Engine
from _util import ROOT

CONFIGS = sorted((ROOT / "examples" / "configs").glob("*.yaml"))
FMNIST = Path(os.environ.get("FEDHETERO_FASHION_MNIST", ROOT.parent / "shared" / "data" / "fashion-mnist"))

#: data sets not on this machine, replaced by the synthetic set (CIFAR's shape: 3×32×32, 10 classes)
SYNTHETIC_STANDS_IN = {"cifar10", "cifar100", "dermamnist"}
#: models whose reduced runs still take tens of seconds on one core: in the slow set
HEAVY_MODELS = {"resnet18", "googlenet"}
#: comparisons of many methods whose reduced run takes minutes: in the slow set
HEAVY_CONFIGS = {"digits_feddumap", "digits_compare", "digits_table"}  # the eight- and nine-method comparisons


def _assert_no_drop(res: Any) -> None:
    rows = res.metrics
    dropped = [(r["round"], d["cid"], d.get("kind"), d["reason"]) for r in rows for d in r.get("dropped", ())]
    assert dropped == []
    assert res.summary["dropped_clients"] == 0
    assert res.summary["internal_errors"] == 0
    assert all(r["clients"] for r in rows)


def test_default_job_drops_no_client_in_any_round(tmp_path):
    """The job ``fedhetero train`` runs with no arguments, all of it: rounds 9 onwards are where
    clients used to be dropped by the optimizer update of a nested growth."""
    cfg = load_config(None)
    assert cfg.algorithm.name == "dynamicfl" and cfg.train.rounds >= 27
    res = Engine(cfg, tmp_path / "run", progress=False).run()
    _assert_no_drop(res)
    assert [r["round"] for r in res.metrics] == list(range(1, cfg.train.rounds + 1))
    expected = max(1, round(cfg.train.sample_rate * cfg.data.num_clients))
    assert all(len(r["clients"]) == expected for r in res.metrics)
    # the structural changes this test exists for did happen: DYMM rounds with folds and growth
    modes = {c["mode"] for r in res.metrics for c in r["clients"]}
    assert {"first", "dymm"} <= modes
    assert sum(c.get("folded", 0) + c.get("grown", 0) + c.get("filled", 0) for r in res.metrics for c in r["clients"]) > 0


def _reduced(path: Path) -> list[str]:
    """Overrides that shrink a configuration to a few small rounds that still reach its structural
    changes (every client returns, so DYMM and budget changes happen from round 2)."""
    cfg = load_config(path)
    o = ["threads=1", "train.eval_every=1", "train.checkpoint_every=1"]
    if cfg.data.dataset in SYNTHETIC_STANDS_IN:
        o += ["data.dataset=synthetic", "data.synthetic_size=240", "data.augment=false"]
    elif cfg.data.dataset == "fashion_mnist":
        o += [f"data.data_dir={FMNIST}"]
    if cfg.sessions.count:
        o += ["sessions.count=3", "sessions.rounds=2", "train.rounds=6", "data.num_clients=24"]
        if cfg.sessions.devices is not None:
            o += ["sessions.devices=null"]
    elif cfg.data.partition == "kshards":  # shards_per_client × clients must divide into the classes
        o += ["train.rounds=3", "data.num_clients=10", "train.sample_rate=0.5"]
    else:
        o += ["train.rounds=3", "data.num_clients=6", "train.sample_rate=1.0"]
    epochs = max(cfg.train.local_epochs, 1)
    o += [f"train.local_steps={epochs}", "train.batch_size=8"]
    if cfg.algorithm.name == "dynamicfl":
        o += ["algorithm.options.verify=true"]
    return o


def _params() -> list[Any]:
    out = []
    for path in CONFIGS:
        cfg = load_config(path)
        marks = []
        if cfg.model.name in HEAVY_MODELS or path.stem in HEAVY_CONFIGS:
            marks.append(pytest.mark.slow)
        out.append(pytest.param(path, id=path.stem, marks=marks))
    return out


def _compare_command(path: Path) -> tuple[list[str], list[str]] | None:
    """The methods and ``--option`` values a ``fedhetero compare`` configuration's header comment
    runs it with (a pruning round moved to round 2 of the reduced run, so that pruning happens), or
    None for a configuration without one."""
    header = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        header += line.lstrip("#").split()
    if "--algorithms" not in header:
        return None
    methods = header[header.index("--algorithms") + 1].split(",")
    options = [header[i + 1] for i, w in enumerate(header[:-1]) if w == "--option"]
    options = [o.split("=")[0] + "=2" if o.split("=")[0].endswith(".prune_round") else o for o in options]
    return methods, options


@pytest.mark.parametrize("path", _params())
def test_shipped_config_drops_no_client(path, tmp_path):
    cfg = load_config(path)
    if cfg.data.dataset == "fashion_mnist" and not (FMNIST / "train-images-idx3-ubyte.gz").is_file():
        pytest.skip(f"the Fashion-MNIST IDX files are not in {FMNIST} (set FEDHETERO_FASHION_MNIST)")
    command = _compare_command(path)
    if command is not None and (cfg.data.public_fraction > 0 or cfg.data.server_fraction > 0):
        # a comparison configuration (it holds a split for some of its methods): run it as compare
        from fedhetero.core.run.compare import run_comparison

        methods, options = command
        rows = run_comparison(
            config=str(path), overrides=_reduced(path), algorithms=methods, out=tmp_path / "cmp", plot=False,
            progress=False, options=options,
        )
        assert [r["algorithm"] for r in rows] == methods
        for r in rows:
            assert (r["algorithm"], r["status"], r["dropped_client_rounds"], r["internal_errors"]) == (r["algorithm"], "ok", 0, 0)
        return
    reduced = load_config(path, _reduced(path))
    res = Engine(reduced, tmp_path / "run", progress=False).run()
    _assert_no_drop(res)
    assert len(res.metrics) == reduced.train.rounds
    if reduced.algorithm.name == "dynamicfl":
        clients = [c for r in res.metrics for c in r["clients"]]
        assert any(c["mode"] != "first" for c in clients)  # a returning client: REP and DYMM ran
        tol = 1e-10 if reduced.dtype == "float64" else 1e-5
        assert all(c["lossless_out"] <= tol for c in clients)
        assert all(c.get("lossless_in", 0.0) <= tol for c in clients)
