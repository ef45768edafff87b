"""Data set loaders (fedhetero.data.datasets): digits and synthetic, and CIFAR-10/100 and DermaMNIST
from files written here in their real on-disk formats (missing and hostile files included)."""

from __future__ import annotations

import os
import pickle
import tarfile

import numpy as np
import pytest
import torch

from fedhetero.data import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    ArrayDataset,
    DataConfigError,
    DatasetFormatError,
    DatasetNotFoundError,
    load_dataset,
)


@pytest.fixture(scope="module")
def digits() -> tuple[ArrayDataset, ArrayDataset]:
    return load_dataset("digits", split="train"), load_dataset("digits", split="test")


# ------------------------------------------------------------------------------------------------
# digits / synthetic
# ------------------------------------------------------------------------------------------------
def test_digits_offline_shape_and_classes(digits):
    train, test = digits
    assert train.input_shape == (1, 32, 32)
    assert train.images.dtype == torch.float32 and train.labels.dtype == torch.int64
    assert train.num_classes == 10 and test.num_classes == 10
    assert len(train) + len(test) == 1797
    assert (len(train), len(test)) == (1438, 359)
    assert set(train.labels.tolist()) == set(range(10)) == set(test.labels.tolist())
    # stratified 80/20: every class has ~20 % of its images in test
    all_counts = train.label_histogram() + test.label_histogram()
    assert np.all(np.abs(test.label_histogram() - 0.2 * all_counts) <= 1)
    # normalised with the train statistics
    assert abs(float(train.images.mean())) < 1e-5
    assert abs(float(train.images.std()) - 1.0) < 1e-3
    assert train.mean is not None and 0.0 < train.mean[0] < 1.0


def test_digits_deterministic_and_raw_values(digits):
    train, _ = digits
    again = load_dataset("digits")
    assert torch.equal(train.images, again.images) and torch.equal(train.labels, again.labels)
    raw = load_dataset("digits", normalize=False, interpolation="nearest")
    assert raw.mean is None and float(raw.images.min()) >= 0.0 and float(raw.images.max()) <= 1.0
    # nearest upsampling 8 -> 32 repeats each pixel in a 4x4 block
    img = raw.images[0, 0]
    assert torch.equal(img, img[::4, ::4].repeat_interleave(4, 0).repeat_interleave(4, 1))
    # normalised = (raw - mean) / std on the same split (bilinear default)
    raw_b = load_dataset("digits", normalize=False)
    expect = (raw_b.images - train.mean[0]) / train.std[0]
    assert float((expect - train.images).abs().max()) <= 1e-5 * float(train.images.abs().max())


def test_synthetic_configurable_and_seeded():
    a = load_dataset("synthetic", num_samples=120, num_test=30, num_classes=4, input_shape=(2, 8, 6), seed=3)
    b = load_dataset("synthetic", num_samples=120, num_test=30, num_classes=4, input_shape=(2, 8, 6), seed=3)
    t = load_dataset("synthetic", split="test", num_samples=120, num_test=30, num_classes=4, input_shape=(2, 8, 6), seed=3)
    assert a.input_shape == (2, 8, 6) and len(a) == 120 and len(t) == 30 and a.num_classes == 4
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    assert a.label_histogram().tolist() == [30, 30, 30, 30]
    c = load_dataset("synthetic", num_samples=120, num_classes=4, input_shape=(2, 8, 6), seed=4)
    assert not torch.equal(a.images, c.images)
    # class-conditional: nearest class mean classifies the test split well
    means = torch.stack([a.images[a.labels == k].mean(0) for k in range(4)])
    d = ((t.images[:, None] - means[None]) ** 2).flatten(2).sum(-1)
    assert float((d.argmin(1) == t.labels).float().mean()) > 0.9


def test_bad_names_and_options():
    with pytest.raises(DataConfigError, match="unknown dataset"):
        load_dataset("imagenet21k")
    with pytest.raises(DataConfigError, match="split"):
        load_dataset("digits", split="val")
    with pytest.raises(DataConfigError, match="unknown option"):
        load_dataset("digits", colour=True)
    with pytest.raises(DataConfigError, match="input_shape"):
        load_dataset("synthetic", input_shape=(3, 32))


# ------------------------------------------------------------------------------------------------
# CIFAR / DermaMNIST in their real on-disk formats
# ------------------------------------------------------------------------------------------------
def write_cifar_batch(path, data: np.ndarray, labels: list[int], label_key: bytes) -> None:
    obj = {b"batch_label": b"testing batch", label_key: labels, b"data": data,
           b"filenames": [b"img%d.png" % i for i in range(len(labels))]}
    with open(path, "wb") as fh:
        pickle.dump(obj, fh, protocol=2)


def make_cifar10(root, per_batch: int = 6, seed: int = 0):
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    g = np.random.default_rng(seed)
    datas, labels = {}, {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        datas[name] = g.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        labels[name] = g.integers(0, 10, per_batch).tolist()
        write_cifar_batch(folder / name, datas[name], labels[name], b"labels")
    names = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse", b"ship", b"truck"]
    with open(folder / "batches.meta", "wb") as fh:
        pickle.dump({b"label_names": names, b"num_cases_per_batch": per_batch}, fh, protocol=2)
    return datas, labels


def test_cifar10_loader_real_format(tmp_path):
    datas, labels = make_cifar10(tmp_path)
    train = load_dataset("cifar10", data_dir=tmp_path)
    test = load_dataset("cifar10", data_dir=tmp_path, split="test")
    assert train.input_shape == (3, 32, 32) and len(train) == 30 and len(test) == 6
    assert train.num_classes == 10 and train.default_augment
    expect = np.concatenate([datas[f"data_batch_{i}"] for i in range(1, 6)]).reshape(-1, 3, 32, 32) / 255.0
    mean = np.array(CIFAR10_MEAN).reshape(1, 3, 1, 1)
    std = np.array(CIFAR10_STD).reshape(1, 3, 1, 1)
    got = train.images.double().numpy() * std + mean
    assert np.max(np.abs(got - expect)) <= 1e-5
    assert train.labels.tolist() == sum((labels[f"data_batch_{i}"] for i in range(1, 6)), [])
    assert test.labels.tolist() == labels["test_batch"]
    assert train.class_names[0] == "airplane"
    # the folder itself may be given as data_dir
    direct = load_dataset("cifar10", data_dir=tmp_path / "cifar-10-batches-py", split="test")
    assert torch.equal(direct.images, test.images)


def test_cifar10_tarball_is_extracted(tmp_path):
    src = tmp_path / "src"
    datas, _ = make_cifar10(src, per_batch=2)
    dest = tmp_path / "data"
    dest.mkdir()
    with tarfile.open(dest / "cifar-10-python.tar.gz", "w:gz") as tar:
        tar.add(src / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    test = load_dataset("cifar10", data_dir=dest, split="test", normalize=False)
    assert len(test) == 2
    assert np.array_equal((test.images.numpy() * 255).round().astype(np.uint8).reshape(2, -1), datas["test_batch"])


def test_cifar100_loader_real_format(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    g = np.random.default_rng(1)
    for name, n in (("train", 12), ("test", 5)):
        obj = {b"filenames": [b"x"] * n, b"batch_label": b"b", b"fine_labels": g.integers(0, 100, n).tolist(),
               b"coarse_labels": g.integers(0, 20, n).tolist(), b"data": g.integers(0, 256, (n, 3072), dtype=np.uint8)}
        with open(folder / name, "wb") as fh:
            pickle.dump(obj, fh, protocol=2)
        if name == "test":
            test_labels = obj[b"fine_labels"]
    train = load_dataset("cifar100", data_dir=tmp_path)
    test = load_dataset("cifar100", data_dir=tmp_path, split="test")
    assert train.num_classes == 100 and len(train) == 12 and test.labels.tolist() == test_labels
    assert train.input_shape == (3, 32, 32)


def test_cifar_refuses_arbitrary_pickles(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()

    class Evil:
        def __reduce__(self):
            return (os.getcwd, ())

    for name in ("train", "test"):
        with open(folder / name, "wb") as fh:
            pickle.dump({b"data": Evil(), b"fine_labels": [0]}, fh, protocol=2)
    with pytest.raises(DatasetFormatError, match="refusing"):
        load_dataset("cifar100", data_dir=tmp_path)


def test_missing_files_name_files_and_directory(tmp_path):
    with pytest.raises(DatasetNotFoundError) as e10:
        load_dataset("cifar10", data_dir=tmp_path)
    msg = str(e10.value)
    assert isinstance(e10.value, FileNotFoundError)
    for needle in ("data_batch_1", "data_batch_5", "test_batch", "cifar-10-batches-py", str(tmp_path),
                   "--set data.data_dir=DIR", "data.data_dir", "cifar-10-python.tar.gz"):
        assert needle in msg
    with pytest.raises(DatasetNotFoundError) as e100:
        load_dataset("cifar100", data_dir=tmp_path, split="test")
    for needle in ("cifar-100-python", "train", "test", str(tmp_path), "--set data.data_dir=DIR", "cifar-100-python.tar.gz"):
        assert needle in str(e100.value)
    with pytest.raises(DatasetNotFoundError) as ed:
        load_dataset("dermamnist", data_dir=tmp_path)
    for needle in ("dermamnist.npz", str(tmp_path), "--set data.data_dir=DIR", "data.data_dir", "zenodo"):
        assert needle in str(ed.value)


def make_derma(path, seed=0, sizes=(20, 6, 9), hw=28):
    g = np.random.default_rng(seed)
    arrays = {}
    for split, n in zip(("train", "val", "test"), sizes):
        arrays[f"{split}_images"] = g.integers(0, 256, (n, hw, hw, 3), dtype=np.uint8)
        arrays[f"{split}_labels"] = g.integers(0, 7, (n, 1)).astype(np.uint8)
    np.savez_compressed(path, **arrays)
    return arrays


def test_dermamnist_loader_real_format(tmp_path):
    arrays = make_derma(tmp_path / "dermamnist.npz")
    train = load_dataset("dermamnist", data_dir=tmp_path)
    test = load_dataset("dermamnist", data_dir=tmp_path, split="test")
    assert train.input_shape == (3, 28, 28) and train.num_classes == 7
    assert len(train) == 20 and len(test) == 9
    assert train.labels.tolist() == arrays["train_labels"].ravel().tolist()
    # train statistics normalise both splits
    assert abs(float(train.images.mean())) < 1e-5
    raw = torch.from_numpy(arrays["test_images"]).permute(0, 3, 1, 2).double() / 255
    mean = torch.tensor(train.mean).view(1, 3, 1, 1)
    std = torch.tensor(train.std).view(1, 3, 1, 1)
    assert float(((raw - mean) / std - test.images.double()).abs().max()) <= 1e-5 * float(test.images.abs().max())
    both = load_dataset("dermamnist", data_dir=tmp_path, include_val=True, resize=32)
    assert len(both) == 26 and both.input_shape == (3, 32, 32)


def test_dermamnist_bad_file(tmp_path):
    np.savez(tmp_path / "dermamnist.npz", train_images=np.zeros((2, 28, 28, 3), np.uint8))
    with pytest.raises(DatasetFormatError, match="lacks key"):
        load_dataset("dermamnist", data_dir=tmp_path)
