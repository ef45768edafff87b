"""The federated data set (fedhetero.data.federated) and its batches (fedhetero.data.batches): building
it by name or from data sets, saving its partition, a public source, and batches that cover each
index once, with reproducible augmentation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fedhetero.data import (
    ArrayDataset,
    DataConfigError,
    FederatedData,
    build_federated_data,
    iterate_batches,
    load_dataset,
    load_partition,
    non_iid_degree,
    num_batches,
    random_crop_flip,
    save_partition,
    validate_partition,
)


@pytest.fixture(scope="module")
def digits() -> tuple[ArrayDataset, ArrayDataset]:
    return load_dataset("digits", split="train"), load_dataset("digits", split="test")


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
