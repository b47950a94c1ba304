"""``ktc bench``: run a bundle's MoE layers on random hidden states with real routing and report
time per step, weight bytes read per second, and that rate against the measured read bandwidth."""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

import numpy as np

from ktc.formats.bundle import open_bundle

from .bandwidth import read_bandwidth
from .moe import MoELayer, moe_layers


def _expert_bytes(layer: MoELayer, expert: int) -> int:
    ex = layer.experts.cpu.get(expert)
    if ex is None:
        return 0
    return ex.gate_up.nbytes + ex.down.nbytes


def set_threads(threads: int | None) -> int:
    """Use ``threads`` Numba threads (by default all cores but those other processes keep busy:
    ``cpu_load``); more than the cores is clamped with a warning rather than oversubscribing."""
    import numba

    from .cpu_load import default_threads

    cores = os.cpu_count() or 1
    if threads is None:
        threads = min(default_threads(cores), numba.config.NUMBA_NUM_THREADS)
    if threads > min(cores, numba.config.NUMBA_NUM_THREADS):
        warnings.warn(f"{threads} threads asked for but this machine has {cores} cores; using {cores}",
                      stacklevel=2)
        threads = min(cores, numba.config.NUMBA_NUM_THREADS)
    numba.set_num_threads(max(1, threads))
    return threads


def bench_bundle(path: str, tokens: tuple[int, ...] = (1, 16, 64), threads: int | None = None,
                 steps: int = 5, seed: int = 0, mapped: bool = True) -> dict[str, Any]:
    """Figures per token count: ms per step, weight GB/s, fraction of the read bandwidth, and
    what the plan's cost model predicts for the same weight bytes (at the plan's CPU bandwidth,
    when the bundle was planned). ``warnings`` says when the machine is busy or reads far slower
    than the plan assumed. ``mapped=False``: the bundle read into memory (``open_bundle``)."""
    from .cpu_load import other_processes_cores

    used_threads = set_threads(threads)
    roofline = read_bandwidth()
    busy = other_processes_cores()
    rng = np.random.default_rng(seed)
    result: dict[str, Any] = {"bundle": path, "threads": used_threads, "roofline_gbps": roofline / 1e9,
                              "other_processes_cores": busy, "tokens": {}, "warnings": []}
    if busy >= 0.5:
        result["warnings"].append(f"other processes keep {busy:.1f} cores busy: the figures are lower "
                                  "and noisier than on an idle machine (--threads sets how many to use)")
    with open_bundle(path, mapped=mapped) as bundle:
        hardware = (bundle.manifest.get("plan") or {}).get("hardware") or {}
        planned = hardware.get("cpu_bandwidth") if isinstance(hardware, dict) else None
        planned = float(planned) if isinstance(planned, (int, float)) and planned > 0 else None
        result["plan_cpu_bandwidth_gbps"] = None if planned is None else planned / 1e9
        if planned is not None and roofline < 0.5 * planned:
            result["warnings"].append(f"this machine reads {roofline / 1e9:.1f} GB/s, under half the "
                                      f"{planned / 1e9:.0f} GB/s the plan assumed: a busy machine, or "
                                      "another one (ktc doctor --write-profile measures it)")
        layers = moe_layers(bundle)
        hidden_size = layers[0].hidden_size
        try:
            for count in tokens:
                per_layer = {layer.layer: [] for layer in layers}
                total_bytes = 0
                total_seconds = 0.0
                for step in range(steps + 1):  # the first step warms caches and kernels up
                    hidden = rng.standard_normal((count, hidden_size)).astype(np.float32)
                    for layer in layers:
                        idx, _ = layer.route(hidden)
                        weight_bytes = sum(_expert_bytes(layer, e) for e in np.unique(idx).tolist())
                        started = time.perf_counter()
                        layer.forward(hidden)
                        elapsed = time.perf_counter() - started
                        if step:
                            per_layer[layer.layer].append((elapsed, weight_bytes))
                            total_bytes += weight_bytes
                            total_seconds += elapsed
                gbps = total_bytes / total_seconds / 1e9
                result["tokens"][str(count)] = {
                    "ms_per_step": 1e3 * total_seconds / steps,
                    # The cost model's time for the bytes these steps read: at the plan's CPU
                    # bandwidth, and at the one measured here.
                    "predicted_ms_per_step": None if planned is None else 1e3 * total_bytes / steps / planned,
                    "roofline_ms_per_step": 1e3 * total_bytes / steps / roofline,
                    "ms_per_token": 1e3 * total_seconds / steps / count,
                    "weight_gbps": gbps,
                    "roofline_fraction": gbps / (roofline / 1e9),
                    "layers": {str(k): {"ms": 1e3 * sum(t for t, _ in v) / len(v),
                                        "weight_gbps": sum(b for _, b in v) / max(sum(t for t, _ in v), 1e-12) / 1e9}
                               for k, v in per_layer.items()},
                }
        finally:
            for layer in layers:
                layer.close()
    return result
