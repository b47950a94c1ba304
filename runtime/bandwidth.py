"""Memory read bandwidth, measured: the roofline that batch-1 expert kernels are judged against."""

from __future__ import annotations

import time

import numpy as np
from numba import njit, prange


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _sum(a):  # pragma: no cover - compiled
    total = np.float32(0.0)
    for i in prange(a.shape[0]):
        total += a[i]
    return total


def read_bandwidth(nbytes: int = 512 * 1024 * 1024, repeat: int = 5) -> float:
    """Bytes per second that all threads together read from memory (the best of ``repeat``
    passes over a buffer far larger than the caches)."""
    a = np.ones(nbytes // 4, dtype=np.float32)
    _sum(a[:1024])  # compile outside the timing
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        _sum(a)
        best = min(best, time.perf_counter() - started)
    return a.nbytes / best
