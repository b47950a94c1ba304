"""Predicted against measured decode time per token of CPU-only bundles, with a calibrated profile.

For every case, its bundle read afresh into the page cache and loaded as ``ktc run`` loads it
(a warm-up run first), then rounds of: calibrate (``ktc doctor --calibrate``'s measurements:
ktc's kernels' bytes/s at the schemes the case uses, the fixed costs of a layer's and a token's
step from probe models of their own shape), measure the decode time per token as ``ktc run``
does (greedy; the median of ``--runs`` decodes one after another: a decode lasts about a second,
and on this shared machine one in several was slowed by half for a second while the calibrations
around it, each a few seconds of medians, were not), calibrate again, and predict it with the
CPU cost model (``passes/decode_cost.py``) as the mean of the two calibrations' predictions. The
machine's bandwidth drifts within seconds here, and the two calibrations bracket the
measurement: the kernels' probes (hundreds of MiB a scheme, written and read afresh) are made
once a case and measured again in each calibration, so that a calibration takes a second or two,
not the several seconds making them took, and the bracket is that much tighter. Printed per case:
the medians over rounds of predicted and measured ms per token, the median of the per-round
errors (predicted/measured - 1), each round's, and each round's error from either calibration
alone (where those part, the machine changed under the round), and the prediction's parts. The
read bandwidth drifts within minutes here, so a profile calibrated in one minute predicts the
next minute's run; a calibration an hour old carries the drift between the two.

Cases: the demo model (trained, every expert on the CPU at int8) and, where
``benchmarks/vs_llamacpp.py`` has built them in ``--workdir``, the one-layer models at
Mixtral-8x7B's and Qwen3-30B-A3B's shapes compiled from llama.cpp's GGUFs (Q8_0, Q4_0, MXFP4_MOE,
Q4_K_M) and the 4-layer Qwen3 ones.

    python benchmarks/predict.py [--rounds 5] [--new 48] [--runs 3] [--no-mmap] [--cases demo,qwen3-Q4_0-pure,...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

CASES = ("demo", "qwen3-Q8_0-pure", "qwen3-Q4_0-pure", "qwen3-MXFP4_MOE", "qwen3-Q4_K_M", "qwen3-4l-Q4_0-pure",
         "qwen3-4l-Q4_K_M", "mixtral-Q8_0-pure", "mixtral-Q4_0-pure", "mixtral-MXFP4_MOE", "mixtral-Q4_K_M")
PROMPT = list(range(3, 35))  # 32 prompt tokens


def demo_bundle(workdir: str) -> str:
    from ktc.compile import compile_bundle
    from ktc.demo import write_demo_model

    path = os.path.join(workdir, "demo-cpu-int8.ktb")
    if not os.path.exists(path):
        print("training/compiling the demo model (every expert on the CPU, int8)...", flush=True)
        source = write_demo_model(os.path.join(workdir, "demo-trained"), trained=True, progress=True)
        compile_bundle(source, path, cpu_scheme="int8", max_tokens=4096)
    return path


def in_page_cache(path: str) -> None:
    """The whole file in the page cache, read afresh from its start (``read_afresh``): the cost
    model predicts a step whose weights are in RAM (a first use of an uncached page reads the
    disk: an embedding row of a token not seen since the bundle was written took 0.5 ms here, an
    expert a few ms), and the measurement should find the file's pages as a first run after
    reading it does, as the calibration's mapped probes find theirs: the rate of reading a file
    through a map follows where the page cache put its pages (19.5-20.6 against 27-33 GB/s on one
    machine, docs/runtime.md)."""
    from ktc.runtime.calibrate import read_afresh

    read_afresh(path)


def loaded(path: str, mapped: bool = True) -> Any:
    """The bundle at ``path`` read afresh into the page cache (``in_page_cache``) and loaded as
    ``ktc run`` loads it (``mapped=False``: read into memory, as ``ktc run --no-mmap`` reads it),
    after a short warm-up run: a context manager."""
    from ktc.runtime.generate import Sampling, generate
    from ktc.runtime.hf import from_bundle

    in_page_cache(path)
    km = from_bundle(path, mapped=mapped)
    generate(km, PROMPT[:4], max_new_tokens=4, sampling=Sampling(temperature=0), stop_at_eos=False)
    return km


def measure(km: Any, new: int, runs: int = 1) -> tuple[float, float, float]:
    """Seconds a decode step of the loaded model ``km``, as ``ktc run`` measures it, and of that
    its layers' and its lm_head's (ktc's decode step times them): those of the median of ``runs``
    decodes, one after another."""
    from ktc.runtime.generate import Sampling, generate

    got = []
    for _ in range(runs):
        km.fast.seconds[:] = 0
        km.fast.steps = 0
        result = generate(km, PROMPT, max_new_tokens=new, sampling=Sampling(temperature=0), stop_at_eos=False)
        parts = km.fast.seconds / km.fast.steps
        got.append((result.decode_seconds / (len(result.generated_tokens) - 1), float(parts[:-1].sum()),
                    float(parts[-1])))
    return sorted(got)[len(got) // 2]


def sides(got: list[tuple[float, float, dict]]) -> str:
    """Each round's errors of the prediction from the calibration before the measurement and from
    the one after, alone: where they part, the machine changed under the round."""
    return " ".join("/".join(f"{ms / (measured * 1e3) - 1:+.1%}" for ms in parts["sides"]) for _, measured, parts in got)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new", type=int, default=48, help="generated tokens a decode")
    parser.add_argument("--runs", type=int, default=3, help="decodes a measurement (their median)")
    parser.add_argument("--no-mmap", action="store_true",
                        help="measure with the bundle read into memory (ktc run --no-mmap), and calibrate with the "
                             "probes' weights in memory too (by default both are read through a file's map)")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--workdir", default=os.path.join(os.path.expanduser("~"), ".cache", "ktc", "bench-generate"))
    args = parser.parse_args()
    from ktc.calibrate import calibrate, probe_bundles
    from ktc.formats.bundle import open_bundle
    from ktc.formats.hardware_profile import HardwareProfile
    from ktc.passes.decode_cost import bundle_decode_cost
    from ktc.runtime.bandwidth import read_bandwidth

    os.makedirs(args.workdir, exist_ok=True)
    cases: dict[str, str] = {}
    for name in args.cases.split(","):
        path = demo_bundle(args.workdir) if name == "demo" else os.path.join(args.workdir, f"{name}-from-gguf.ktb")
        if os.path.exists(path):
            cases[name] = path
        else:
            print(f"skipping {name}: {path} is not built (python benchmarks/vs_llamacpp.py builds it)")
    schemes = {}
    for name, path in cases.items():
        with open_bundle(path) as bundle:
            schemes[name] = tuple(sorted({t.scheme for t in bundle.tensors.values()}))
    print(f"{args.rounds} rounds; cases {', '.join(cases)}", flush=True)
    rows: dict[str, list[tuple[float, float, dict]]] = {name: [] for name in cases}
    with tempfile.TemporaryDirectory(prefix="ktc-predict-") as tmp:
        probes = probe_bundles(tmp)
        for name, path in cases.items():
            started = time.perf_counter()
            kept: dict = {}  # the case's kernel probes, made by its first calibration
            bandwidths = []
            with loaded(path, mapped=not args.no_mmap) as km, open_bundle(path) as bundle:
                for r in range(args.rounds):
                    bandwidths.append(read_bandwidth())
                    costs = []
                    for side in ("before", "after"):  # a calibration on each side of the measurement
                        hw = calibrate(HardwareProfile(vram_bytes=0, ram_bytes=1, cpu_bandwidth=bandwidths[-1]),
                                       schemes=schemes[name], rounds=3, bundles=probes, mapped=not args.no_mmap,
                                       kept=kept)
                        costs.append(bundle_decode_cost(bundle, hw, context=len(PROMPT) + args.new // 2).to_json())
                        if side == "before":
                            seconds, layers, head = measure(km, args.new, args.runs)
                    cost = {k: (a + b) / 2 if isinstance(a, float) else a for (k, a), b in
                            zip(costs[0].items(), costs[1].values())}
                    rows[name].append((cost["ms_per_token"] / 1e3, seconds,
                                       {**cost, "measured_layers_ms": 1e3 * layers, "measured_lm_head_ms": 1e3 * head,
                                        "sides": [c["ms_per_token"] for c in costs]}))
            del kept
            print(f"{name}: read bandwidth {min(bandwidths) / 1e9:.1f}-{max(bandwidths) / 1e9:.1f} GB/s; last "
                  f"calibration: a layer {hw.cpu_layer_seconds * 1e6:.0f} us, a token {hw.cpu_token_seconds * 1e6:.0f} us "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
    print(f"\nmedians over {args.rounds} rounds, calibrated before and after each measurement"
          f"{' (ktc run --no-mmap)' if args.no_mmap else ''}:")
    worst = 0.0
    for name, got in rows.items():
        errors = [p / m - 1 for p, m, _ in got]
        error = statistics.median(errors)
        worst = max(worst, abs(error))
        med = {k: statistics.median(x[2][k] for x in got) for k in got[0][2] if k.endswith("_ms")}
        layers = med["matrices_ms"] + med["experts_ms"] + med["kv_ms"] + med["layer_fixed_ms"]
        measured = statistics.median(m for _, m, _ in got) * 1e3
        print(f"{name:<20} predicted {statistics.median(p for p, _, _ in got) * 1e3:7.3f} ms/token, measured "
              f"{measured:7.3f}: error {error * 100:+5.1f}% (rounds {' '.join(f'{e * 100:+.1f}' for e in errors)}; "
              f"the calibration before/after alone {sides(got)})")
        print(f"{'':<20} predicted/measured: layers {layers:.3f}/{med['measured_layers_ms']:.3f}, lm_head "
              f"{med['lm_head_ms']:.3f}/{med['measured_lm_head_ms']:.3f}, the rest {med['token_fixed_ms']:.3f}/"
              f"{measured - med['measured_layers_ms'] - med['measured_lm_head_ms']:.3f}")
    print(f"\nlargest error: {worst * 100:.1f}% (target within 10%: {'met' if worst <= 0.10 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
