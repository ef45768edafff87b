"""Tests of fedhetero.data: loaders (real on-disk formats), partitions, server split, batches."""

from __future__ import annotations

import json
import os
import pickle
import tarfile
import time

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
    FederatedData,
    build_federated_data,
    dirichlet,
    iid,
    iterate_batches,
    js_divergence,
    label_histograms,
    load_dataset,
    load_partition,
    make_partition,
    non_iid_degree,
    num_batches,
    partition_stats,
    pathological,
    random_crop_flip,
    save_partition,
    shards,
    split_public,
    split_server,
    validate_partition,
)


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


@pytest.fixture(scope="module")
def digits() -> tuple[ArrayDataset, ArrayDataset]:
    return load_dataset("digits", split="train"), load_dataset("digits", split="test")


def balanced_labels(n: int, c: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.arange(n) % c)


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


# ------------------------------------------------------------------------------------------------
# partitions
# ------------------------------------------------------------------------------------------------

PARTITION_CASES = {
    "iid": dict(),
    "dirichlet": dict(alpha=0.5),
    "shards": dict(shards_per_client=2),
    "pathological": dict(classes_per_client=3),
}


@pytest.mark.parametrize("name", sorted(PARTITION_CASES))
def test_partitions_disjoint_complete_nonempty_reproducible(name):
    y = balanced_labels(3000, 10)
    kw = PARTITION_CASES[name]
    a = make_partition(name, y, 37, rng(5), **kw)
    b = make_partition(name, y, 37, rng(5), **kw)
    c = make_partition(name, y, 37, rng(6), **kw)
    assert len(a) == 37
    validate_partition(a, len(y))  # raises unless disjoint, complete, non-empty
    all_idx = np.concatenate(a)
    assert len(all_idx) == len(y) and np.array_equal(np.sort(all_idx), np.arange(len(y)))
    assert min(len(p) for p in a) >= 1
    assert all(np.array_equal(p, q) for p, q in zip(a, b))
    assert any(not np.array_equal(p, q) for p, q in zip(a, c))
    assert all(p.dtype == np.int64 and np.all(np.diff(p) > 0) for p in a)


def test_iid_sizes_equal():
    parts = iid(np.zeros(103, np.int64), 10, rng())
    sizes = sorted(len(p) for p in parts)
    assert sizes[0] == 10 and sizes[-1] == 11 and sum(sizes) == 103


def test_dirichlet_small_alpha_fast_no_empty_and_repaired():
    y = balanced_labels(50_000, 10)
    report: dict = {}
    t0 = time.perf_counter()
    parts = dirichlet(y, 100, 0.01, rng(0), min_size=10, max_retries=100, report=report)
    elapsed = time.perf_counter() - t0
    assert elapsed < 1.0
    validate_partition(parts, len(y))
    assert min(len(p) for p in parts) >= 10
    assert report["attempts"] == 101 and report["moved"] > 0
    # the same call repairs identically
    again = dirichlet(y, 100, 0.01, rng(0), min_size=10, max_retries=100)
    assert all(np.array_equal(p, q) for p, q in zip(parts, again))


def test_dirichlet_tight_min_size_and_infeasible():
    y = balanced_labels(200, 4)
    parts = dirichlet(y, 20, 0.001, rng(2), min_size=10, max_retries=3)
    validate_partition(parts, 200)
    assert [len(p) for p in parts] == [10] * 20
    with pytest.raises(DataConfigError, match="min_size"):
        dirichlet(y, 21, 0.5, rng(), min_size=10)
    with pytest.raises(DataConfigError, match="alpha"):
        dirichlet(y, 4, 0.0, rng())
    with pytest.raises(TypeError, match="rng"):
        dirichlet(y, 4, 0.5, 0)


def test_dirichlet_alpha_controls_skew():
    y = balanced_labels(20_000, 10)
    glob = np.full(10, 0.1)
    skewed = dirichlet(y, 20, 0.05, rng(1))
    even = dirichlet(y, 20, 1000.0, rng(1))
    h_skew = label_histograms(y, skewed, 10)
    h_even = label_histograms(y, even, 10)
    js_skew = non_iid_degree(h_skew, glob)
    js_even = non_iid_degree(h_even, glob)
    assert float(np.mean(js_skew)) > 0.4
    assert float(np.max(js_even)) < 0.01
    assert float(np.mean((h_skew > 0).sum(1))) < 5
    assert np.all((h_even > 0).sum(1) == 10)
    sizes = h_even.sum(1)
    assert sizes.max() / sizes.min() < 1.2  # near-uniform sizes too


def test_dirichlet_self_balancing():
    y = balanced_labels(5000, 10)
    plain = dirichlet(y, 10, 0.1, rng(3))
    bal = dirichlet(y, 10, 0.1, rng(3), self_balancing=True)
    validate_partition(bal, 5000)
    spread = lambda parts: np.std([len(p) for p in parts])  # noqa: E731
    assert spread(bal) < spread(plain)


def test_shards_label_count_and_sizes():
    y = balanced_labels(40_000, 10)
    parts = shards(y, 100, 2, rng(0))
    assert all(len(p) == 400 for p in parts)
    hist = label_histograms(y, parts, 10)
    assert np.all((hist > 0).sum(1) <= 2)
    with pytest.raises(DataConfigError, match="shards"):
        shards(y[:50], 30, 2, rng())


def test_pathological_exact_classes():
    y = balanced_labels(1000, 10)
    parts = pathological(y, 15, 3, rng(0))
    hist = label_histograms(y, parts, 10)
    assert np.all((hist > 0).sum(1) == 3)
    with pytest.raises(DataConfigError, match="classes_per_client"):
        pathological(y, 3, 2, rng())


def test_partition_stats_and_unknown_name():
    y = balanced_labels(100, 5)
    parts = iid(y, 4, rng())
    st = partition_stats(y, parts, 5)
    assert st["sizes"] == [25, 25, 25, 25] and st["empty_clients"] == 0
    assert np.array(st["label_hist"]).sum() == 100
    assert st["empty_class_counts"] == [5 - k for k in st["classes_per_client"]]
    json.dumps(st)
    with pytest.raises(DataConfigError, match="accepted"):
        make_partition("quantity", y, 4, rng())
    with pytest.raises(DataConfigError, match="more than one client"):
        validate_partition([np.array([0, 1]), np.array([1, 2])], 3)


# ------------------------------------------------------------------------------------------------
# JS non-IID degree and server / public splits
# ------------------------------------------------------------------------------------------------


def test_js_hand_computed_two_and_three_classes():
    # p = [1, 0], q = [.5, .5]: m = [.75, .25]
    expect2 = 0.5 * np.log2(1 / 0.75) + 0.5 * (0.5 * np.log2(0.5 / 0.75) + 0.5 * np.log2(0.5 / 0.25))
    assert abs(js_divergence([1, 0], [0.5, 0.5]) - expect2) < 1e-12
    assert abs(expect2 - 0.3112781244591328) < 1e-12
    # p = [1, 0, 0], q uniform: ½·log2(3/2) + ½·(1/3) = 0.45914791...
    expect3 = 0.5 * np.log2(1.5) + 0.5 / 3
    assert abs(js_divergence([1, 0, 0], [1, 1, 1]) - expect3) < 1e-12
    assert abs(js_divergence([1, 0, 0], [1, 1, 1], base="e") - expect3 * np.log(2)) < 1e-12
    # counts or probabilities; symmetric; identical -> 0; disjoint -> 1 (base 2)
    assert abs(js_divergence([30, 10, 0], [2, 1, 1]) - js_divergence([0.75, 0.25, 0], [0.5, 0.25, 0.25])) < 1e-12
    assert abs(js_divergence([3, 1, 0], [1, 1, 2]) - js_divergence([1, 1, 2], [3, 1, 0])) < 1e-12
    assert js_divergence([2, 2, 1], [4, 4, 2]) == 0.0
    assert abs(js_divergence([1, 0], [0, 1]) - 1.0) < 1e-12
    with pytest.raises(DataConfigError):
        js_divergence([0, 0], [1, 1])


def test_non_iid_degree_paper_check_values():
    uni10 = np.full(10, 0.1)
    two = [1, 1] + [0] * 8
    five = [1] * 5 + [0] * 5
    assert round(non_iid_degree(two, uni10), 3) == 0.610
    assert round(non_iid_degree(five, uni10), 3) == 0.311
    assert non_iid_degree(np.ones(10), uni10) == 0.0
    uni100 = np.ones(100)
    assert round(non_iid_degree([1] * 20 + [0] * 80, uni100), 3) == 0.610
    assert round(non_iid_degree([1] * 50 + [0] * 50, uni100), 3) == 0.311
    rows = non_iid_degree(np.array([two, five]), uni10)
    assert rows.shape == (2,) and abs(rows[0] - non_iid_degree(two, uni10)) < 1e-15
    # rounding frequencies to 3 decimals (authors' code) changes the value only slightly
    third = [1, 1, 1] + [0] * 7
    r = non_iid_degree(third, uni10, round_decimals=3)
    assert r != non_iid_degree(third, uni10) and abs(r - non_iid_degree(third, uni10)) < 1e-2


def test_split_server_classes_sizes_and_degree():
    y = balanced_labels(5000, 10)
    s = split_server(y, 1000, rng(4), classes=5)
    assert len(s.indices) == 1000 and len(s.classes) == 5
    counts = np.bincount(y[s.indices], minlength=10)
    assert sorted(counts[list(s.classes)].tolist()) == [200] * 5
    assert counts.sum() == counts[list(s.classes)].sum()
    assert len(np.intersect1d(s.indices, s.remaining)) == 0
    assert np.array_equal(np.union1d(s.indices, s.remaining), np.arange(5000))
    expect = non_iid_degree(np.bincount(y[s.indices], minlength=10), np.bincount(y[s.remaining], minlength=10))
    assert abs(s.non_iid_degree - expect) < 1e-15
    # same generator state -> same split
    s2 = split_server(y, 1000, rng(4), classes=5)
    assert np.array_equal(s.indices, s2.indices) and s.classes == s2.classes
    # fraction of data and of classes, explicit list
    s3 = split_server(y, 0.1, rng(), classes=0.2)
    assert len(s3.indices) == 500 and len(s3.classes) == 2
    s4 = split_server(y, 30, rng(), classes=[1, 7])
    assert set(np.unique(y[s4.indices])) == {1, 7} and len(s4.indices) == 30
    with pytest.raises(DataConfigError, match="exceeds"):
        split_server(y, 1200, rng(), classes=[1, 2])
    with pytest.raises(DataConfigError, match="server_classes"):
        split_server(y, 10, rng(), classes=11)


def test_split_server_paper_degrees_with_uniform_devices():
    # device pool uniform over 10 classes; server from 5 (2) classes -> 0.311 (0.610)
    y = balanced_labels(20_000, 10)
    dev, tail = np.arange(15_000), np.arange(15_000, 20_000)
    glob = np.bincount(y[dev], minlength=10)
    for k, expect in ((5, 0.311), (2, 0.610)):
        s = split_server(y, 1000, rng(k), classes=k, pool=tail)
        assert np.all(s.indices >= 15_000)
        assert round(non_iid_degree(np.bincount(y[s.indices], minlength=10), glob), 2) == round(expect, 2)


def test_split_public():
    pub, rest = split_public(100, 0.1, rng())
    assert len(pub) == 10 and len(rest) == 90 and len(np.intersect1d(pub, rest)) == 0
    pub2, _ = split_public(100, 0.1, rng())
    assert np.array_equal(pub, pub2)
    none, all_ = split_public(np.arange(5, 15), 0, rng())
    assert len(none) == 0 and np.array_equal(all_, np.arange(5, 15))


# ------------------------------------------------------------------------------------------------
# FederatedData
# ------------------------------------------------------------------------------------------------


def test_build_federated_data_digits(digits, tmp_path):
    fd = build_federated_data(
        digits, num_clients=12, partition="dirichlet", alpha=0.3, server_fraction=0.1,
        server_classes=5, public_fraction=0.1, rng=7,
    )
    assert isinstance(fd, FederatedData)
    assert fd.num_classes == 10 and fd.input_shape == (1, 32, 32) and fd.num_clients == 12
    n = len(fd.train)
    pieces = fd.client_indices + [fd.server_indices, fd.public_indices]
    validate_partition(pieces, n)  # clients, server and public: disjoint and covering the train set
    assert len(fd.public_indices) == round(0.1 * n) and len(fd.server_indices) == round(0.1 * n)
    assert (fd.server_label_hist() > 0).sum() == 5
    assert all(fd.client_num_samples(k) >= 10 for k in range(12))
    assert sum(fd.client_num_samples(k) for k in range(12)) == n - len(fd.server_indices) - len(fd.public_indices)
    h = fd.client_label_hist(3)
    assert h.sum() == fd.client_num_samples(3)
    assert np.array_equal(fd.client_label_set(3), np.flatnonzero(h))
    glob = fd.global_label_dist()
    assert abs(glob.sum() - 1) < 1e-12
    d0 = fd.server_non_iid_degree()
    assert abs(d0 - non_iid_degree(fd.server_label_hist(), fd.label_hists().sum(0))) < 1e-12
    assert 0.2 < d0 < 0.5
    assert fd.pooled_non_iid_degree(range(12)) < 1e-12
    assert fd.public_inputs().shape == (len(fd.public_indices), 1, 32, 32)
    summary = fd.summary()
    json.dumps(summary)
    assert summary["server_size"] == len(fd.server_indices) and summary["partition"] == "dirichlet"
    # reproducible from the seed
    fd2 = build_federated_data(
        digits, num_clients=12, partition="dirichlet", alpha=0.3, server_fraction=0.1,
        server_classes=5, public_fraction=0.1, rng=7,
    )
    assert all(np.array_equal(a, b) for a, b in zip(fd.client_indices, fd2.client_indices))
    assert np.array_equal(fd.server_indices, fd2.server_indices)
    # partition file round trip
    save_partition(fd, tmp_path / "partition.npz")
    back = load_partition(tmp_path / "partition.npz")
    assert all(np.array_equal(a, b) for a, b in zip(fd.client_indices, back["client_indices"]))
    assert np.array_equal(back["server_indices"], fd.server_indices)
    assert np.array_equal(back["label_hist"], fd.label_hists())
    with pytest.raises(DataConfigError, match="cid"):
        fd.client_num_samples(12)


def test_build_federated_data_by_name_shards_and_device_pool():
    fd = build_federated_data(
        "synthetic", num_clients=10, partition="shards", shards=2, server_fraction=15,
        server_classes=[0, 1], device_pool=0.8, rng=np.random.default_rng(0),
        dataset_options={"num_samples": 500, "num_test": 50, "input_shape": (1, 8, 8)},
    )
    assert fd.input_shape == (1, 8, 8)
    assert np.all(np.concatenate(fd.client_indices) < 400) and np.all(fd.server_indices >= 400)
    assert sum(map(len, fd.client_indices)) == 400 and len(fd.server_indices) == 15
    assert set(np.unique(fd.train.labels_np[fd.server_indices])) == {0, 1}
    assert fd.public_inputs() is None and fd.server_non_iid_degree() > 0.5
    with pytest.raises(DataConfigError, match="partition"):
        build_federated_data("synthetic", partition="random")


# ------------------------------------------------------------------------------------------------
# batches and augmentation
# ------------------------------------------------------------------------------------------------


def test_iterate_batches_covers_each_index_once(digits):
    train, _ = digits
    idx = np.arange(5, 5 + 103) * 3
    g = torch.Generator().manual_seed(0)
    xs, ys = [], []
    for x, y in iterate_batches(train, idx, 16, generator=g):
        assert x.shape[1:] == (1, 32, 32) and x.shape[0] == y.shape[0]
        xs.append(x)
        ys.append(y)
    assert [len(y) for y in ys] == [16] * 6 + [7] and len(ys) == num_batches(103, 16)
    # read the order with a probe dataset whose image is its row number: same generator seed
    g = torch.Generator().manual_seed(0)
    order = torch.cat(list(_index_batches(train, idx, 16, g)))
    assert sorted(order.tolist()) == sorted(idx.tolist())  # every index exactly once
    assert torch.equal(torch.cat(xs), train.images[order]) and torch.equal(torch.cat(ys), train.labels[order])
    # a second epoch with the same generator gives another order; same seed, same order
    g1 = torch.Generator().manual_seed(0)
    e1 = torch.cat([b for b in _index_batches(train, idx, 16, g1)])
    e2 = torch.cat([b for b in _index_batches(train, idx, 16, g1)])
    assert not torch.equal(e1, e2) and torch.equal(e1, order)
    # drop_last and no shuffle
    dl = list(iterate_batches(train, idx, 16, shuffle=False, drop_last=True))
    assert len(dl) == 6 == num_batches(103, 16, drop_last=True)
    assert torch.equal(dl[0][0], train.images[torch.as_tensor(idx[:16])])
    assert torch.equal(dl[0][1], train.labels[torch.as_tensor(idx[:16])])


def _index_batches(ds: ArrayDataset, idx: np.ndarray, bs: int, g: torch.Generator):
    """Run iterate_batches on a dataset whose 'image' is the row number, to read the order."""
    probe = ArrayDataset(
        images=torch.arange(len(ds), dtype=torch.float32).view(-1, 1, 1, 1),
        labels=torch.zeros(len(ds), dtype=torch.int64), num_classes=1,
    )
    for x, _ in iterate_batches(probe, idx, bs, generator=g):
        yield x.view(-1).long()


def test_random_crop_flip_properties():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 3, 10, 10)
    # flip only: each image is itself or its mirror, and both happen
    f = random_crop_flip(x, padding=0, flip=True, generator=g)
    same = [torch.equal(f[i], x[i]) for i in range(12)]
    mirrored = [torch.equal(f[i], x[i].flip(-1)) for i in range(12)]
    assert all(s or m for s, m in zip(same, mirrored)) and any(same) and any(mirrored)
    # crop only: each image is a 10x10 window of the padded image (fill per channel)
    fill = (-1.0, -2.0, -3.0)
    c = random_crop_flip(x, padding=4, flip=False, fill=fill, generator=g)
    padded = torch.tensor(fill).view(1, 3, 1, 1).expand(12, 3, 18, 18).clone()
    padded[:, :, 4:14, 4:14] = x
    for i in range(12):
        assert any(torch.equal(c[i], padded[i, :, r:r + 10, s:s + 10]) for r in range(9) for s in range(9))
    # deterministic given the generator, input untouched
    a = random_crop_flip(x, generator=torch.Generator().manual_seed(5))
    b = random_crop_flip(x, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b) and a.shape == x.shape and not torch.equal(a, x)


def test_iterate_batches_augment_is_reproducible(digits):
    train, _ = digits
    idx = np.arange(40)
    run = lambda s: [x for x, _ in iterate_batches(train, idx, 8, generator=torch.Generator().manual_seed(s), augment=True)]  # noqa: E731
    a, b = run(3), run(3)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    plain = [x for x, _ in iterate_batches(train, idx, 8, generator=torch.Generator().manual_seed(3))]
    assert any(not torch.equal(p, q) for p, q in zip(a, plain))
    with pytest.raises(DataConfigError, match="indices"):
        next(iterate_batches(train, [len(train)], 4))
    with pytest.raises(DataConfigError, match="batch_size"):
        next(iterate_batches(train, idx, 0))


def test_public_source_and_dataset_views():
    opts = {"num_samples": 200, "num_test": 20, "input_shape": (3, 8, 8)}
    train = load_dataset("synthetic", **opts)
    test = load_dataset("synthetic", split="test", **opts)
    with pytest.raises(DataConfigError, match="input shape"):
        build_federated_data((train, test), num_clients=4, partition="iid", public_source="synthetic", rng=1)
    fd = build_federated_data("synthetic", num_clients=4, partition="iid", public_source="synthetic", rng=1,
                              public_fraction=0.5)
    # a separate public source replaces the hold-out: all training rows stay with the clients
    assert sum(map(len, fd.client_indices)) == 1000 and fd.info["public_source"] == "synthetic:train"
    assert fd.public_inputs().shape == (1000, 3, 32, 32)
    sub = train.subset([3, 1])
    assert torch.equal(sub.images, train.images[[3, 1]]) and sub.labels_np.tolist() == train.labels_np[[3, 1]].tolist()
    assert train.to("cpu") is train
    assert train.pixel_fill() == tuple(-m / s for m, s in zip(train.mean, train.std))
