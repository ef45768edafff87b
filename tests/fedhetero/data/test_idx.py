"""MNIST and Fashion-MNIST from IDX files: small files written here in the real format (gzipped and
raw, flat and in torchvision's folders, malformed ones), the real Fashion-MNIST when it is
available, and the logistic-regression model the DynInit authors train on them."""

from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from fedhetero.core.common.config import from_dict
from fedhetero.core.common.options import ConfigError
from fedhetero.core.local.context import build_data
from fedhetero.data import DatasetFormatError, DatasetNotFoundError, load_dataset
from fedhetero.data.datasets import FASHION_MNIST_MEAN, FASHION_MNIST_STD, MNIST_MEAN, MNIST_STD, read_idx
from fedhetero.core.run.engine import Engine
from _util import ROOT

FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def idx_bytes(array: np.ndarray, type_code: int = 0x08) -> bytes:
    """The IDX encoding: two zero bytes, type code, number of dimensions, big-endian sizes, data."""
    header = bytes([0, 0, type_code, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    return header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()


def write(path: Path, data: bytes, gz: bool) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    return path


def make_set(folder: Path, n_train: int = 60, n_test: int = 20, gz: bool = True, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = {
        FILES[0]: rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        FILES[1]: (np.arange(n_train) % 10).astype(np.uint8),
        FILES[2]: rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        FILES[3]: (np.arange(n_test)[::-1] % 10).astype(np.uint8),
    }
    for name, arr in arrays.items():
        write(folder / name, idx_bytes(arr), gz)
    return arrays


@pytest.mark.parametrize("name, mean, std", [("mnist", MNIST_MEAN, MNIST_STD), ("fashion_mnist", FASHION_MNIST_MEAN, FASHION_MNIST_STD)])
@pytest.mark.parametrize("gz", [True, False])
def test_loads_idx_files_placed_directly(tmp_path, name, mean, std, gz):
    arrays = make_set(tmp_path, gz=gz)
    train = load_dataset(name, data_dir=tmp_path)
    test = load_dataset(name, data_dir=tmp_path, split="test")
    assert train.images.shape == (60, 1, 28, 28) and test.images.shape == (20, 1, 28, 28)
    assert train.images.dtype == torch.float32 and train.labels.dtype == torch.int64
    assert train.num_classes == 10 and train.input_shape == (1, 28, 28)
    expected = (torch.from_numpy(arrays[FILES[0]].astype(np.float32)) / 255.0 - mean[0]) / std[0]
    assert torch.allclose(train.images[:, 0], expected, atol=1e-6)
    assert train.labels.tolist() == arrays[FILES[1]].tolist()
    assert test.labels.tolist() == arrays[FILES[3]].tolist()
    raw = load_dataset(name, data_dir=tmp_path, normalize=False)
    assert torch.equal(raw.images[:, 0], torch.from_numpy(arrays[FILES[0]].astype(np.float32)) / 255.0)
    assert raw.mean is None and train.mean == mean


def test_torchvision_folders_and_mixed_compression(tmp_path):
    fashion = make_set(tmp_path / "FashionMNIST" / "raw", gz=False, seed=1)
    digits = make_set(tmp_path / "MNIST" / "raw", gz=True, seed=2)
    # torchvision keeps the .gz beside the extracted file: either is fine
    write(tmp_path / "MNIST" / "raw" / FILES[0], idx_bytes(digits[FILES[0]]), gz=False)
    a = load_dataset("fashion_mnist", data_dir=tmp_path, normalize=False)
    b = load_dataset("mnist", data_dir=tmp_path, normalize=False)
    assert torch.equal(a.images[:, 0], torch.from_numpy(fashion[FILES[0]].astype(np.float32)) / 255.0)
    assert torch.equal(b.images[:, 0], torch.from_numpy(digits[FILES[0]].astype(np.float32)) / 255.0)
    assert a.class_names[9] == "Ankle boot"


def test_the_data_sets_own_folder_wins_over_files_at_the_root(tmp_path):
    """MNIST and Fashion-MNIST files have the same names: a data set's own folder is searched
    before the files placed directly in data_dir."""
    flat = make_set(tmp_path, seed=3)
    own = make_set(tmp_path / "FashionMNIST" / "raw", seed=4)
    got = load_dataset("fashion_mnist", data_dir=tmp_path, normalize=False)
    assert torch.equal(got.images[:, 0], torch.from_numpy(own[FILES[0]].astype(np.float32)) / 255.0)
    got = load_dataset("mnist", data_dir=tmp_path, normalize=False)
    assert torch.equal(got.images[:, 0], torch.from_numpy(flat[FILES[0]].astype(np.float32)) / 255.0)


@pytest.mark.parametrize("name, title", [("mnist", "MNIST"), ("fashion_mnist", "Fashion-MNIST")])
def test_missing_files_say_what_to_download_and_where(tmp_path, name, title):
    make_set(tmp_path)
    (tmp_path / (FILES[2] + ".gz")).unlink()
    with pytest.raises(DatasetNotFoundError) as err:
        load_dataset(name, data_dir=tmp_path, split="train")
    msg = str(err.value)
    for needle in (title, FILES[2], str(tmp_path), "--set data.data_dir=DIR", "data.data_dir", "raw", "data.download"):
        assert needle in msg, needle
    assert FILES[0] not in msg.split("\n")[0]  # only the missing file is listed as missing


def _corrupt(tmp_path: Path, which: int, data: bytes, gz: bool = True) -> Path:
    make_set(tmp_path)
    (tmp_path / (FILES[which] + ".gz")).unlink()
    return write(tmp_path / FILES[which], data, gz)


@pytest.mark.parametrize(
    "which, make, needle",
    [
        (0, lambda: b"\x01\x02" + idx_bytes(np.zeros((60, 28, 28), np.uint8))[2:], "magic"),
        (0, lambda: idx_bytes(np.zeros((60, 28, 28), np.uint8), type_code=0x0D), "type code"),
        (1, lambda: idx_bytes(np.zeros((60, 28, 28), np.uint8)), "dimension"),  # images where labels belong
        (0, lambda: idx_bytes(np.zeros((60, 28, 28), np.uint8))[:-5], "truncated"),
        (0, lambda: idx_bytes(np.zeros((60, 28, 28), np.uint8)) + b"\x00", "holds"),
        (0, lambda: idx_bytes(np.zeros((60, 32, 32), np.uint8)), "28×28"),
        (0, lambda: idx_bytes(np.zeros((59, 28, 28), np.uint8)), "labels"),  # count mismatch
        (1, lambda: idx_bytes(np.full(60, 10, np.uint8)), "label 10"),
        (0, lambda: b"", "magic"),
        (0, lambda: b"\x00\x00\x08\x03\x00", "header"),
    ],
)
def test_malformed_files_name_the_file(tmp_path, which, make, needle):
    path = _corrupt(tmp_path, which, make())
    with pytest.raises(DatasetFormatError) as err:
        load_dataset("fashion_mnist", data_dir=tmp_path)
    assert str(path) in str(err.value) and needle in str(err.value)


def test_broken_gzip_is_a_format_error(tmp_path):
    path = _corrupt(tmp_path, 0, b"", gz=False)
    path.unlink()
    bad = tmp_path / (FILES[0] + ".gz")
    bad.write_bytes(gzip.compress(idx_bytes(np.zeros((60, 28, 28), np.uint8)))[:-20])
    with pytest.raises(DatasetFormatError, match=str(bad).replace("\\", "\\\\")):
        load_dataset("mnist", data_dir=tmp_path)


def test_read_idx_checks_the_dimensions(tmp_path):
    path = write(tmp_path / "x", idx_bytes(np.arange(12, dtype=np.uint8).reshape(3, 4)), gz=False)
    assert read_idx(path, 2).shape == (3, 4)
    with pytest.raises(DatasetFormatError, match="2 dimension"):
        read_idx(path, 3)


def test_config_and_a_run_on_idx_data(tmp_path):
    make_set(tmp_path / "data", n_train=200, n_test=50)
    for name in ("mnist", "fashion_mnist"):
        cfg = from_dict({"data": {"dataset": name, "data_dir": str(tmp_path / "data"), "num_clients": 4}})
        fd = build_data(cfg)
        assert fd.input_shape == (1, 28, 28) and sum(len(ix) for ix in fd.client_indices) == 200
    with pytest.raises(ConfigError, match="data.dataset"):
        from_dict({"data": {"dataset": "fmnist"}})
    for model in ("lenet5", "cnn", "logreg"):
        cfg = from_dict(
            {
                "threads": 1,
                "model": {"name": model},
                "data": {"dataset": "fashion_mnist", "data_dir": str(tmp_path / "data"), "num_clients": 4},
                "train": {"rounds": 1, "local_epochs": 1},
                "algorithm": {"name": "fedavg"},
            }
        )
        res = Engine(cfg, tmp_path / model, progress=False).run()
        assert 0.0 <= res.summary["final_accuracy"] <= 1.0


def test_logreg_model():
    from fedhetero.core.hetero.budget import count_params, macs
    from fedhetero.models import build_model, list_models

    assert "logreg" in list_models()
    m = build_model("logreg", in_channels=1, input_size=28)
    assert count_params(m) == 7850 and macs(m, (1, 28, 28)) == 7840
    assert m(torch.zeros(3, 1, 28, 28)).shape == (3, 10)
    assert type(build_model("logistic_regression")).__name__ == "LogReg"
    with pytest.raises(ValueError, match="width"):
        build_model("logreg", width=0)


def _fashion_folder() -> Path | None:
    env = os.environ.get("FEDHETERO_FASHION_MNIST")
    cand = Path(env) if env else ROOT.parent / "shared" / "data" / "fashion-mnist"
    return cand if (cand / (FILES[0] + ".gz")).is_file() or (cand / FILES[0]).is_file() else None


@pytest.mark.skipif(
    _fashion_folder() is None,
    reason="the real Fashion-MNIST IDX files are not available (set FEDHETERO_FASHION_MNIST to their folder)",
)
def test_real_fashion_mnist():
    folder = _fashion_folder()
    train = load_dataset("fashion_mnist", data_dir=folder)
    test = load_dataset("fashion_mnist", data_dir=folder, split="test")
    assert train.images.shape == (60000, 1, 28, 28) and test.images.shape == (10000, 1, 28, 28)
    assert train.label_histogram().tolist() == [6000] * 10
    assert test.label_histogram().tolist() == [1000] * 10
    assert int(train.labels[0]) == 9 and int(test.labels[0]) == 9  # both start with an ankle boot
    # the published statistics are the training set's: normalised pixels have mean 0, std 1
    assert abs(float(train.images.mean())) < 1e-3
    assert abs(float(train.images.std()) - 1.0) < 1e-3
