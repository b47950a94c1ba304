"""How much of the CPU other processes are using now, so that the kernels' default thread count
leaves their cores alone.

The kernels' parallel regions end at a barrier: when another process takes one of two cores,
the thread that shares it finishes last every time. Measured here with one busy process: ktc's
whole-model decode of a one-layer Qwen3-30B-A3B Q8_0 model ran at 26.5 tokens/s with two
threads and 43.0 with one (53.8 with two on the idle machine); llama.cpp's, 38.8 and 53.6.
"""

from __future__ import annotations

import os
import time

_CACHE: tuple[float, float] | None = None  # (when, cores in use by others)
CACHE_SECONDS = 10.0


def _busy_ticks() -> int | None:
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    values = [int(v) for v in fields[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle and iowait
    return sum(values[:8]) - idle  # user .. steal; guest time is already inside user


def _own_ticks() -> int:
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime


def other_processes_cores(sample: float = 0.2) -> float:
    """Cores' worth of CPU time other processes used over ``sample`` seconds (0.0 where /proc
    is not there); remembered for ``CACHE_SECONDS``."""
    global _CACHE
    now = time.monotonic()
    if _CACHE is not None and now - _CACHE[0] < CACHE_SECONDS:
        return _CACHE[1]
    first = _busy_ticks()
    if first is None:
        return 0.0
    own = _own_ticks()
    started = time.monotonic()
    time.sleep(sample)
    busy = _busy_ticks() - first  # type: ignore[operator]
    mine = _own_ticks() - own
    elapsed = time.monotonic() - started
    cores = max(0.0, (busy - mine) / (os.sysconf("SC_CLK_TCK") * elapsed))
    _CACHE = (time.monotonic(), cores)
    return cores


def default_threads(cores: int) -> int:
    """All cores, less those other processes keep busy (at least one)."""
    return max(1, cores - int(other_processes_cores() + 0.5))
