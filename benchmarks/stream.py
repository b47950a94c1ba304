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

Beside it, the planner's split (``planned``): as ``ktc plan --trace`` chooses, 0, 1, 2, 4 or 8
slots a layer with the residents solved again under what they leave, each replayed on a planning
trace (another draw of the same kind and drift, another seed: the trace a user records on other
text of the workload), the fastest kept and then replayed on the same tokens as the others.

With ``--trace FILE`` (``ktc profile BUNDLE --text FILE -o p.json --trace FILE``) a recorded
model's routing is replayed too, its first quarter (at most ``--profile-tokens``) as the profile.

With ``--device cuda``, a device section runs the runtime itself: a one-layer checkpoint of
``--config``'s shape (Qwen3-30B-A3B's by default) compiled with ``--scheme`` for every expert,
one bundle per budget with the static plan's experts on the device and one with none for the
cache; ``--device-layers`` ``ExpertSet``s over that layer stand for as many layers (each
layer's experts renamed by their rank in the profile, so the compiled layer's first experts
are every layer's static plan). The steady and drifting traces are replayed token by token,
static plan against the cache's slots (as many as the static plan's residents, filled from the
profile), in interleaved rounds; at the smallest budget also every expert on the CPU, the
CPU experts' worker with every core against one less, and the static plan with its device
experts through torch's operations (``KTC_DEVICE_KERNELS=torch``) against the fused kernels
(``runtime/triton_experts.py``). Then a prompt chunk of ``--prompt``
tokens through the layers with and without the prefill offload. Beside each measured figure,
the time model's for the same routes with the bandwidths measured there and the device step's
fixed cost as ``ktc doctor --calibrate`` measures it (``ktc.calibrate.device_step``). ``--device cpu`` runs
the section on torch's CPU device (to try it; its figures say nothing of a GPU).

    python benchmarks/stream.py [--tokens 2048] [--period 256] [--zipf 1.0]
                                [--trace routes.npy --expert-bytes N] [--no-synthetic]
                                [--device cuda --device-layers 4 --device-tokens 512 --rounds 4]
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


def popularity(scale: Scale, rng: np.random.Generator) -> np.ndarray:
    """[layers, experts]: each layer's experts from the most chosen to the least."""
    return np.stack([rng.permutation(scale.experts) for _ in range(scale.layers)])


def trace(scale: Scale, tokens: int, zipf: float, period: int | None, rng: np.random.Generator,
          start: int = 0, orders: np.ndarray | None = None) -> np.ndarray:
    """[tokens, layers, top_k] experts: each token's top k of a Zipf popularity (one order per
    layer, ``orders`` or drawn first, drawn anew every ``period`` tokens after ``start`` when
    given), sampled without replacement."""
    weights = 1.0 / np.arange(1, scale.experts + 1) ** zipf
    out = np.empty((tokens, scale.layers, scale.top_k), dtype=np.int64)
    orders = popularity(scale, rng) if orders is None else orders
    for t in range(tokens):
        if period and t > start and (t - start) % period == 0:
            orders = popularity(scale, rng)
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
           cached: bool, slots: int | tuple[int, ...] | None = None) -> tuple[float, float, int]:
    """(tokens/s, hit rate, bytes uploaded) of the trace under the plan, with the cache or not:
    the plan's experts as the cache's slots at the start, or with ``slots``, the plan's experts
    resident and that many slots a layer beside them (or each layer's, a tuple: the planner's
    split)."""
    result = timed(routes, scale, plan, profile, hw, cached, slots)
    return len(routes) / result.seconds, result.hits / result.uses, result.uploaded * scale.expert_bytes


def timed(routes: np.ndarray, scale: Scale, plan: list[tuple[int, ...]], profile: np.ndarray, hw,
          cached: bool, slots: int | tuple[int, ...] | None = None):  # type: ignore[no-untyped-def]
    """``replay``'s ``expert_cache.Replay`` (each layer's seconds too)."""
    from ktc.runtime.expert_cache import LayerCache, replay_trace

    if slots is not None:
        layer_slots = (slots,) * scale.layers if isinstance(slots, int) else slots
        caches = ([LayerCache(scale.experts, layer_slots[li], scale.expert_bytes, resident=plan[li],
                              prior=profile[li]) for li in range(scale.layers)] if any(layer_slots) else None)
    else:
        caches = ([LayerCache(scale.experts, len(plan[li]), scale.expert_bytes, prior=profile[li],
                              initial=plan[li]) for li in range(scale.layers)] if cached else None)
    shape = (scale.layers, scale.experts)
    return replay_trace(routes, caches, [frozenset(p) for p in plan],
                        np.full(shape, scale.expert_bytes / hw.gpu_bandwidth),
                        np.full(shape, scale.expert_bytes / hw.cpu_bandwidth), np.full(scale.layers, hw.sync_seconds),
                        scale.expert_bytes / hw.pcie_bandwidth, hw.cpu_bandwidth, hw.pcie_bandwidth,
                        hw.device_step_seconds)


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


PLAN_TOKENS = 1024  # the planner's trace (ktc.streaming.REPLAY_TOKENS: what it replays at most)


def planned(scale: Scale, profile: np.ndarray, budget: float, plan_routes: np.ndarray, run: np.ndarray,
            hw) -> tuple[str, float]:  # type: ignore[no-untyped-def]
    """The planner's split of the budget between residents and cache slots (as ``ktc plan
    --trace`` makes it, ``ktc.streaming``: none, one slot in a quarter, half and three quarters of
    the layers, those whose replay gains most from one, and 1, 2, 4 and 8 slots a layer, the
    residents chosen again from the profile under what the slots leave, replayed on the planning
    trace ``plan_routes``, the fastest kept), then replayed on ``run``: (the split, tokens/s)."""
    from ktc.streaming import candidate_splits

    total = int(budget * scale.layers * scale.experts)
    whole = static_plan(profile, scale, budget)
    gains = (timed(plan_routes, scale, whole, profile, hw, False).layer_seconds
             - timed(plan_routes, scale, whole, profile, hw, False, slots=1).layer_seconds)
    best, chosen = 0.0, (0,) * scale.layers
    for layer_slots in [chosen] + candidate_splits(gains, scale.experts - scale.top_k):
        left = total - sum(layer_slots)
        if left < 0:
            continue
        rate, _, _ = replay(plan_routes, scale, static_plan(profile, scale, left / (scale.layers * scale.experts)),
                            profile, hw, cached=False, slots=layer_slots)
        if rate > best:
            best, chosen = rate, layer_slots
    plan = static_plan(profile, scale, (total - sum(chosen)) / (scale.layers * scale.experts))
    rate, _, _ = replay(run, scale, plan, profile, hw, cached=False, slots=chosen)
    held = sum(n > 0 for n in chosen)
    label = (f"{max(chosen)} slot{'s' * (max(chosen) != 1)} a layer" if held in (0, scale.layers)
             else f"1 slot in {held} layers")
    return label, rate


def compare(scale: Scale, routes: np.ndarray, profile_tokens: int, kind: str, window: int,
            hw, plan_routes: np.ndarray | None = None) -> tuple[float, float, float]:  # type: ignore[no-untyped-def]
    """Prints the static plan's and the cache's predicted tokens/s at each budget, the plan and
    the cache's priors from the routes' first ``profile_tokens`` tokens (as ``ktc profile`` would
    record them on other text), the rest replayed, beside the ``hindsight`` ceiling over windows
    of ``window`` tokens; with ``plan_routes`` (another trace of the same kind, as ``ktc profile
    --trace`` records one for ``ktc plan --trace``), also the planner's split (``planned``).
    Returns the worst cache/static ratio, that case's ceiling's and the worst planned/static
    (infinite without ``plan_routes``)."""
    head, run = routes[:profile_tokens], routes[profile_tokens:]
    profile = counts(head, scale)
    worst, its_ceiling, worst_planned = float("inf"), float("inf"), float("inf")
    for budget in (0.10, 0.25, 0.50):
        plan = static_plan(profile, scale, budget)
        s_rate, s_hit, _ = replay(run, scale, plan, profile, hw, cached=False)
        c_rate, c_hit, moved = replay(run, scale, plan, profile, hw, cached=True)
        ceiling = hindsight(run, scale, budget, window, hw)
        if c_rate / s_rate < worst:
            worst, its_ceiling = c_rate / s_rate, ceiling / s_rate
        split = ""
        if plan_routes is not None:
            label, p_rate = planned(scale, profile, budget, plan_routes, run, hw)
            worst_planned = min(worst_planned, p_rate / s_rate)
            split = f"; planned {label} {p_rate:7.1f} tok/s ({p_rate / s_rate:.4f}x)"
        print(f"{scale.name:<14} {kind:<9} {100 * budget:3.0f}% in VRAM: static {s_rate:7.1f} tok/s "
              f"(hits {100 * s_hit:5.1f}%), cache {c_rate:7.1f} tok/s (hits {100 * c_hit:5.1f}%, "
              f"{moved / len(run) / 1e6:6.1f} MB uploaded a token): {c_rate / s_rate:.2f}x; hindsight "
              f"{ceiling:7.1f} tok/s ({ceiling / s_rate:.2f}x){split}")
    return worst, its_ceiling, worst_planned


# ----------------------------------------------------------------------------------------------
# Device section: the runtime itself on CUDA


def build_layer_bundles(config: str, workdir: str, budgets: tuple[float, ...], scheme: str) -> dict[float, str]:
    """One-layer checkpoints of ``config``'s shape (vocabulary cut to 1024: only the experts are
    measured), compiled with ``scheme`` for every expert: for each budget the static plan's bundle
    (its most used experts, relabelled to come first, on the device), and at budget 0 the
    all-CPU bundle the cache runs from."""
    import json
    import pathlib
    import shutil

    import torch
    import transformers

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import model_factory as mf

    raw = json.load(open(config))
    raw.update(num_hidden_layers=1, vocab_size=1024)
    folder = os.path.join(workdir, f"{raw['model_type']}-1layer")
    if not os.path.exists(os.path.join(folder, "config.json")):
        print(f"building a one-layer {raw['model_type']} checkpoint (bf16, transformers' initialisation)...",
              flush=True)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.CONFIG_MAPPING[raw["model_type"]].from_dict(raw), dtype=torch.bfloat16)
        shutil.rmtree(folder + ".tmp", ignore_errors=True)
        model.save_pretrained(folder + ".tmp")
        os.replace(folder + ".tmp", folder)
    experts = int(raw.get("num_experts") or raw["num_local_experts"])
    out = {}
    for budget in (0.0, *budgets):
        resident = round(budget * experts)
        path = os.path.join(workdir, f"{scheme}-{resident}.ktb")
        if not os.path.exists(path):
            print(f"compiling {os.path.basename(path)}...", flush=True)
            tmp = pathlib.Path(workdir) / f"tmp-{resident}"
            tmp.mkdir(exist_ok=True)
            made = mf.compile_with_placement(folder, tmp, lambda e: f"{'gpu' if e < resident else 'cpu'}:{scheme}")
            os.replace(made, path)
            shutil.rmtree(tmp)
        out[budget] = path
    return out


def relabel(routes: np.ndarray, profile: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each layer's experts renamed by their rank in the profile (the most used becomes 0): one
    compiled layer then stands for every layer, its first experts their static plan's. Returns
    the renamed routes and profile."""
    ranks = np.empty_like(profile)
    for li in range(profile.shape[0]):
        ranks[li, np.argsort(-profile[li], kind="stable")] = np.arange(profile.shape[1])
    renamed = np.stack([ranks[li][routes[:, li]] for li in range(profile.shape[0])], axis=1)
    return renamed, -np.sort(-profile, axis=1)


def device_section(args) -> int:  # type: ignore[no-untyped-def]
    """The drifting and steady traces at Qwen3-30B-A3B's expert shape through ``ExpertSet`` on
    CUDA (one compiled layer standing for ``--device-layers`` layers, each with its own residents
    or cache slots), static plan against the cache at each budget, in interleaved rounds; then a
    prompt chunk with and without the prefill offload. Prints measured figures beside the time
    model's prediction for the same routes with the bandwidths measured here."""
    import statistics
    import time

    import numba
    import torch

    from ktc.formats.bundle import open_bundle
    from ktc.formats.hardware_profile import HardwareProfile
    from ktc.runtime.bandwidth import read_bandwidth
    from ktc.runtime.calibrate import device_bandwidths
    from ktc.runtime import triton_experts
    from ktc.runtime.experts import ExpertSet
    from ktc.runtime.offload import PrefillOffload

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("device section: no CUDA device here; it measures the runtime on one")
        return 1
    # torch's CPU device stands in where asked (to try the section; its figures say nothing of a GPU)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    name = torch.cuda.get_device_name() if device == "cuda" else "torch's CPU device (standing in)"
    budgets = (0.10, 0.25, 0.50)
    bundles = build_layer_bundles(args.config, args.workdir, budgets, args.scheme)
    link = device_bandwidths(device, nbytes=256 << 20, rounds=3)
    cpu = read_bandwidth()
    # the device path's fixed cost a layer's step, as ktc doctor --calibrate measures it (on its
    # small probe model), for the time model's predictions beside the measured figures
    from ktc.calibrate import PROBES, device_step, probe_bundles

    probe_folder = os.path.join(args.workdir, "probe")
    os.makedirs(probe_folder, exist_ok=True)
    step = device_step(device, probe_bundles(probe_folder, probes=PROBES[:1])[0])
    hw = HardwareProfile(vram_bytes=0, ram_bytes=0, cpu_bandwidth=cpu, device_step_seconds=step, **link)
    print(f"\ndevice section on {name} with {os.cpu_count()} CPUs: measured CPU read "
          f"{cpu / 1e9:.0f} GB/s, GPU {hw.gpu_bandwidth / 1e9:.0f} GB/s, PCIe (page-locked) "
          f"{hw.pcie_bandwidth / 1e9:.1f} GB/s, a layer's step with device experts {1e6 * step:.0f} us more "
          f"than on the CPU alone; {args.device_layers} layers of {args.scheme} experts, "
          f"{args.device_tokens} tokens replayed in {args.rounds} interleaved rounds", flush=True)
    with open_bundle(bundles[0.0]) as probe:
        expert_bytes = sum(probe.tensors[f"layers.0.experts.0.{part}"].nbytes for part in ("gate_up", "down"))
        experts = int(probe.manifest["model"]["moe_layers"][0]["num_experts"])
        hidden_size = int(probe.manifest["model"]["config"]["hidden_size"])
        top_k = int(probe.manifest["model"]["config"].get("num_experts_per_tok", 8))
    scale = Scale("qwen3-30b-a3b", args.device_layers, experts, top_k, expert_bytes)
    hidden = torch.randn((1, hidden_size), device=device, dtype=torch.bfloat16)

    def layers(path: str, slots: int, prior: np.ndarray | None, offload=None,  # type: ignore[no-untyped-def]
               threads=None, on=device) -> tuple:  # type: ignore[type-arg]
        bundle = open_bundle(path)
        return bundle, [ExpertSet(bundle, 0, device=on, cache_slots=slots, offload=offload, cpu_threads=threads,
                                  cache_prior=None if prior is None else prior[li]) for li in range(scale.layers)]

    def close(made: tuple) -> None:  # type: ignore[type-arg]
        for layer in made[1]:
            layer.close()
        made[0].close()

    def decode(sets: list, routes: np.ndarray, kernels: str = "") -> float:  # type: ignore[type-arg]
        # kernels "torch": the device experts through torch's operations, not the fused kernels
        weights = torch.full((1, top_k), 1.0 / top_k)
        before = os.environ.get("KTC_DEVICE_KERNELS")
        os.environ["KTC_DEVICE_KERNELS"] = kernels or (before or "")
        try:
            sync()
            started = time.perf_counter()
            for t in range(len(routes)):
                for li, layer in enumerate(sets):
                    layer.forward_torch(hidden, torch.from_numpy(routes[t, li][None, :]), weights)
                sync()
            return time.perf_counter() - started
        finally:
            if before is None:
                del os.environ["KTC_DEVICE_KERNELS"]
            else:
                os.environ["KTC_DEVICE_KERNELS"] = before

    worst_drift, worst_steady = float("inf"), float("inf")
    for kind, period in (("steady", None), ("drifting", args.period)):
        routes = trace(scale, args.profile_tokens + args.device_tokens, args.zipf, period,
                       np.random.default_rng(args.seed), start=args.profile_tokens)
        routes, profile = relabel(routes, counts(routes[: args.profile_tokens], scale))
        run = routes[args.profile_tokens:]
        segments = np.array_split(np.arange(len(run)), args.rounds)
        for budget in budgets:
            resident = round(budget * experts)
            static = layers(bundles[budget], 0, None)
            cached = layers(bundles[0.0], resident, profile)
            made = {"static": static, "cache": cached}
            if budget == budgets[0]:  # the CPU experts' worker with every core, against one core less
                made["every core"] = layers(bundles[budget], 0, None, threads=numba.get_num_threads())
                made["CPU alone"] = layers(bundles[0.0], 0, None, on=None)
                made["torch's operations"] = layers(bundles[budget], 0, None)
            kernels = {"torch's operations": "torch"}
            for name, sets in made.items():  # compile and warm them outside the timing
                decode(sets[1], routes[args.profile_tokens - 4: args.profile_tokens] if name == "cache" else run[:4],
                       kernels.get(name, ""))
            for layer in cached[1]:  # the warm-up's copies land, its counts go
                layer.cache.wait()
                layer.cache.policy.counters.__init__()
            ratios, seconds = [], dict.fromkeys(made, 0.0)
            for r, part in enumerate(segments):
                order = list(made) if r % 2 == 0 else list(made)[::-1]
                took = {name: decode(made[name][1], run[part], kernels.get(name, "")) for name in order}
                ratios.append(took["static"] / took["cache"])
                for name in took:
                    seconds[name] += took[name]
            if "every core" in made:
                through_torch = len(run) / seconds["torch's operations"]
                print(f"{kind:<9} {100 * budget:3.0f}% in VRAM, static: the CPU experts' worker with "
                      f"{numba.get_num_threads()} threads {len(run) / seconds['every core']:7.1f} tok/s, with one "
                      f"less {len(run) / seconds['static']:7.1f} tok/s; every expert on the CPU "
                      f"{len(run) / seconds['CPU alone']:7.1f} tok/s; the device experts through torch's "
                      f"operations {through_torch:7.1f} tok/s, through the fused "
                      f"kernels ({'on' if triton_experts.enabled(torch.device(device)) else 'off: not here'}) "
                      f"{len(run) / seconds['static']:7.1f} tok/s", flush=True)
                for name in ("every core", "CPU alone", "torch's operations"):
                    close(made[name])
            total = sum(c.uses for c in (layer.cache.counters for layer in cached[1]))
            hits = sum(layer.cache.counters.hits for layer in cached[1])
            late = sum(layer.cache.counters.late for layer in cached[1])
            moved = sum(layer.cache.counters.bytes_uploaded for layer in cached[1])
            plan = [tuple(range(resident))] * scale.layers
            p_static, _, _ = replay(run, scale, plan, profile, hw, cached=False)
            p_cache, p_hit, _ = replay(run, scale, plan, profile, hw, cached=True)
            ratio = statistics.median(ratios)
            print(f"{kind:<9} {100 * budget:3.0f}% in VRAM ({resident} of {experts} a layer): static "
                  f"{len(run) / seconds['static']:7.1f} tok/s, cache {len(run) / seconds['cache']:7.1f} tok/s "
                  f"(hits {100 * hits / total:5.1f}%, late {late}, {moved / len(run) / 1e6:5.1f} MB uploaded a "
                  f"token): {ratio:.2f}x (median of {len(ratios)} rounds); time model {p_cache / p_static:.2f}x "
                  f"(hits {100 * p_hit:5.1f}%, static {p_static:7.1f} tok/s)", flush=True)
            if kind == "drifting":
                worst_drift = min(worst_drift, ratio)
            else:
                worst_steady = min(worst_steady, ratio)
            close(static)
            close(cached)
    print(f"measured worst cache/static: drifting {worst_drift:.2f}x, steady {worst_steady:.2f}x")

    # A prompt chunk through the layers at the smallest budget, without and with the offload.
    budget = budgets[0]
    chunk = routes[: args.prompt]  # the last trace's first tokens
    offload = PrefillOffload(hw.pcie_bandwidth, hw.cpu_bandwidth, args.offload_budget)
    plain, moved = layers(bundles[budget], 0, None), layers(bundles[budget], 0, None, offload=offload)
    states = torch.randn((args.prompt, hidden_size), device=device, dtype=torch.bfloat16)
    weights = torch.full((args.prompt, top_k), 1.0 / top_k)

    def prefill(sets: list) -> float:  # type: ignore[type-arg]
        sync()
        started = time.perf_counter()
        for li, layer in enumerate(sets):
            layer.forward_torch(states, torch.from_numpy(np.ascontiguousarray(chunk[:, li])), weights)
        sync()
        return time.perf_counter() - started

    prefill(plain[1])
    prefill(moved[1])  # measures the CPU's seconds a token, which the choice needs
    offload.counters.__init__()
    times: dict[str, list[float]] = {"cpu": [], "offload": []}
    for r in range(args.rounds):
        pair = (("cpu", plain), ("offload", moved))
        for name, made in (pair if r % 2 == 0 else pair[::-1]):
            times[name].append(prefill(made[1]))
    c = offload.counters
    cpu_s, off_s = statistics.median(times["cpu"]), statistics.median(times["offload"])
    copies = max(c.offloaded, 1)
    print(f"prefill of {args.prompt} tokens, {100 * budget:.0f}% in VRAM: CPU experts "
          f"{args.prompt / cpu_s:7.1f} tok/s, with the offload {args.prompt / off_s:7.1f} tok/s "
          f"({cpu_s / off_s:.2f}x; {c.experts / copies:.1f} experts copied a layer, "
          f"{c.bytes_uploaded / copies / 1e6:.0f} MB; medians of {args.rounds} rounds)")
    close(plain)
    close(moved)
    return 0


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
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        help="also run the device section: the runtime's ExpertSet on CUDA, static plan against "
                             "cache (cpu: torch's CPU device stands in, to try it)")
    parser.add_argument("--config", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                                          "shared", "configs", "qwen3-30b-a3b.json"),
                        help="device section: the model config whose expert shape is measured")
    parser.add_argument("--workdir", default=os.path.join(os.path.expanduser("~"), ".cache", "ktc", "bench-stream"))
    parser.add_argument("--scheme", default="q4_0", help="device section: the experts' scheme")
    parser.add_argument("--device-layers", type=int, default=8)
    parser.add_argument("--device-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=512, help="device section: the prompt chunk's tokens")
    parser.add_argument("--offload-budget", type=int, default=2 << 30,
                        help="device section: the offload's device bytes a forward")
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
        worst, ceiling, _ = compare(scale, routes, min(args.profile_tokens, len(routes) // 4), "recorded", args.period,
                                    hw)
        print(f"recorded trace ({len(routes)} tokens): worst cache/static {worst:.2f}x (hindsight there "
              f"{ceiling:.2f}x)\n")
    if args.synthetic:
        synthetic(args, hw)
    if args.device:
        os.makedirs(args.workdir, exist_ok=True)
        return device_section(args)
    return 0


def synthetic(args, hw) -> None:  # type: ignore[no-untyped-def]
    """The synthetic traces through the time model, each scale steady and drifting."""
    worst_drift, worst_steady = (float("inf"), 0.0, 0.0), (float("inf"), 0.0, 0.0)
    planned_worst = {"drifting": float("inf"), "steady": float("inf")}
    for scale in SCALES:
        for kind, period in (("steady", None), ("drifting", args.period)):
            # the drift starts after the profile's tokens
            routes = trace(scale, args.profile_tokens + args.tokens, args.zipf, period,
                           np.random.default_rng(args.seed), start=args.profile_tokens)
            # the planner's trace: another draw of the same kind (another seed), as ktc profile
            # --trace records one of the same model on other text of the workload: the same
            # popularity at its start (steady routing: throughout), drifting from its start
            first = popularity(scale, np.random.default_rng(args.seed))  # the replayed trace's first
            plan_routes = trace(scale, PLAN_TOKENS, args.zipf, period, np.random.default_rng(args.seed + 1),
                                orders=first)
            worst = compare(scale, routes, args.profile_tokens, kind, args.period if period else args.tokens, hw,
                            plan_routes)
            planned_worst[kind] = min(planned_worst[kind], worst[2])
            if kind == "drifting":
                worst_drift = min(worst_drift, worst)
            else:
                worst_steady = min(worst_steady, worst)
    (drift, drift_ceiling, _), (steady, _, _) = worst_drift, worst_steady
    print(f"\nworst cache/static: drifting {drift:.3f}x (goal at least 1.2x: {'met' if drift >= 1.2 else 'NOT met'}; "
          f"the hindsight ceiling of that case {drift_ceiling:.3f}x), steady {steady:.4f}x (goal never below "
          f"1.0x: {'met' if steady >= 1.0 else 'NOT met'})")
    p_drift, p_steady = planned_worst["drifting"], planned_worst["steady"]
    print(f"worst planned/static (the planner's split from another trace of the kind): drifting {p_drift:.3f}x "
          f"(goal at least 1.2x: {'met' if p_drift >= 1.2 else 'NOT met'}), steady {p_steady:.4f}x (goal never "
          f"below 1.0x: {'met' if p_steady >= 1.0 else 'NOT met'})")


if __name__ == "__main__":
    sys.exit(main())
