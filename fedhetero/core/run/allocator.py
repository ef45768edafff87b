"""Keep freed activation memory in the process heap (glibc ``malloc``) instead of returning it.

PyTorch's CPU tensors come from the C allocator. glibc serves large blocks (above a dynamic
threshold of at most 32 MiB) with ``mmap`` and gives them back on ``free``, and trims the heap top
when more than a threshold is free. A training step allocates and frees every activation and
gradient, so each step faults in fresh pages for many of them: a CIFAR ResNet-18 step at batch 64
touches ~1 GB of new pages when expanded into Diverse Branch Blocks (~0.35 GB plain). The PyTorch
CPU performance guide recommends an allocator that reuses memory (jemalloc, TCMalloc); this module
gets the same effect from glibc itself, at run time, by raising the mmap threshold to its maximum
and disabling heap trimming (``mallopt``).

The price is that freed memory stays mapped: the resident size stays near the peak instead of
shrinking between steps. Nothing happens on other C libraries (macOS, musl, Windows):
:func:`tune_malloc` returns ``False`` there.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["tune_malloc", "malloc_tuned", "MMAP_THRESHOLD_MAX"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: glibc's upper limit of ``M_MMAP_THRESHOLD`` on 64-bit systems (``HEAP_MAX_SIZE / 2``)
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024

_STATE = {"tuned": False}


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return None  # not glibc
    return libc


def tune_malloc(mmap_threshold: int = MMAP_THRESHOLD_MAX, trim_threshold: int = 2**62) -> bool:
    """Serve blocks up to ``mmap_threshold`` bytes from the heap and never trim it.

    Process-wide and lasting; safe to call repeatedly. Returns ``True`` when glibc accepted both
    settings, ``False`` on other C libraries or when a setting was refused.
    """
    if not 0 <= int(mmap_threshold) <= MMAP_THRESHOLD_MAX:
        raise ValueError(f"mmap_threshold must be in [0, {MMAP_THRESHOLD_MAX}], got {mmap_threshold}")
    libc = _libc()
    if libc is None:
        return False
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    trim = min(int(trim_threshold), 2**31 - 1)
    ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold))) and bool(libc.mallopt(_M_TRIM_THRESHOLD, trim))
    _STATE["tuned"] = _STATE["tuned"] or ok
    return ok


def malloc_tuned() -> bool:
    """Whether :func:`tune_malloc` has taken effect in this process."""
    return _STATE["tuned"]
