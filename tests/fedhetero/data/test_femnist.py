"""FEMNIST from LEAF JSON files: format checks, pooled and LEAF splits, partitions, config."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fedhetero.core.common.config import DataConfig
from fedhetero.data import build_federated_data, load_dataset
from fedhetero.data.datasets import DATASETS, read_leaf_json
from fedhetero.data.errors import DatasetFormatError, DatasetNotFoundError


def _users(rng: np.random.Generator, prefix: str, n_users: int, per_user: int) -> dict:
    users = [f"{prefix}_{k:02d}" for k in range(n_users)]
    data = {}
    for k, u in enumerate(users):
        x = rng.random((per_user, 784)).round(3).tolist()
        y = [int((k * 7 + i) % 62) for i in range(per_user)]
        data[u] = {"x": x, "y": y}
    return {"users": users, "num_samples": [per_user] * n_users, "user_data": data}


def write_leaf(root: Path, *, n_files: int = 2, n_users: int = 3, per_user: int = 5) -> Path:
    """A small LEAF FEMNIST tree: ``root/femnist/data/{train,test}/*.json``."""
    rng = np.random.default_rng(0)
    base = root / "femnist" / "data"
    for split, per in (("train", per_user), ("test", max(1, per_user // 2))):
        (base / split).mkdir(parents=True)
        for f in range(n_files):
            obj = _users(rng, f"f{f}", n_users, per)
            (base / split / f"all_data_{f}_niid_{split}.json").write_text(json.dumps(obj))
    return base


def test_registered_and_in_the_config() -> None:
    assert "femnist" in DATASETS
    assert DataConfig(dataset="femnist").dataset == "femnist"


def test_pooled_split_is_a_seeded_80_20_split(tmp_path: Path) -> None:
    write_leaf(tmp_path)
    train = load_dataset("femnist", data_dir=tmp_path)
    test = load_dataset("femnist", data_dir=tmp_path, split="test")
    total = 2 * 3 * 5 + 2 * 3 * 2  # train files + test files, all pooled
    assert len(train) + len(test) == total and len(test) == round(0.2 * total)
    assert train.input_shape == (1, 28, 28) and train.num_classes == 62
    assert train.images.dtype == torch.float32 and train.labels.dtype == torch.int64
    assert len(train.class_names or ()) == 62
    # normalised with the training split's statistics
    assert abs(float(train.images.mean())) < 1e-4 and abs(float(train.images.std(unbiased=False)) - 1) < 1e-3
    again = load_dataset("femnist", data_dir=tmp_path)
    assert torch.equal(again.images, train.images) and torch.equal(again.labels, train.labels)
    other = load_dataset("femnist", data_dir=tmp_path, split_seed=1)
    assert not torch.equal(other.labels, train.labels) or not torch.equal(other.images, train.images)


def test_leaf_split_keeps_the_files_and_pixels(tmp_path: Path) -> None:
    base = write_leaf(tmp_path)
    raw = load_dataset("femnist", data_dir=base, split="test", split_mode="leaf", normalize=False)
    assert len(raw) == 2 * 3 * 2
    first = json.loads(sorted((base / "test").glob("*.json"))[0].read_text())
    u0 = first["users"][0]
    expect = torch.tensor(first["user_data"][u0]["x"][0], dtype=torch.float32).reshape(1, 28, 28)
    assert torch.equal(raw.images[0], expect)  # row-major 28×28, values as stored
    assert int(raw.labels[0]) == first["user_data"][u0]["y"][0]
    assert raw.mean is None
    train = load_dataset("femnist", data_dir=tmp_path, split_mode="leaf")
    assert len(train) == 2 * 3 * 5


def test_missing_folder_says_what_to_download_and_where(tmp_path: Path) -> None:
    with pytest.raises(DatasetNotFoundError) as err:
        load_dataset("femnist", data_dir=tmp_path)
    msg = str(err.value)
    assert "LEAF" in msg and "preprocess" in msg and "data.data_dir" in msg
    assert str(tmp_path / "femnist" / "data") in msg
    # only train/ is not enough
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "a.json").write_text(json.dumps({"users": [], "user_data": {}}))
    with pytest.raises(DatasetNotFoundError):
        load_dataset("femnist", data_dir=tmp_path, download=True)


@pytest.mark.parametrize(
    "content, match",
    [
        ("{not json", "not a readable LEAF JSON"),
        (json.dumps([1, 2]), "'users' list"),
        (json.dumps({"users": ["a"], "user_data": {}}), "no 'x'/'y'"),
        (json.dumps({"users": ["a"], "user_data": {"a": {"x": [[0.5] * 10], "y": [1]}}}), "784-pixel rows"),
        (json.dumps({"users": ["a"], "user_data": {"a": {"x": [[0.5] * 784], "y": [1, 2]}}}), "1 images but 2"),
        (json.dumps({"users": ["a"], "user_data": {"a": {"x": [[0.5] * 784], "y": [62]}}}), "0..61"),
        (json.dumps({"users": ["a"], "user_data": {"a": {"x": [[0.5] * 784], "y": [1.5]}}}), "integer labels"),
        (json.dumps({"users": ["a"], "user_data": {"a": {"x": [["p"] * 784], "y": [1]}}}), "non-numeric"),
        (
            json.dumps({"users": ["a"], "num_samples": [3], "user_data": {"a": {"x": [[0.5] * 784], "y": [1]}}}),
            "num_samples says 3",
        ),
    ],
)
def test_malformed_files_name_the_file(tmp_path: Path, content: str, match: str) -> None:
    base = write_leaf(tmp_path, n_files=1)
    bad = base / "train" / "zz_broken.json"
    bad.write_text(content)
    with pytest.raises(DatasetFormatError, match=match) as err:
        load_dataset("femnist", data_dir=tmp_path)
    assert "zz_broken.json" in str(err.value)
    with pytest.raises(DatasetFormatError, match=match):
        read_leaf_json(bad)


def test_unknown_option_is_rejected(tmp_path: Path) -> None:
    write_leaf(tmp_path)
    with pytest.raises(ValueError, match="split_mode"):
        load_dataset("femnist", data_dir=tmp_path, split_mode="writers")
    with pytest.raises(ValueError, match="accepted options"):
        load_dataset("femnist", data_dir=tmp_path, size=32)


def test_dirichlet_partition_of_pooled_femnist(tmp_path: Path) -> None:
    write_leaf(tmp_path, n_files=2, n_users=5, per_user=10)
    fed = build_federated_data(
        "femnist", data_dir=tmp_path, num_clients=4, partition="dirichlet", alpha=0.3, min_size=2, rng=0
    )
    assert fed.num_clients == 4 and fed.num_classes == 62
    assert sum(fed.client_num_samples(c) for c in range(4)) == len(fed.train)


# ----------------------------------------------------------------------------- natural (per-writer) partition
def _writer_rows(base: Path, split: str) -> dict[str, list[int]]:
    """Labels of every writer in the JSON files of one split, as written."""
    out: dict[str, list[int]] = {}
    for path in sorted((base / split).glob("*.json")):
        obj = json.loads(path.read_text())
        for u in obj["users"]:
            out.setdefault(u, []).extend(obj["user_data"][u]["y"])
    return out


def test_both_splits_record_the_writer_of_every_sample(tmp_path: Path) -> None:
    base = write_leaf(tmp_path, n_files=2, n_users=3, per_user=6)
    names = sorted(_writer_rows(base, "train"))
    for split in ("train", "test"):
        ds = load_dataset("femnist", data_dir=tmp_path, split=split, split_mode="leaf")
        assert ds.writer_names == tuple(names) and ds.writers is not None and len(ds.writers) == len(ds)
        expect = [names.index(u) for u, ys in sorted(_writer_rows(base, split).items(), key=lambda kv: kv[0]) for _ in ys]
        assert sorted(ds.writers.tolist()) == expect
        for u, ys in _writer_rows(base, split).items():
            assert ds.labels_np[ds.writers == names.index(u)].tolist() == ys
    # pooled: a writer's samples are spread over both splits, ids shared, nothing lost
    tr = load_dataset("femnist", data_dir=tmp_path)
    te = load_dataset("femnist", data_dir=tmp_path, split="test")
    assert tr.writer_names == te.writer_names == tuple(names)
    both = {**{u: [] for u in names}}
    for u, ys in list(_writer_rows(base, "train").items()) + list(_writer_rows(base, "test").items()):
        both[u] += ys
    for k, u in enumerate(names):
        got = sorted(tr.labels_np[tr.writers == k].tolist() + te.labels_np[te.writers == k].tolist())
        assert got == sorted(both[u])
    sub = tr.subset([3, 1])
    assert sub.writers is not None and sub.writers.tolist() == [int(tr.writers[3]), int(tr.writers[1])]


def test_natural_partition_gives_each_client_one_writer(tmp_path: Path) -> None:
    base = write_leaf(tmp_path, n_files=2, n_users=3, per_user=6)
    rows = _writer_rows(base, "train")
    names = sorted(rows)
    fed = build_federated_data(
        "femnist", data_dir=tmp_path, num_clients=len(names), partition="natural", rng=0,
        dataset_options={"split_mode": "leaf"},
    )
    assert fed.num_clients == 6
    assert fed.info["partition"] == "natural" and fed.info["client_writers"] == names
    assert fed.info["writers_available"] == 6 and fed.info["unused_samples"] == 0
    for cid, u in enumerate(names):  # client k = the k-th writer by name, all of its samples
        assert fed.train.labels_np[fed.client_indices[cid]].tolist() == rows[u]
        assert set(fed.train.writers[fed.client_indices[cid]].tolist()) == {cid}
    flat = np.concatenate(fed.client_indices)
    assert sorted(flat.tolist()) == list(range(len(fed.train)))
    # independent of the seed when every writer is a client
    again = build_federated_data(
        "femnist", data_dir=tmp_path, num_clients=6, partition="natural", rng=5, dataset_options={"split_mode": "leaf"}
    )
    assert all(np.array_equal(a, b) for a, b in zip(again.client_indices, fed.client_indices))


def test_natural_partition_with_fewer_clients_draws_whole_writers(tmp_path: Path) -> None:
    write_leaf(tmp_path, n_files=2, n_users=4, per_user=5)
    fed = build_federated_data("femnist", data_dir=tmp_path, num_clients=3, partition="natural", rng=1)
    w = fed.train.writers
    assert w is not None
    chosen = fed.info["client_writers"]
    assert len(set(chosen)) == 3 and chosen == sorted(chosen)
    for cid, name in enumerate(chosen):  # every sample of that writer, and only those
        k = fed.train.writer_names.index(name)
        assert fed.client_indices[cid].tolist() == np.flatnonzero(w == k).tolist()
    assert fed.info["unused_samples"] == len(fed.train) - sum(len(i) for i in fed.client_indices) > 0
    same = build_federated_data("femnist", data_dir=tmp_path, num_clients=3, partition="natural", rng=1)
    assert same.info["client_writers"] == chosen
    draws = {
        tuple(build_federated_data("femnist", data_dir=tmp_path, num_clients=3, partition="natural", rng=s).info["client_writers"])
        for s in range(6)
    }
    assert len(draws) > 1  # the seed picks the writers


def test_natural_partition_errors(tmp_path: Path) -> None:
    from fedhetero.core.common.config import from_dict
    from fedhetero.core.common.options import ConfigError
    from fedhetero.data import DataConfigError, make_partition

    write_leaf(tmp_path, n_files=1, n_users=3, per_user=4)
    with pytest.raises(DataConfigError, match="exceeds the 3 writers"):
        build_federated_data("femnist", data_dir=tmp_path, num_clients=4, partition="natural", rng=0)
    with pytest.raises(DataConfigError, match="records no writers"):
        build_federated_data("synthetic", num_clients=4, partition="natural", rng=0)
    with pytest.raises(DataConfigError, match="needs each sample's writer"):
        make_partition("natural", np.zeros(8, np.int64), 2, np.random.default_rng(0))
    with pytest.raises(DataConfigError, match="one writer per label"):
        make_partition("natural", np.zeros(8, np.int64), 2, np.random.default_rng(0), writers=np.zeros(7, np.int64))
    with pytest.raises(ConfigError, match="data.partition.*femnist.*fashion_mnist has none"):
        from_dict({"data": {"dataset": "fashion_mnist", "partition": "natural"}})
    assert from_dict({"data": {"dataset": "femnist", "partition": "natural"}}).data.partition == "natural"
    from fedhetero.data.datasets import ArrayDataset

    with pytest.raises(DataConfigError, match="one entry per sample"):
        ArrayDataset(torch.zeros(3, 1, 2, 2), torch.zeros(3, dtype=torch.int64), 2, writers=np.zeros(2, np.int64))


def test_natural_partition_from_the_config(tmp_path: Path) -> None:
    from fedhetero.core.common.config import from_dict
    from fedhetero.core.local.context import build_data

    write_leaf(tmp_path, n_files=2, n_users=3, per_user=6)
    cfg = from_dict({"data": {"dataset": "femnist", "data_dir": str(tmp_path), "partition": "natural", "num_clients": 6}})
    fed = build_data(cfg)
    assert fed.num_clients == 6 and fed.summary()["client_writers"] == list(fed.train.writer_names)
    assert [len(i) for i in fed.client_indices] == [int((fed.train.writers == k).sum()) for k in range(6)]


def test_natural_partitioner_on_plain_writer_ids() -> None:
    from fedhetero.data.partition import natural

    writers = np.array([2, 0, 2, 5, 0, 5, 5])
    rep: dict = {}
    parts = natural(writers, 3, np.random.default_rng(0), report=rep)
    assert [p.tolist() for p in parts] == [[1, 4], [0, 2], [3, 5, 6]]
    assert rep == {"writers": [0, 2, 5], "writers_available": 3, "unused_samples": 0}
    two = natural(writers, 2, np.random.default_rng(0))
    assert all(len(set(writers[p].tolist())) == 1 for p in two)
    assert len({int(writers[p[0]]) for p in two}) == 2
    with pytest.raises(ValueError, match="integer writer ids"):
        natural(np.array([0.5, 1.0]), 1, np.random.default_rng(0))


def test_dynacomm_runs_on_per_writer_femnist(tmp_path: Path) -> None:
    """The whole path: config → per-writer clients → a DynaComm round whose selector sees each
    writer's own label histogram."""
    from fedhetero.core.common.config import from_dict
    from fedhetero.core.run.engine import Engine

    base = write_leaf(tmp_path, n_files=2, n_users=3, per_user=6)
    cfg = from_dict({
        "seed": 0,
        "threads": 1,
        "data": {"dataset": "femnist", "data_dir": str(tmp_path), "partition": "natural", "num_clients": 6},
        "model": {"name": "lenet5", "norm": "groupnorm1"},
        "train": {"rounds": 2, "sample_rate": 0.5, "batch_size": 2, "local_steps": 4, "lr": 0.01, "checkpoint_every": 10},
        "algorithm": {"name": "dynacomm", "options": {"interval_high": 1, "interval_low": 4, "budget_mode": "dynamic", "beta": 0.7}},
    })
    eng = Engine(cfg, tmp_path / "run", progress=False)
    res = eng.run()
    names = sorted(_writer_rows(base, "train"))
    assert eng.data.info["client_writers"] == names
    for r in res.metrics:
        assert len(r["clients"]) == 3 and 1 <= len(r["high_group"]) <= 2  # ⌊0.7·3⌋ = 2 at most
        for c in r["clients"]:
            writer = eng.data.train.writers[eng.data.client_indices[c["cid"]]]
            assert set(writer.tolist()) == {c["cid"]}
            assert c["nu_paper"] == (4 if c["high_freq"] else 1)
    assert res.summary["kappa_paper"] is not None and 0 < res.summary["kappa_paper"] < 1
