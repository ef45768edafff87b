"""The trainer's C-allocator tuning (fedhetero.core.run.allocator): freed activation memory stays in
the heap, so a training step stops faulting in fresh pages for every large tensor."""

from __future__ import annotations

import resource
import sys

import pytest
import torch

from fedhetero.core.run.allocator import MMAP_THRESHOLD_MAX, malloc_tuned, tune_malloc


def test_tune_malloc_rejects_bad_thresholds():
    with pytest.raises(ValueError, match="mmap_threshold"):
        tune_malloc(MMAP_THRESHOLD_MAX + 1)
    with pytest.raises(ValueError, match="mmap_threshold"):
        tune_malloc(-1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_tune_malloc_stops_page_faults_of_reallocated_activations():
    if not tune_malloc():
        pytest.skip("not glibc")
    assert malloc_tuned()
    size = 4 * 1024 * 1024  # 16 MiB of float32, above glibc's default mmap threshold
    pages = size * 4 // 4096
    warm = [torch.empty(size).fill_(1.0) for _ in range(3)]  # the heap grows to hold them once
    del warm
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        torch.empty(size).fill_(1.0)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 20 * pages // 4  # an mmap per tensor would fault every page of each one
