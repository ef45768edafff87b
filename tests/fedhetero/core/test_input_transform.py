"""A trained model carries its preprocessing: ``model.json`` records the input, and
``fedhetero.load_transform(run)`` turns images as the data set's release stores them into exactly
the tensors the run's loader made of them (bit for bit), so that the loaded model classifies raw
images with the run's own test accuracy."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.datasets import load_digits

import fedhetero
from fedhetero.core.common.configfile import load_config
from fedhetero.core.run.engine import Engine
from fedhetero.data import InputTransform, digits_split, load_dataset
from fedhetero.data.datasets import read_idx

ROOT = Path(__file__).resolve().parents[3]
FMNIST = Path(os.environ.get("FEDHETERO_FASHION_MNIST", ROOT.parent / "shared" / "data" / "fashion-mnist"))


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "r"
    cfg = load_config(None, ["train.rounds=3", "algorithm.name=fedavg", "data.num_clients=10"])
    result = Engine(cfg, out, progress=False).run()
    return out, result.summary


def test_model_json_records_the_input(digits_run):
    out, _ = digits_run
    record = json.loads((out / "model.json").read_text())["input"]
    train = load_dataset("digits")
    assert record == {"dataset": "digits", "shape": [1, 32, 32], "mean": list(train.mean), "std": list(train.std),
                      "raw": {"pixel_max": 16.0, "layout": "HW", "resize": {"size": 32, "mode": "bilinear"}}}


def test_raw_digits_through_the_transform_give_the_runs_test_accuracy(digits_run):
    out, summary = digits_run
    model = fedhetero.load_model(out)
    prepare = fedhetero.load_transform(out)
    digits = load_digits()
    _, test = digits_split()
    x = prepare(digits.images[test])
    assert torch.equal(x, load_dataset("digits", split="test").images)  # what the run tested on
    with torch.no_grad():
        pred = model(x).argmax(1).numpy()
    assert float((pred == digits.target[test]).mean()) == summary["final_accuracy"]
    # one image, unbatched, as a tensor: the same row
    assert torch.equal(prepare(torch.from_numpy(digits.images[test[0]])), x[:1])
    # the raw images are not what the model takes: the transform says what it expects
    with pytest.raises(ValueError, match=r"raw images in layout HW.*0\.\.16.*\(2, 3, 8, 8\)"):
        prepare(np.zeros((2, 3, 8, 8)))


def test_the_callers_array_is_never_changed():
    t = InputTransform(load_dataset("digits", split="test").input_record())
    raw = torch.full((2, 8, 8), 16.0)
    t(raw)
    assert torch.equal(raw, torch.full((2, 8, 8), 16.0))
    plain = InputTransform({"shape": [1, 4, 4], "mean": [0.5], "std": [0.25], "raw": None})
    x = torch.ones(1, 1, 4, 4)
    assert torch.equal(plain(x), torch.full((1, 1, 4, 4), 2.0)) and torch.equal(x, torch.ones(1, 1, 4, 4))


@settings(max_examples=15, deadline=None)
@given(size=st.sampled_from([8, 12, 32]), mode=st.sampled_from(["bilinear", "nearest"]), normalize=st.booleans(),
       split=st.sampled_from(["train", "test"]), seed=st.integers(0, 3))
def test_every_digits_option_is_reproduced_bit_for_bit(size, mode, normalize, split, seed):
    """Invariant: for every loader option, transform(raw rows of the split) == the loader's images."""
    ds = load_dataset("digits", split=split, size=size, interpolation=mode, normalize=normalize, split_seed=seed)
    train, test = digits_split(split_seed=seed)
    rows = train if split == "train" else test
    assert torch.equal(InputTransform(ds.input_record())(load_digits().images[rows]), ds.images)


def test_uint8_colour_images_follow_the_hwc_layout():
    """CIFAR, SVHN and DermaMNIST store uint8 H×W×C images: scaled by 255 and moved to C×H×W."""
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(3, 6, 6, 3), dtype=np.uint8)
    t = InputTransform({"shape": [3, 6, 6], "mean": [0.5, 0.4, 0.3], "std": [0.2, 0.2, 0.1],
                        "raw": {"pixel_max": 255.0, "layout": "HWC", "resize": None}})
    want = torch.from_numpy(raw).permute(0, 3, 1, 2).to(torch.float32).div(255.0)
    want = (want - torch.tensor([0.5, 0.4, 0.3]).view(1, 3, 1, 1)) / torch.tensor([0.2, 0.2, 0.1]).view(1, 3, 1, 1)
    assert torch.equal(t(raw), want)


@pytest.mark.skipif(not FMNIST.is_dir(),
                    reason="set FEDHETERO_FASHION_MNIST to the folder of the official Fashion-MNIST IDX files")
def test_fashion_mnist_idx_images_become_the_loaders_images():
    root = FMNIST
    for split, stem in (("train", "train-images-idx3-ubyte"), ("test", "t10k-images-idx3-ubyte")):
        ds = load_dataset("fashion_mnist", split=split, data_dir=root)
        files = [p for p in root.rglob(stem + "*")]
        assert files, f"no {stem} under {root}"
        assert torch.equal(InputTransform(ds.input_record())(read_idx(files[0], 3)), ds.images)
