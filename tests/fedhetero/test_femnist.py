"""FEMNIST from LEAF JSON files: format checks, pooled and LEAF splits, partitions, config."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fedhetero.config import DataConfig
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
