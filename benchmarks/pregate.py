"""The pre-gating prefetcher's cost a guess (``runtime/prefetch.py``): a decode step guesses every
MoE layer but the first, so a 48-layer model pays it 47 times a token.

Routers of Qwen3-30B-A3B's shape (128 experts x 2048, bf16 values as a trained model's, held as
float32 as a GGUF stores them), 48 layers of them, so that each guess reads its router from
memory as in a real step (48 MB do not stay in the caches). In each round, every layer once:
``Prefetcher.guess`` without asking for pages (its bookkeeping and the router's product), and
beside it the router's product alone through numpy in float32 (what the guess computed before
it used the CPU kernels on the router's bf16 bits) and through the bf16 kernel. Rounds
interleaved; medians a call in microseconds, and the guess's share of a token of a 48-layer
model at the given decode speed.

    python benchmarks/pregate.py [--rounds 200] [--tokens-per-s 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


class _Layer:
    """What the prefetcher reads of a layer's ``ExpertSet``."""

    def __init__(self, layer: int, experts: int) -> None:
        self.layer = layer
        self.counts = np.zeros(experts, dtype=np.int64)
        self.observers: list = []  # type: ignore[type-arg]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--tokens-per-s", type=float, default=20.0, help="the decode speed the share is of")
    args = parser.parse_args()
    from ktc.runtime.kernels import exact_bf16, matvec
    from ktc.runtime.prefetch import Prefetcher

    experts, hidden, k = 128, 2048, 8
    rng = np.random.default_rng(0)
    routers = [((rng.standard_normal((experts, hidden), dtype=np.float32).view(np.uint32) >> 16) << 16).view(np.float32)
               for _ in range(args.layers)]
    bits = [exact_bf16(r) for r in routers]
    layers = [_Layer(i, experts) for i in range(args.layers)]
    fetch = Prefetcher(None, layers, routers, k, keep_guesses=False, page=False)  # type: ignore[arg-type]
    x = rng.standard_normal((1, hidden), dtype=np.float32)
    times: dict[str, list[float]] = {"Prefetcher.guess": [], "numpy float32 product": [], "bf16 kernel product": []}
    calls = {"Prefetcher.guess": lambda i: fetch.guess(i, x), "numpy float32 product": lambda i: x @ routers[i].T,
             "bf16 kernel product": lambda i: matvec(bits[i], "bf16", x[0])}
    for name, call in calls.items():  # compiled or loaded before the rounds
        call(1)
    for round_index in range(args.rounds):
        for name, call in calls.items():
            for i in range(1, args.layers):
                started = time.perf_counter()
                call(i)
                times[name].append(time.perf_counter() - started)
                layers[i].counts[rng.choice(experts, k, replace=False)] += 1  # the layer's use, scored next
    fetch.close()
    print(f"{args.rounds} rounds x {args.layers - 1} layers, Qwen3-30B-A3B-shaped routers (128 x 2048), one token; "
          "medians a call:")
    for name, values in times.items():
        print(f"{name:24} {1e6 * statistics.median(values):7.1f} us")
    guess = statistics.median(times["Prefetcher.guess"])
    token = (args.layers - 1) * guess
    print(f"a token's guesses: {1e3 * token:.2f} ms, {100 * token * args.tokens_per_s:.1f}% of a token at "
          f"{args.tokens_per_s:g} tok/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
