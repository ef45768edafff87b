"""SVHN from its .mat files: the real format written here, small."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch


# ---------------------------------------------------------------------------- SVHN and the study's models
def _write_svhn(folder: Path, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    from scipy.io import savemat

    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, size=(32, 32, 3, n), dtype=np.uint8)
    y = rng.integers(1, 11, size=(n, 1)).astype(np.uint8)
    folder.mkdir(parents=True, exist_ok=True)
    savemat(folder / ("train_32x32.mat" if seed == 0 else "test_32x32.mat"), {"X": x, "y": y})
    return x, y


def test_svhn_mat_loader(tmp_path):
    from fedhetero.data import load_dataset
    from fedhetero.data.errors import DatasetFormatError, DatasetNotFoundError

    with pytest.raises(DatasetNotFoundError, match="train_32x32.mat"):
        load_dataset("svhn", data_dir=tmp_path)
    x, y = _write_svhn(tmp_path / "svhn", 12, 0)
    _write_svhn(tmp_path / "svhn", 5, 1)
    raw = load_dataset("svhn", data_dir=tmp_path, normalize=False)
    assert raw.images.shape == (12, 3, 32, 32) and raw.num_classes == 10
    assert torch.equal(raw.images[3, 1], torch.from_numpy(x[:, :, 1, 3].astype(np.float32)) / 255.0)
    want = np.where(y.reshape(-1) == 10, 0, y.reshape(-1))
    assert raw.labels.tolist() == want.tolist()
    norm = load_dataset("svhn", data_dir=tmp_path, split="test", normalize=True)
    raw_test = load_dataset("svhn", data_dir=tmp_path, split="test", normalize=False)
    assert norm.images.shape[0] == 5
    assert torch.allclose(norm.images[:, 2], (raw_test.images[:, 2] - 0.4728) / 0.1970)
    from scipy.io import savemat

    savemat(tmp_path / "svhn" / "train_32x32.mat", {"X": x, "y": np.zeros((12, 1), np.uint8)})
    with pytest.raises(DatasetFormatError, match="labels must be 1..10"):
        load_dataset("svhn", data_dir=tmp_path)
