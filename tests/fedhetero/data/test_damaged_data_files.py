"""Damaged or foreign data files: each is refused with one line that names the file (and the array,
field or split at fault), never a raw numpy/pickle exception, and nothing is silently truncated,
emptied or half loaded. The files are written here, small."""

from __future__ import annotations

import gzip
import json
import pickle
import struct
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from fedhetero.cli import main
from fedhetero.data import (
    ArrayDataset,
    DataConfigError,
    DatasetFormatError,
    build_federated_data,
    load_dataset,
)


RUN = ["--set", "train.rounds=1", "--set", "threads=1", "--set", "data.num_clients=2", "--set", "data.min_partition_size=1"]


def run_cli(args: list[str], out: Path, capsys) -> tuple[int, str]:
    """Exit code and stderr (stripped) of ``fedhetero train ARGS``."""
    capsys.readouterr()
    rc = main(["train", *args, *RUN, "--out", str(out), "--quiet"])
    return rc, capsys.readouterr().err.strip()


def assert_one_line(err: str, *needles: str) -> None:
    assert len(err.splitlines()) == 1, err
    assert err.startswith("fedhetero: "), err
    for needle in needles:
        assert needle in err, (needle, err)
    for raw in ("Traceback", "list index out of range", "KeyError: 101", "invalid literal", "set FEDHETERO_DEBUG"):
        assert raw not in err, err


# ------------------------------------------------------------------------------------------------
# DermaMNIST (.npz)
# ------------------------------------------------------------------------------------------------
def derma_arrays(sizes=(12, 4, 6), seed=0) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    out = {}
    for split, n in zip(("train", "val", "test"), sizes):
        out[f"{split}_images"] = g.integers(0, 256, (n, 28, 28, 3), dtype=np.uint8)
        out[f"{split}_labels"] = (np.arange(n) % 7).reshape(n, 1).astype(np.uint8)
    return out


def derma_cli(tmp_path: Path, capsys) -> tuple[int, str]:
    return run_cli(["--set", "data.dataset=dermamnist", "--set", f"data.data_dir={tmp_path}"], tmp_path / "run", capsys)


def test_dermamnist_fractional_labels_are_refused_not_truncated(tmp_path, capsys):
    arrays = derma_arrays()
    arrays["train_labels"] = arrays["train_labels"].astype(np.float64)
    arrays["train_labels"][3] = 2.7
    np.savez(tmp_path / "dermamnist.npz", **arrays)
    with pytest.raises(DatasetFormatError) as err:
        load_dataset("dermamnist", data_dir=tmp_path)
    assert "train_labels" in str(err.value) and "2.7" in str(err.value) and "dermamnist.npz" in str(err.value)
    rc, line = derma_cli(tmp_path, capsys)
    assert rc == 2
    assert_one_line(line, str(tmp_path / "dermamnist.npz"), "train_labels", "integer class ids", "2.7")
    # whole numbers stored as floats are still labels
    arrays["train_labels"][3] = 2.0
    np.savez(tmp_path / "dermamnist.npz", **arrays)
    assert load_dataset("dermamnist", data_dir=tmp_path).labels[3].item() == 2


def _truncated_npz(path: Path) -> None:
    np.savez_compressed(path, **derma_arrays())
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])


def _object_npz(path: Path) -> None:
    arrays: dict[str, np.ndarray] = dict(derma_arrays())
    arrays["test_labels"] = np.array([1, "x", None], dtype=object)
    np.savez(path, **arrays)


def _npy_not_npz(path: Path) -> None:
    with open(path, "wb") as fh:
        np.save(fh, np.zeros(3))


DAMAGED_NPZ = {
    "empty": (lambda p: p.write_bytes(b""), "the file is empty"),
    "truncated": (_truncated_npz, "BadZipFile"),
    "object_arrays": (_object_npz, "Object arrays cannot be loaded"),
    "single_array": (_npy_not_npz, "not a zip archive"),
    "text": (lambda p: p.write_text("not an archive\n"), "not a zip archive"),
}


@pytest.mark.parametrize("kind", sorted(DAMAGED_NPZ))
def test_dermamnist_damaged_npz_is_one_line(tmp_path, capsys, kind):
    make, reason = DAMAGED_NPZ[kind]
    path = tmp_path / "dermamnist.npz"
    make(path)
    rc, line = derma_cli(tmp_path, capsys)
    assert rc == 2
    assert_one_line(line, str(path), "not a valid DermaMNIST .npz", reason, "download it again")


@pytest.mark.parametrize("split", ["test", "train"])
def test_dermamnist_empty_split_refused_at_setup(tmp_path, capsys, split):
    sizes = (12, 0, 0) if split == "test" else (0, 0, 6)
    np.savez(tmp_path / "dermamnist.npz", **derma_arrays(sizes))
    rc, line = derma_cli(tmp_path, capsys)
    assert rc == 2
    assert_one_line(line, str(tmp_path / "dermamnist.npz"), f"{split}_images", f"DermaMNIST {split} split is empty")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_dermamnist_label_out_of_range_names_file_and_split(tmp_path, capsys):
    arrays = derma_arrays()
    arrays["test_labels"][2] = 7  # 7 classes: 0..6
    np.savez(tmp_path / "dermamnist.npz", **arrays)
    with pytest.raises(DatasetFormatError) as err:
        load_dataset("dermamnist", data_dir=tmp_path, split="test")
    msg = str(err.value)
    assert "dermamnist.npz: test_labels" in msg and "test label 7" in msg and "0..6" in msg
    rc, line = derma_cli(tmp_path, capsys)
    assert rc == 2
    assert_one_line(line, "dermamnist.npz", "test label 7")


def test_negative_labels_name_file_and_split(tmp_path):
    arrays = derma_arrays()
    arrays["train_labels"] = arrays["train_labels"].astype(np.int16)
    arrays["train_labels"][5] = -1
    np.savez(tmp_path / "dermamnist.npz", **arrays)
    with pytest.raises(DatasetFormatError, match=r"dermamnist\.npz: train_labels: train label -1 lies outside"):
        load_dataset("dermamnist", data_dir=tmp_path)


# ------------------------------------------------------------------------------------------------
# CIFAR (python pickles, .tar.gz archive)
# ------------------------------------------------------------------------------------------------
CIFAR10_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


def write_cifar10(root: Path, labels: dict[str, list] | None = None, n: int = 2, protocol: int = 2) -> Path:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    g = np.random.default_rng(0)
    for name in CIFAR10_FILES:
        lab = (labels or {}).get(name, [i % 10 for i in range(n)])
        obj = {b"data": g.integers(0, 256, (len(lab), 3072), dtype=np.uint8), b"labels": lab}
        with open(folder / name, "wb") as fh:
            pickle.dump(obj, fh, protocol=protocol)
    return folder


def cifar_cli(root: Path, capsys) -> tuple[int, str]:
    return run_cli(["--set", "data.dataset=cifar10", "--set", f"data.data_dir={root}", "--set", "model.name=lenet5"],
                   root / "run", capsys)


def test_cifar_text_label_names_file_and_field(tmp_path, capsys):
    folder = write_cifar10(tmp_path, {"test_batch": [0, "cat"]})
    rc, line = cifar_cli(tmp_path, capsys)
    assert rc == 2
    assert_one_line(line, str(folder / "test_batch"), "b'labels'", "integer class ids", "'cat'")


@pytest.mark.parametrize("name, label, split", [("data_batch_3", 10, "train"), ("test_batch", -2, "test")])
def test_cifar_label_out_of_range_names_file_and_split(tmp_path, capsys, name, label, split):
    folder = write_cifar10(tmp_path, {name: [1, label]})
    with pytest.raises(DatasetFormatError) as err:
        load_dataset("cifar10", data_dir=tmp_path, split=split)
    assert str(folder / name) in str(err.value) and f"{split} label {label} lies outside the classes 0..9" in str(err.value)
    rc, line = cifar_cli(tmp_path, capsys)
    assert rc == 2
    assert_one_line(line, str(folder / name), f"{split} label {label}")


def test_cifar_damaged_batch_names_the_file(tmp_path, capsys):
    folder = write_cifar10(tmp_path)
    raw = (folder / "data_batch_2").read_bytes()
    (folder / "data_batch_2").write_bytes(raw[: len(raw) // 3])
    rc, line = cifar_cli(tmp_path, capsys)
    assert rc == 2
    assert_one_line(line, str(folder / "data_batch_2"), "not a CIFAR python-pickle batch")


def test_cifar_empty_test_batch_refused(tmp_path):
    write_cifar10(tmp_path, {"test_batch": []}, protocol=4)  # protocol 2 pickles b"" as a call
    with pytest.raises(DatasetFormatError, match=r"test_batch: the CIFAR-10 test split is empty"):
        load_dataset("cifar10", data_dir=tmp_path, split="test")


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_cifar_corrupt_archive_names_the_archive(tmp_path, capsys, damage):
    archive = tmp_path / "data" / "cifar-10-python.tar.gz"
    archive.parent.mkdir()
    if damage == "garbage":
        archive.write_bytes(b"this is no archive at all" * 10)
    else:
        write_cifar10(tmp_path / "src", n=40)
        with tarfile.open(archive, "w:gz") as tar:
            tar.add(tmp_path / "src" / "cifar-10-batches-py", arcname="cifar-10-batches-py")
        raw = archive.read_bytes()
        archive.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(DatasetFormatError) as err:
        load_dataset("cifar10", data_dir=archive.parent)
    assert str(err.value).startswith(f"{archive}: not a readable CIFAR-10 archive")
    rc, line = cifar_cli(archive.parent, capsys)
    assert rc == 2
    assert_one_line(line, str(archive), "not a readable CIFAR-10 archive", "download it again")


# ------------------------------------------------------------------------------------------------
# MNIST (IDX), SVHN (.mat), FEMNIST (JSON)
# ------------------------------------------------------------------------------------------------
def idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    path.write_bytes(gzip.compress(header + array.astype(np.uint8).tobytes()))


def write_mnist(root: Path, test_labels: np.ndarray) -> None:
    g = np.random.default_rng(0)
    idx(root / "train-images-idx3-ubyte.gz", g.integers(0, 256, (10, 28, 28)))
    idx(root / "train-labels-idx1-ubyte.gz", np.arange(10) % 10)
    idx(root / "t10k-images-idx3-ubyte.gz", g.integers(0, 256, (len(test_labels), 28, 28)))
    idx(root / "t10k-labels-idx1-ubyte.gz", test_labels)


def test_mnist_label_out_of_range_names_file_and_split(tmp_path):
    write_mnist(tmp_path, np.array([1, 2, 10, 3]))
    with pytest.raises(DatasetFormatError) as err:
        load_dataset("mnist", data_dir=tmp_path, split="test")
    assert "t10k-labels-idx1-ubyte.gz" in str(err.value) and "test label 10 lies outside the classes 0..9" in str(err.value)


def test_mnist_empty_test_split_refused(tmp_path, capsys):
    write_mnist(tmp_path, np.zeros(0, np.uint8))
    rc, line = run_cli(["--set", "data.dataset=mnist", "--set", f"data.data_dir={tmp_path}", "--set", "model.name=logreg"],
                       tmp_path / "run", capsys)
    assert rc == 2
    assert_one_line(line, "t10k-labels-idx1-ubyte.gz", "MNIST test split is empty")


def test_mnist_damaged_gzip_names_the_file(tmp_path):
    write_mnist(tmp_path, np.array([1, 2]))
    bad = tmp_path / "train-images-idx3-ubyte.gz"
    bad.write_bytes(bad.read_bytes()[:30])
    with pytest.raises(DatasetFormatError, match="train-images-idx3-ubyte.gz: cannot be read as an IDX file"):
        load_dataset("mnist", data_dir=tmp_path)


def test_svhn_fractional_labels_and_empty_split(tmp_path):
    from scipy.io import savemat

    g = np.random.default_rng(0)
    x = g.integers(0, 256, (32, 32, 3, 3), dtype=np.uint8)
    savemat(tmp_path / "train_32x32.mat", {"X": x, "y": np.array([[1.0], [2.5], [10.0]])})
    with pytest.raises(DatasetFormatError, match=r"train_32x32\.mat: y: labels must be integer class ids, found 2\.5"):
        load_dataset("svhn", data_dir=tmp_path)
    savemat(tmp_path / "train_32x32.mat", {"X": x, "y": np.array([[1], [11], [10]], np.uint8)})
    with pytest.raises(DatasetFormatError, match=r"train_32x32\.mat: y: .*train label 11"):
        load_dataset("svhn", data_dir=tmp_path)
    savemat(tmp_path / "test_32x32.mat", {"X": np.zeros((32, 32, 3, 0), np.uint8), "y": np.zeros((0, 1), np.uint8)})
    with pytest.raises(DatasetFormatError, match=r"test_32x32\.mat: the SVHN test split is empty"):
        load_dataset("svhn", data_dir=tmp_path, split="test")
    (tmp_path / "train_32x32.mat").write_bytes(b"MATLAB 5.0 MAT-file, truncated")
    with pytest.raises(DatasetFormatError, match=r"train_32x32\.mat cannot be read as a MATLAB file"):
        load_dataset("svhn", data_dir=tmp_path)


def test_femnist_label_out_of_range_names_the_label(tmp_path):
    for split in ("train", "test"):
        (tmp_path / split).mkdir()
        y = [1, 70] if split == "test" else [1, 2]
        obj = {"users": ["w"], "num_samples": [2], "user_data": {"w": {"x": [[0.5] * 784] * 2, "y": y}}}
        (tmp_path / split / "part.json").write_text(json.dumps(obj))
    with pytest.raises(DatasetFormatError, match=r"test/part\.json: user 'w': label 70 lies outside 0\.\.61"):
        load_dataset("femnist", data_dir=tmp_path)


# ------------------------------------------------------------------------------------------------
# Empty splits handed in directly, partition sizes named by their config fields
# ------------------------------------------------------------------------------------------------
def test_empty_split_given_directly_is_refused():
    train = ArrayDataset(torch.zeros(8, 1, 4, 4), torch.arange(8) % 2, 2, name="toy", split="train")
    test = ArrayDataset(torch.zeros(0, 1, 4, 4), torch.zeros(0, dtype=torch.int64), 2, name="toy", split="test")
    with pytest.raises(DataConfigError, match="the test split of toy is empty"):
        build_federated_data((train, test), num_clients=2, partition="iid")
    with pytest.raises(DataConfigError, match="the training split of toy is empty"):
        build_federated_data((test, train), num_clients=2, partition="iid")
    with pytest.raises(DataConfigError, match=r"toy train labels must lie in \[0, 2\)"):
        ArrayDataset(torch.zeros(2, 1, 4, 4), torch.tensor([0, 2]), 2, name="toy", split="train")


def test_min_partition_size_named_by_its_config_field(tmp_path, capsys):
    rc = main(["train", "--set", "data.dataset=synthetic", "--set", "data.synthetic_size=40", "--set", "data.num_clients=5",
               "--set", "data.min_partition_size=10", "--set", "train.rounds=1", "--set", "threads=1",
               "--out", str(tmp_path / "run"), "--quiet"])
    line = capsys.readouterr().err.strip()
    assert rc == 2
    assert_one_line(line, "data.min_partition_size", "data.num_clients", "50 in all", "holds 40")
