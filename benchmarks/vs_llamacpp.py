"""Decode and prefill beside llama.cpp on the same bytes: one-layer models at Mixtral-8x7B's and Qwen3-30B-A3B's
shapes (and, with ``--shapes gpt-oss --types MXFP4_MOE``, gpt-oss-20b's: its published config in
``configs/``, its checkpoint converted by the converter run with a known BPE pre-tokenizer, as
``perplexity_vs_llamacpp.py`` runs it; MXFP4 is the type its experts ship in; with ``--shapes
moonlight``, Moonlight-16B-A3B's, DeepSeek-V3's architecture with multi-head latent attention,
converted the same way, its GGUF given ``q_lora_rank`` 0 where it has fewer layers than llama.cpp
reads without the key),
converted by llama.cpp's converter and quantized by ``llama-quantize`` (Q8_0, Q4_0,
MXFP4_MOE, Q4_K_M), then compiled by ktc *from those GGUF files* (their blocks pass through: both
read the same bytes; a Q4_K_M file keeps its Q4_K/Q6_K mix layer by layer). Q8_0 and Q4_0 are
quantized with ``--pure`` (every matrix in that type, as they were before ktc read the K-quants:
by default llama-quantize keeps a Q4_0 file's ``output.weight`` in Q6_K). MXFP4_MOE files hold
MXFP4 experts and Q8_0 matrices.

Interleaved rounds, each measuring the read bandwidth first, then every case: ``llama-bench -p P
-n 0 -t T`` and ``llama-bench -p 0 -n N -d P -t T`` (its decode after a prompt of P tokens, as
ktc's: from an empty cache its steps would read no keys and values), and ktc's whole-model
decode (``ktc run``'s loop, greedy, the same prompt and generation lengths), which of the two
goes first swapped every round. Printed per case: medians
of decode tokens/s for both, the median of the per-round ratios (and each round's), and each as a
fraction of its round's bandwidth; then the prompt's prefill tokens/s for both and their ratio
(``--prompt 512`` for llama-bench's usual prefill figure). No best-of-N figures. Under each
decode line, ktc's MoE block inside the model's decode step, timed from the cycle counter's
stamps in its compiled call (``vnni.STAMPS``; the last MoE layer's, every token): the kernels,
and beside them the routing, the activations' quantization, the activation function and the
combination, as a share of the block, medians over tokens, then over rounds.

With ``--busy``, every round measures each case again beside one competing busy process (a
Python loop) right after its idle pair: ktc with its default thread count (which leaves the core
that process takes alone), llama.cpp with ``-t`` as before; printed is how much of its idle speed
each keeps, the median over rounds of each round's busy speed over that round's idle speed (the
read bandwidth moves between phases minutes apart: a block of busy rounds after a block of idle
ones compared two phases as often as one).

Needs llama.cpp's tools (``../shared/tools/build-llamacpp.sh``) and, for the converter,
``pip install sentencepiece protobuf`` in this environment.

    python benchmarks/vs_llamacpp.py [--rounds 5] [--shapes mixtral,qwen3] [--types Q8_0,Q4_0,MXFP4_MOE]
                                     [--layers 1]
    python benchmarks/vs_llamacpp.py --shapes gpt-oss --types MXFP4_MOE --layers 2
    python benchmarks/vs_llamacpp.py --shapes moonlight --types Q8_0,Q4_0 --layers 4
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import generate as gen  # noqa: E402  (the models, llama.cpp's side and the measurements)

# llama.cpp file type -> (ktc expert scheme, ktc dense scheme, every matrix in the file type):
# the GGUF's own types.
TYPES = {"Q8_0": ("q8_0", "q8_0", True), "Q4_0": ("q4_0", "q4_0", True), "MXFP4_MOE": ("mxfp4", "q8_0", False),
         "Q4_K_M": (None, "auto", False)}  # None, auto: every tensor at the file's own type (K-quants)


def main() -> int:
    parser = argparse.ArgumentParser(
        description="Decode and prefill beside llama.cpp on the same GGUF bytes, in interleaved rounds (the "
                    "module's docstring says how).",
        epilog="example: python benchmarks/vs_llamacpp.py --shapes qwen3 --types Q4_0,Q8_0 --layers 4 --rounds 5")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians over them)")
    parser.add_argument("--shapes", default="mixtral,qwen3",
                        help="comma-separated: mixtral, qwen3, gpt-oss, moonlight (published configs' shapes)")
    parser.add_argument("--types", default=",".join(TYPES), help=f"llama-quantize types among {', '.join(TYPES)}")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    parser.add_argument("--new", type=int, default=32, help="generated tokens")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for both tools")
    parser.add_argument("--workdir", default=os.path.join(os.path.expanduser("~"), ".cache", "ktc", "bench-generate"),
                        help="where the models, GGUF files and bundles are made and kept")
    parser.add_argument("--llamacpp", default=os.path.join(os.path.expanduser("~"), ".cache", "llama.cpp"),
                        help="llama.cpp's source and build (../shared/tools/build-llamacpp.sh)")
    parser.add_argument("--busy", action="store_true",
                        help="in every round, also each case beside a competing busy process")
    parser.add_argument("--layers", type=int, default=1,
                        help="decoder layers of the models (1: the output matrix is most of a token's bytes; "
                             "a real model's layers are most of them)")
    args = parser.parse_args()
    from ktc.compile import compile_bundle
    from ktc.runtime.bandwidth import read_bandwidth

    if not os.path.exists(os.path.join(args.llamacpp, "build", "bin", "llama-bench")):
        print(f"llama.cpp's tools are not built in {args.llamacpp}: run ../shared/tools/build-llamacpp.sh")
        return 1
    os.makedirs(args.workdir, exist_ok=True)
    cases = []
    for shape in args.shapes.split(","):
        name = shape if args.layers == 1 else f"{shape}-{args.layers}l"
        checkpoint = gen.build_checkpoint(shape, os.path.join(args.workdir, name), args.layers)
        for qtype in args.types.split(","):
            expert_scheme, dense_scheme, pure = TYPES[qtype]
            gguf = gen.llama_gguf(args.llamacpp, checkpoint, name, qtype, args.workdir, pure)
            bundle = os.path.join(args.workdir, os.path.basename(gguf)[:-len(".gguf")] + "-from-gguf.ktb")
            if not os.path.exists(bundle):
                print(f"compiling {os.path.basename(bundle)} from {os.path.basename(gguf)}...", flush=True)
                compile_bundle(gguf, bundle, cpu_scheme=expert_scheme, dense_scheme=dense_scheme, max_tokens=4096)
            cases.append(gen.Case(name, qtype, bundle, gguf))
    clock = gen.KernelClock()
    clock.install()
    prompt = [int(i) for i in np.random.default_rng(0).integers(3, 200, args.prompt)]
    print(f"{args.rounds} rounds, {args.threads} threads, prompt {args.prompt} tokens, {args.new} generated",
          flush=True)
    bandwidths = []
    for round_index in range(args.rounds):
        bandwidth = read_bandwidth()
        bandwidths.append(bandwidth)
        for case in cases:
            # the two sides in turn, the first of them swapped every round: the bandwidth drifts
            # within a round, and neither side always runs first
            row = {"bandwidth": bandwidth}
            for side in ("ktc", "llama") if round_index % 2 == 0 else ("llama", "ktc"):
                row[side] = (gen.run_ktc(case, clock, prompt, args.new, args.threads) if side == "ktc" else
                             gen.run_llama(args.llamacpp, case.gguf, args.prompt, args.new, args.threads))
            if args.busy:
                row["busy"] = busy_pair(args, case, clock, prompt, round_index)
            case.rows.append(row)
        print(f"round {round_index + 1}: read bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    print(f"\nmedians over {args.rounds} rounds (read bandwidth median {gen.median(bandwidths) / 1e9:.1f} GB/s):")
    worst = float("inf")
    for case in cases:
        parts = {}
        for side in ("ktc", "llama"):
            rows = [r[side] for r in case.rows]
            fraction = [r[side]["decode"] * r[side]["bytes_per_token"] / r["bandwidth"] for r in case.rows]
            parts[side] = (gen.median([x["decode"] for x in rows]), gen.median(fraction), rows[0]["bytes_per_token"])
        ratios = [r["ktc"]["decode"] / r["llama"]["decode"] for r in case.rows]
        ratio = gen.median(ratios)
        worst = min(worst, ratio)
        print(f"{case.shape:<8} {case.scheme:<10} decode: ktc {parts['ktc'][0]:6.1f} tok/s "
              f"({parts['ktc'][1] * 100:3.0f}% of the bandwidth, {parts['ktc'][2] / 1e6:.0f} MB/token), "
              f"llama.cpp {parts['llama'][0]:6.1f} tok/s ({parts['llama'][1] * 100:3.0f}%, "
              f"{parts['llama'][2] / 1e6:.0f} MB/token): ktc/llama.cpp {ratio:.2f}x "
              f"(rounds {' '.join(f'{x:.2f}' for x in ratios)})")
        print(f"{'':<20}{gen.moe_parts_line([r['ktc']['moe_parts'] for r in case.rows])}")
    print(f"\nworst case ktc/llama.cpp decode: {worst:.2f}x (target at least 1.0x: {'met' if worst >= 1 else 'NOT met'}; "
          "goal 1.15x)")
    print(f"\nprefill of the {args.prompt}-token prompt, medians over {args.rounds} rounds:")
    worst = float("inf")
    for case in cases:
        ratios = [r["ktc"]["prefill"] / r["llama"]["prefill"] for r in case.rows]
        worst = min(worst, gen.median(ratios))
        ktc, llama = (gen.median([r[side]["prefill"] for r in case.rows]) for side in ("ktc", "llama"))
        print(f"{case.shape:<8} {case.scheme:<10} prefill: ktc {ktc:7.1f} tok/s, llama.cpp {llama:7.1f} tok/s: "
              f"ktc/llama.cpp {gen.median(ratios):.2f}x (rounds {' '.join(f'{x:.2f}' for x in ratios)})")
    print(f"\nworst case ktc/llama.cpp prefill: {worst:.2f}x (goal at least 1.0x: "
          f"{'met' if worst >= 1 else 'NOT met'})")
    if args.busy:
        busy_report(args, cases)
    return 0


def busy_pair(args: argparse.Namespace, case: gen.Case, clock: gen.KernelClock, prompt: list[int],
              round_index: int) -> dict:
    """Both tools' decode of ``case`` beside one busy process, ktc at its default thread count."""
    import subprocess
    import time

    import numba

    from ktc.runtime import cpu_load

    threads = numba.get_num_threads()  # ktc's load sets its own: the next round's bandwidth probe needs these
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1.0)
        cpu_load._CACHE = None  # measured idle before: look again
        row = {"threads": cpu_load.default_threads(os.cpu_count() or 1)}
        for side in ("ktc", "llama") if round_index % 2 == 0 else ("llama", "ktc"):
            row[side] = (gen.run_ktc(case, clock, prompt, args.new, None) if side == "ktc" else
                         gen.run_llama(args.llamacpp, case.gguf, args.prompt, args.new, args.threads))
    finally:
        hog.kill()
        hog.wait()
        numba.set_num_threads(threads)
    cpu_load._CACHE = None
    return row


def busy_report(args: argparse.Namespace, cases: list) -> None:
    """Each tool's busy speed over its idle speed, round by round (the same round's idle pair)."""
    threads = sorted({r["busy"]["threads"] for case in cases for r in case.rows})
    print(f"\nbeside one busy process (ktc's default threads: {'/'.join(map(str, threads))} while it ran; "
          f"llama.cpp -t {args.threads}), medians over rounds of each round's busy/idle:")
    for case in cases:
        kept = {}
        for side in ("ktc", "llama"):
            fractions = [r["busy"][side]["decode"] / r[side]["decode"] for r in case.rows]
            kept[side] = (gen.median([r["busy"][side]["decode"] for r in case.rows]), gen.median(fractions),
                          fractions)
        print(f"{case.shape:<8} {case.scheme:<10} ktc {kept['ktc'][0]:6.1f} tok/s ({kept['ktc'][1] * 100:3.0f}% of "
              f"idle), llama.cpp {kept['llama'][0]:6.1f} tok/s ({kept['llama'][1] * 100:3.0f}% of idle): "
              f"ktc degrades {'no worse' if kept['ktc'][1] >= kept['llama'][1] else 'more'} "
              f"(rounds ktc {' '.join(f'{x * 100:.0f}' for x in kept['ktc'][2])}, "
              f"llama.cpp {' '.join(f'{x * 100:.0f}' for x in kept['llama'][2])})")


if __name__ == "__main__":
    sys.exit(main())
