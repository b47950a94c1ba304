"""Replay routing traces through the device expert cache's policy (``runtime/expert_cache.py``)
and predict decode tokens/s against the static plan's, at 10%, 25% and 50% of the experts'
bytes in VRAM.

Traces: Zipf-skewed synthetic routing at Mixtral-8x7B's scale (32 layers of 8 experts, top 2,
99 MB an expert at 4.5 bits a weight) and Qwen3-30B-A3B's (48 of 128, top 8, 2.7 MB), each
steady (one popularity order per layer for the whole trace) and drifting (a new order every
``--period`` tokens, as a long generation changes topic). The static plan keeps, under the
budget, the experts a profile of the first order ranks highest (globally: every expert's bytes
are equal, so the most used save the most); the cache holds the same experts at the start, the
same number of them in each layer, and replaces them as the policy decides.

The time model, per layer and token: the device's experts at ``gpu_bandwidth``, the others at
``cpu_bandwidth``, concurrently (the slower of the two), plus ``sync_seconds`` where any runs on
the CPU; an upload goes over PCIe at ``pcie_bandwidth`` one after another, lands when done (uses
before that are misses, run on the CPU), and while one is under way the CPU's experts read at
``cpu_bandwidth - pcie_bandwidth`` (the copies read the same host memory). Bandwidths are the
hardware profile's defaults unless given. This replays the policy; it does not run the runtime
(``ktc run --cache-slots``, which runs the same policy, needs a GPU to be measured).

Beside each, a ceiling: the static plan remade from each window of ``--period`` tokens' own
routing (the whole replay for steady traces) and switched for free at the window's start. No
policy that keeps experts a while does better, so where the goal (1.2x the static plan on
drifting routing) is above the ceiling, no cache policy reaches it under this time model.

With ``--trace FILE`` (``ktc profile BUNDLE --text FILE -o p.json --trace FILE``) a recorded
model's routing is replayed too, its first quarter (at most ``--profile-tokens``) as the profile.

    python benchmarks/stream.py [--tokens 2048] [--period 256] [--zipf 1.0]
                                [--trace routes.npy --expert-bytes N] [--no-synthetic]
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


@dataclass(frozen=True)
class Scale:
    name: str
    layers: int
    experts: int
    top_k: int
    expert_bytes: int


SCALES = (Scale("mixtral-8x7b", 32, 8, 2, 3 * 4096 * 14336 * 9 // 16),
          Scale("qwen3-30b-a3b", 48, 128, 8, 3 * 2048 * 768 * 9 // 16))


def trace(scale: Scale, tokens: int, zipf: float, period: int | None, rng: np.random.Generator,
          start: int = 0) -> np.ndarray:
    """[tokens, layers, top_k] experts: each token's top k of a Zipf popularity (one order per
    layer, drawn anew every ``period`` tokens after ``start`` when given), sampled without
    replacement."""
    weights = 1.0 / np.arange(1, scale.experts + 1) ** zipf
    out = np.empty((tokens, scale.layers, scale.top_k), dtype=np.int64)
    orders = np.stack([rng.permutation(scale.experts) for _ in range(scale.layers)])
    for t in range(tokens):
        if period and t > start and (t - start) % period == 0:
            orders = np.stack([rng.permutation(scale.experts) for _ in range(scale.layers)])
        # Gumbel top-k: k draws without replacement in proportion to the weights
        keys = np.log(weights)[None, :] + rng.gumbel(size=(scale.layers, scale.experts))
        ranks = np.argsort(-keys, axis=1)[:, : scale.top_k]
        out[t] = np.take_along_axis(orders, ranks, axis=1)
    return out


def static_plan(profile: np.ndarray, scale: Scale, budget: float) -> list[tuple[int, ...]]:
    """Per layer, the experts kept on the device: the most used over all layers, as many as
    ``budget`` (a fraction of every expert's bytes) holds."""
    count = int(budget * scale.layers * scale.experts)
    ranked = np.argsort(-profile.reshape(-1), kind="stable")[:count]
    chosen: list[list[int]] = [[] for _ in range(scale.layers)]
    for flat in ranked.tolist():
        chosen[flat // scale.experts].append(flat % scale.experts)
    return [tuple(c) for c in chosen]


def replay(routes: np.ndarray, scale: Scale, plan: list[tuple[int, ...]], profile: np.ndarray, hw,
           cached: bool) -> tuple[float, float, int]:
    """(tokens/s, hit rate, bytes uploaded) of the trace under the plan, with the cache or not."""
    from ktc.runtime.expert_cache import LayerCache, replay_trace

    caches = ([LayerCache(scale.experts, len(plan[li]), scale.expert_bytes, prior=profile[li], initial=plan[li])
               for li in range(scale.layers)] if cached else None)
    shape = (scale.layers, scale.experts)
    result = replay_trace(routes, caches, [frozenset(p) for p in plan],
                          np.full(shape, scale.expert_bytes / hw.gpu_bandwidth),
                          np.full(shape, scale.expert_bytes / hw.cpu_bandwidth), np.full(scale.layers, hw.sync_seconds),
                          scale.expert_bytes / hw.pcie_bandwidth, hw.cpu_bandwidth, hw.pcie_bandwidth)
    return len(routes) / result.seconds, result.hits / result.uses, result.uploaded * scale.expert_bytes


def counts(routes: np.ndarray, scale: Scale) -> np.ndarray:
    """[layers, experts] how often each expert was chosen in ``routes``."""
    return np.stack([np.bincount(routes[:, li].reshape(-1), minlength=scale.experts) for li in range(scale.layers)])


def hindsight(run: np.ndarray, scale: Scale, budget: float, window: int, hw) -> float:  # type: ignore[no-untyped-def]
    """Tokens/s of a static plan remade for each ``window`` tokens from their own routing and
    switched for free between them: what a policy that keeps experts for a while can reach at
    best (it neither pays for copies nor guesses), the ceiling the cache is measured against."""
    seconds = 0.0
    for start in range(0, len(run), window):
        part = run[start:start + window]
        own = counts(part, scale)
        rate, _, _ = replay(part, scale, static_plan(own, scale, budget), own, hw, cached=False)
        seconds += len(part) / rate
    return len(run) / seconds


def compare(scale: Scale, routes: np.ndarray, profile_tokens: int, kind: str, window: int,
            hw) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """Prints the static plan's and the cache's predicted tokens/s at each budget, the plan and
    the cache's priors from the routes' first ``profile_tokens`` tokens (as ``ktc profile`` would
    record them on other text), the rest replayed, beside the ``hindsight`` ceiling over windows
    of ``window`` tokens; returns the worst cache/static ratio and that case's ceiling's."""
    head, run = routes[:profile_tokens], routes[profile_tokens:]
    profile = counts(head, scale)
    worst, its_ceiling = float("inf"), float("inf")
    for budget in (0.10, 0.25, 0.50):
        plan = static_plan(profile, scale, budget)
        s_rate, s_hit, _ = replay(run, scale, plan, profile, hw, cached=False)
        c_rate, c_hit, moved = replay(run, scale, plan, profile, hw, cached=True)
        ceiling = hindsight(run, scale, budget, window, hw)
        if c_rate / s_rate < worst:
            worst, its_ceiling = c_rate / s_rate, ceiling / s_rate
        print(f"{scale.name:<14} {kind:<9} {100 * budget:3.0f}% in VRAM: static {s_rate:7.1f} tok/s "
              f"(hits {100 * s_hit:5.1f}%), cache {c_rate:7.1f} tok/s (hits {100 * c_hit:5.1f}%, "
              f"{moved / len(run) / 1e6:6.1f} MB uploaded a token): {c_rate / s_rate:.2f}x; hindsight "
              f"{ceiling:7.1f} tok/s ({ceiling / s_rate:.2f}x)")
    return worst, its_ceiling


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--period", type=int, default=256,
                        help="tokens between routing changes (drifting), and the hindsight plan's window")
    parser.add_argument("--zipf", type=float, default=1.0, help="the popularity's Zipf exponent")
    parser.add_argument("--profile-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", help="also replay a recorded trace (ktc profile --trace FILE)")
    parser.add_argument("--experts", type=int, help="the traced model's experts a layer (default: the most seen)")
    parser.add_argument("--expert-bytes", type=int, default=SCALES[1].expert_bytes,
                        help="the traced model's bytes an expert (default: Qwen3-30B-A3B's at 4.5 bits)")
    parser.add_argument("--synthetic", action=argparse.BooleanOptionalAction, default=True,
                        help="the synthetic traces (--no-synthetic: the recorded one alone)")
    args = parser.parse_args()
    from ktc.formats.hardware_profile import HardwareProfile

    hw = HardwareProfile(vram_bytes=0, ram_bytes=0)
    print(f"time model: CPU {hw.cpu_bandwidth / 1e9:.0f} GB/s, GPU {hw.gpu_bandwidth / 1e9:.0f} GB/s, PCIe "
          f"{hw.pcie_bandwidth / 1e9:.0f} GB/s, {1e6 * hw.sync_seconds:.0f} us a layer with CPU experts"
          + (f"; synthetic: {args.tokens} tokens, Zipf {args.zipf}, drift every {args.period} tokens"
             if args.synthetic else ""))
    if args.trace:
        routes = np.load(args.trace)
        if routes.ndim != 3 or routes.shape[0] < 8:
            print(f"{args.trace}: not a routing trace of [tokens, layers, k] (ktc profile --trace)")
            return 1
        scale = Scale(os.path.splitext(os.path.basename(args.trace))[0][:14], routes.shape[1], args.experts or int(routes.max()) + 1,
                      routes.shape[2], args.expert_bytes)
        # the first quarter (at most --profile-tokens) as the profile, the rest replayed
        worst, ceiling = compare(scale, routes, min(args.profile_tokens, len(routes) // 4), "recorded", args.period, hw)
        print(f"recorded trace ({len(routes)} tokens): worst cache/static {worst:.2f}x (hindsight there "
              f"{ceiling:.2f}x)\n")
    if not args.synthetic:
        return 0
    worst_drift, worst_steady = (float("inf"), 0.0), (float("inf"), 0.0)
    for scale in SCALES:
        for kind, period in (("steady", None), ("drifting", args.period)):
            # the drift starts after the profile's tokens
            routes = trace(scale, args.profile_tokens + args.tokens, args.zipf, period,
                           np.random.default_rng(args.seed), start=args.profile_tokens)
            worst = compare(scale, routes, args.profile_tokens, kind, args.period if period else args.tokens, hw)
            if kind == "drifting":
                worst_drift = min(worst_drift, worst)
            else:
                worst_steady = min(worst_steady, worst)
    (drift, drift_ceiling), (steady, _) = worst_drift, worst_steady
    print(f"\nworst cache/static: drifting {drift:.3f}x (goal at least 1.2x: {'met' if drift >= 1.2 else 'NOT met'}; "
          f"the hindsight ceiling of that case {drift_ceiling:.3f}x), steady {steady:.3f}x (goal never below "
          f"1.0x: {'met' if steady >= 1.0 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
