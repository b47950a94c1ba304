"""The kernels' default thread count leaves the cores other processes keep busy alone."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from ktc.runtime import cpu_load


def test_a_busy_process_is_seen_and_its_core_left_alone(monkeypatch):
    cores = os.cpu_count() or 1
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        monkeypatch.setattr(cpu_load, "_CACHE", None)
        assert cpu_load.other_processes_cores() >= 0.5
        assert cpu_load.default_threads(cores) <= max(1, cores - 1)
    finally:
        hog.kill()
        hog.wait()
    monkeypatch.setattr(cpu_load, "_CACHE", None)


def test_the_measure_is_remembered_for_a_while(monkeypatch):
    monkeypatch.setattr(cpu_load, "_CACHE", (time.monotonic(), 3.0))
    assert cpu_load.other_processes_cores() == 3.0  # no new sample
    assert cpu_load.default_threads(2) == 1  # never fewer than one
    monkeypatch.setattr(cpu_load, "_CACHE", (time.monotonic() - 2 * cpu_load.CACHE_SECONDS, 3.0))
    assert cpu_load.other_processes_cores() < 3.0  # stale: measured again
