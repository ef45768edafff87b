"""The session partition (fedhetero.data.partition: ``overlap_label_split``, ``session_groups``): two
device groups with overlapping label sets, balanced quotas, and the config's overlap reaching the
partition."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedhetero.core.common.options import ConfigError
from fedhetero.data.partition import overlap_label_split, session_groups
from _util import SESSION_BASE, session_cfg


BASE = SESSION_BASE


_cfg = session_cfg


# ---------------------------------------------------------------------------- label split / partition
@pytest.mark.parametrize(
    "classes, overlap, a, b",
    [
        (10, 0.2, list(range(0, 5)), list(range(4, 9))),
        (100, 0.2, list(range(0, 55)), list(range(44, 99))),
        (200, 0.2, list(range(0, 111)), list(range(89, 200))),
        (4, 0.8, [0, 1, 2], [1, 2, 3]),
        (4, 0.0, [0, 1], [2, 3]),
        (10, 0.0, list(range(5)), list(range(5, 10))),
    ],
)
def test_label_split_per_overlap(classes, overlap, a, b):
    got_a, got_b = overlap_label_split(classes, overlap)
    assert got_a == a and got_b == b


def test_label_split_rejects_bad_overlap():
    with pytest.raises(ValueError, match="overlap"):
        overlap_label_split(10, 1.0)


@pytest.mark.parametrize("classes, per_class, overlap, size, steps", [(10, 6000, 0.0, 300, 3), (100, 500, 0.2, 275, 3)])
def test_session_groups_sizes_and_labels(classes, per_class, overlap, size, steps):
    """Balanced quotas (FMNIST: 300 samples, 3 steps of 128; CIFAR-100 o=0.2: 275, 3 steps), every
    sample of a group's labels dealt once inside the group, only the group's labels."""
    labels = np.repeat(np.arange(classes), per_class)
    parts = session_groups(labels, 200, overlap, 0.3, np.random.default_rng(0))
    a_cls, b_cls = overlap_label_split(classes, overlap)
    for group, cls in ((parts[:100], a_cls), (parts[100:], b_cls)):
        sizes = [len(p) for p in group]
        assert max(sizes) - min(sizes) <= 1 and min(sizes) == size
        assert math.ceil(size / 128) == steps
        rows = np.concatenate(group)
        assert len(np.unique(rows)) == len(rows) == per_class * len(cls)  # each sample once in the group
        assert set(np.unique(labels[rows])) == set(cls)
    # the Dirichlet mix makes devices unlike each other: a device's top class is far above its
    # share under a uniform mix
    hist = np.stack([np.bincount(labels[p], minlength=classes) for p in parts[:100]])
    assert (hist.max(1) / hist.sum(1)).mean() > 2.0 / len(a_cls)


def test_session_groups_needs_an_even_count():
    with pytest.raises(ConfigError, match="even"):
        _cfg(**{"data.num_clients": 21})


@pytest.mark.parametrize("overlap, b_labels", [(0.0, {5, 6, 7, 8, 9}), (0.2, {4, 5, 6, 7, 8})])
def test_config_overlap_reaches_the_partition(overlap, b_labels):
    from fedhetero.core.local.context import build_data

    data = build_data(_cfg(**{"data.group_overlap": overlap}))
    labels = data.train.labels_np
    assert set(np.unique(labels[np.concatenate(data.client_indices[10:])]).tolist()) == b_labels
    assert set(np.unique(labels[np.concatenate(data.client_indices[:10])]).tolist()) == {0, 1, 2, 3, 4}
