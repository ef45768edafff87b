"""The validation hold-out (``data.val_fraction``): stratified, disjoint from every client and the public
split, absent at zero, reproducible; its accuracy logged and summarised; bad fractions refused."""


import numpy as np
import pytest

from fedhetero.core.common.config import from_dict
from fedhetero.core.common.options import ConfigError
from fedhetero.core.local.context import build_data
from fedhetero.core.run.engine import Engine


# ---------------------------------------------------------------------------- validation hold-out
def _data_cfg(val):
    return from_dict({"seed": 3, "data": {"dataset": "digits", "num_clients": 8, "val_fraction": val,
                                          "public_fraction": 0.1}})


def test_validation_split_is_stratified_disjoint_and_leaves_no_trace_at_zero():
    with_val = build_data(_data_cfg(0.2))
    without = build_data(_data_cfg(0.0))
    val = with_val.val_indices
    assert without.val_indices is None and val is not None
    labels = with_val.train.labels_np
    # stratified: each class holds its share (rounding to whole samples)
    pool = np.setdiff1d(np.arange(len(labels)), with_val.public_indices)
    for c in np.unique(labels):
        assert abs(int(np.sum(labels[val] == c)) - 0.2 * int(np.sum(labels[pool] == c))) <= 0.5
    used = np.concatenate(with_val.client_indices + [with_val.public_indices])
    assert not np.intersect1d(val, used).size  # no client (and not the public split) sees it
    assert len(np.unique(used)) + len(val) == len(labels)
    # without a hold-out nothing is drawn: the public split is that of a run without the option
    assert np.array_equal(without.public_indices, with_val.public_indices)
    assert np.array_equal(build_data(_data_cfg(0.2)).val_indices, val)  # reproducible


def test_validation_accuracy_is_logged_and_summarised(tmp_path):
    cfg = from_dict({"seed": 0, "threads": 1, "data": {"dataset": "digits", "num_clients": 6, "val_fraction": 0.15},
                     "train": {"rounds": 2, "local_epochs": 1}, "algorithm": {"name": "fedavg"}})
    res = Engine(cfg, tmp_path / "r", progress=False).run()
    rows = [r for r in res.metrics if "accuracy" in r]
    assert all(0.0 <= r["val_accuracy"] <= 1.0 for r in rows)
    assert res.summary["final_val_accuracy"] == rows[-1]["val_accuracy"]
    assert res.summary["best_val_accuracy"] == max(r["val_accuracy"] for r in rows)


@pytest.mark.parametrize("bad", [-0.1, 0.6])
def test_validation_fraction_out_of_range_is_one_clear_error(bad):
    with pytest.raises(ConfigError, match="data.val_fraction"):
        from_dict({"data": {"val_fraction": bad}})
