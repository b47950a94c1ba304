"""``ktc doctor --calibrate``: measure what the CPU decode cost model (``passes/decode_cost.py``)
assumes on this machine and return it as a hardware profile.

Two measurements. ``runtime.calibrate.scheme_bandwidths``: the bytes per second ktc's
one-token kernels reach at each scheme. ``layer_costs``: the fixed cost of a decoder layer's
step (norms, rotary, attention over a short context, routing, Python) and of a token's outside
its layers and lm_head (the embedding row, the sampling over the vocabulary, Python), from the
decode steps of three small probe models, which time their layers and lm_head: the layers' time
less what their bytes cost at the rates just measured, over one and six layers at a vocabulary
of 1024; the rest of a step at that vocabulary and at Qwen3's 151936 (the sampling reads every
logit, which the lm_head's threads have just written; the larger probe streams more than the
L3 holds, as a real model does).
The probes have a shape of their own (not the demo model's nor any real model's), so a
prediction for those models is not fitted to them.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from ktc.demo import DEMO_CONFIG, write_demo_model
from ktc.formats.hardware_profile import HardwareProfile

PROBE_CONFIG: dict[str, object] = {**DEMO_CONFIG, "hidden_size": 128, "intermediate_size": 256,
                                   "moe_intermediate_size": 64, "num_attention_heads": 2,
                                   "num_key_value_heads": 1, "head_dim": 64, "num_experts": 8,
                                   "num_experts_per_tok": 2}
# (layers, vocabulary, hidden size): the last one's lm_head (78 MB at int8) is more than the L3
# holds, as a real model's step streams more than it: the sampling then reads logits that are not
# in the caches
PROBES = ((1, 1024, 128), (6, 1024, 128), (1, 151936, 512))
PROMPT = list(range(3, 11))  # 8 prompt tokens: the decode steps read a short KV cache


def _decode_seconds(model: Any, tokens: int) -> tuple[float, float]:
    """(seconds a decode step of ``model`` takes as ``ktc run`` times it, the step and a greedy
    sample; of that, seconds outside the layers and lm_head), over ``tokens`` steps after a
    prompt. ``model``: a ``runtime.hf.KtcModel`` that ktc's decode steps run (they time their
    layers and lm_head). Generate's loop without its detokenizer: a probe's tokenizer has fewer
    tokens than its vocabulary."""
    import time

    import torch

    from ktc.runtime.generate import Sampling, sample

    greedy, fast = Sampling(temperature=0.0), model.fast
    if fast is None:
        from ktc.errors import KtcError

        raise KtcError("the calibration times ktc's own decode steps, which are off here",
                       hint="unset KTC_FAST_DECODE=0")
    model.new_cache()
    with torch.inference_mode():
        token = sample(torch.from_numpy(model.forward_window(np.asarray(PROMPT), len(PROMPT) - 1,
                                                             len(PROMPT))[0]), greedy, None)
        fast.seconds[:] = 0
        fast.steps = 0
        started = time.perf_counter()
        for _ in range(tokens):
            token = sample(fast.step(token), greedy, None)
        seconds = (time.perf_counter() - started) / tokens
    return seconds, seconds - float(fast.seconds.sum()) / fast.steps


def probe_bundles(folder: str, progress: Callable[[str], None] | None = None,
                  probes: tuple[tuple[int, int, int], ...] = PROBES) -> list[str]:
    """The probe models (``PROBE_CONFIG`` at each of ``probes``), compiled with every expert on
    the CPU into ``folder``."""
    from ktc.compile import compile_bundle

    paths = []
    for layers, vocab, hidden in probes:
        path = os.path.join(folder, f"probe-{layers}-{vocab}-{hidden}.ktb")
        if not os.path.exists(path):
            if progress:
                progress(f"probe model of {layers} layer{'s' * (layers > 1)}, vocabulary {vocab}, hidden {hidden}")
            config = {**PROBE_CONFIG, "num_hidden_layers": layers, "vocab_size": vocab, "hidden_size": hidden,
                      "num_attention_heads": hidden // 64}
            source = write_demo_model(os.path.join(folder, f"probe-{layers}-{vocab}-{hidden}"), config=config)
            compile_bundle(source, path, cpu_scheme="int8", max_tokens=256, check=False)
        paths.append(path)
    return paths


def layer_costs(hw: HardwareProfile, *, rounds: int = 7, tokens: int = 48, bundles: list[str] | None = None,
                progress: Callable[[str], None] | None = None) -> tuple[float, float, float]:
    """(seconds a decoder layer's step costs beside its bytes, seconds a token's costs outside its
    layers and lm_head, and seconds more a token a word of the vocabulary), from the probe models
    (see the module's docstring; ``bundles``: made by ``probe_bundles`` already): a layer's, from
    the step and the sample less lm_head and the layers' bytes at ``hw``'s rates over one and six
    layers (what lies outside the layers grows with them, and is theirs); a token's, what the step
    and the sample take beside the layers and lm_head at one layer; medians over interleaved
    rounds."""
    if bundles is None:
        with tempfile.TemporaryDirectory(prefix="ktc-calibrate-") as tmp:
            return layer_costs(hw, rounds=rounds, tokens=tokens, bundles=probe_bundles(tmp, progress))
    from ktc.formats.bundle import open_bundle
    from ktc.passes.decode_cost import bundle_decode_cost
    from ktc.runtime.hf import from_bundle

    if progress:
        progress("the probe models' decode steps")
    bytes_only = replace(hw, cpu_layer_seconds=0.0, cpu_token_seconds=0.0, cpu_vocab_seconds=0.0)
    models, layer_bytes, head_bytes = [], [], []
    try:
        for path in bundles:
            with open_bundle(path) as bundle:
                cost = bundle_decode_cost(bundle, bytes_only, context=len(PROMPT) + tokens // 2)
            assert cost is not None  # every expert is on the CPU
            layer_bytes.append(cost.matrices + cost.experts + cost.kv)
            head_bytes.append(cost.head)
            models.append(from_bundle(path))
        for model in models:  # compile the kernels and warm the caches, outside the timing
            _decode_seconds(model, 4)
        layers: list[list[float]] = [[] for _ in models]
        rest: list[list[float]] = [[] for _ in models]
        heads: list[list[float]] = [[] for _ in models]
        for _ in range(rounds):
            for i, model in enumerate(models):
                whole, outside = _decode_seconds(model, tokens)
                head = float(model.fast.seconds[-1]) / model.fast.steps
                # the whole step but lm_head, less the layers' bytes: what a step spends outside
                # its layers grows with them too (their weights evict its Python from the
                # caches: 30 us a step at one probe layer, 45 at six, measured)
                layers[i].append(whole - head - layer_bytes[i])
                rest[i].append(outside)
                heads[i].append(head - head_bytes[i])
    finally:
        for model in models:
            model.close()
    (l0, v0, _), (l1, _, _), (_, v2, _) = PROBES
    per_layer = max((float(np.median(layers[1])) - float(np.median(layers[0]))) / (l1 - l0), 0.0)
    r0, r2 = float(np.median(rest[0])), float(np.median(rest[2]))
    per_word = max((r2 - r0) / (v2 - v0), 0.0)
    # lm_head's call in a step beyond its cost called back to back, as the rates were measured:
    # after the layers its code and its rows are cold (the trained demo's: 48-56 us in a step,
    # 22-24 alone)
    head_extra = max(float(np.median(heads[0])), 0.0)
    return per_layer, max(r0 - v0 * per_word, 0.0) + head_extra, per_word


def device_step(device: Any, bundle_path: str, *, rounds: int = 7, steps: int = 48) -> float:
    """Seconds a MoE layer's decode step costs more when some of its experts run on ``device``
    than when every one runs on the CPU: the device path's fixed cost (kernel launches, torch's
    dispatch, the synchronising copies, the hand-off to the CPU experts' thread), which the
    planner adds to a layer with GPU experts (``HardwareProfile.device_step_seconds``). The
    first MoE layer of a probe model (``probe_bundles``; experts small enough that their bytes
    cost next to nothing), every step one expert on the device and one on the CPU: half the
    experts in device slots held fixed, as a plan's residents would be; against the same layer
    with every expert on the CPU, called from a hidden state on the device as a model's layer is;
    medians of interleaved rounds."""
    import statistics
    import time

    import torch

    from ktc.formats.bundle import open_bundle
    from ktc.runtime.experts import ExpertSet

    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rng = np.random.default_rng(0)
    with open_bundle(bundle_path) as bundle:
        info = bundle.manifest["model"]["moe_layers"][0]
        experts, layer = int(info["num_experts"]), int(info["layer"])
        half = experts // 2
        alone = ExpertSet(bundle, layer)
        mixed = ExpertSet(bundle, layer, device=device, cache_slots=half,
                          cache_prior=np.r_[np.full(half, 100.0), np.ones(experts - half)])
        try:
            assert mixed.cache is not None
            mixed.cache.wait()
            mixed.cache.policy.margin = float("inf")  # no evictions: the slots stay the first half
            routes = np.stack([rng.integers(0, half, steps), rng.integers(half, experts, steps)], axis=1)
            hidden = torch.randn((1, alone.hidden_size), device=device,
                                 dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
            weights = torch.full((1, 2), 0.5)

            def timed(layer_experts: ExpertSet) -> float:
                sync()
                started = time.perf_counter()
                for route in routes:
                    layer_experts.forward_torch(hidden, torch.from_numpy(route[None, :]), weights)
                    sync()
                return (time.perf_counter() - started) / steps

            timed(alone), timed(mixed)  # compile and warm, outside the timing
            on_cpu, on_device = [], []
            for _ in range(rounds):
                on_cpu.append(timed(alone))
                on_device.append(timed(mixed))
        finally:
            alone.close()
            mixed.close()
    return max(statistics.median(on_device) - statistics.median(on_cpu), 0.0)


def calibrate(base: HardwareProfile, *, schemes: tuple[str, ...] | None = None, rounds: int = 5,
              bundles: list[str] | None = None, progress: Callable[[str], None] | None = None,
              mapped: bool = True, kept: dict[Any, Any] | None = None, interleave: bool = True) -> HardwareProfile:
    """``base`` with the CPU decode cost model's figures measured here (``schemes``: those
    only; ``bundles``: the probe models, made by ``probe_bundles`` already), and on a CUDA
    machine the device's: its bandwidths and its step's fixed cost (``device_step``). The
    kernels' rates are measured on weights read through a file's map beside the probe models, as
    ``ktc run`` reads a bundle; ``mapped=False``: from the process's memory, as ``ktc run
    --no-mmap`` reads it. ``kept``: the kernels' probes, kept from one call to the next
    (``runtime.calibrate.scheme_bandwidths``): making them takes most of a call. ``interleave``:
    the schemes ``ktc run`` reads from interleaved copies on this CPU measured so (False: the
    stored layout, as ``ktc run --no-interleave`` reads it)."""
    if bundles is None:
        with tempfile.TemporaryDirectory(prefix="ktc-calibrate-") as tmp:
            return calibrate(base, schemes=schemes, rounds=rounds, bundles=probe_bundles(tmp, progress),
                             progress=progress, mapped=mapped, kept=kept, interleave=interleave)
    from ktc.runtime.calibrate import prefill_ops, scheme_bandwidths

    rates = scheme_bandwidths(schemes, rounds=rounds, progress=progress,
                              mapped=os.path.dirname(os.path.abspath(bundles[0])) if mapped else None, kept=kept,
                              interleave=interleave)
    if progress:
        progress("the batched products of a prompt's tokens")
    measured = replace(base, cpu_scheme_bandwidth=rates, cpu_prefill_ops=prefill_ops(rounds=rounds))
    per_layer, per_token, per_word = layer_costs(measured, rounds=max(rounds, 5), bundles=bundles, progress=progress)
    measured = replace(measured, cpu_layer_seconds=per_layer, cpu_token_seconds=per_token, cpu_vocab_seconds=per_word,
                       source=f"{base.source}, calibrated{'' if mapped else ' (the weights in memory, not mapped)'}")
    import torch

    if torch.cuda.is_available():  # the GPU's read bandwidth and the upload from pinned host memory
        from ktc.runtime.calibrate import device_bandwidths

        if progress:
            progress("the GPU's bandwidth and PCIe uploads")
        measured = replace(measured, **device_bandwidths("cuda"))
        if progress:
            progress("the fixed cost of a layer's step with experts on the GPU")
        measured = replace(measured, device_step_seconds=device_step("cuda", bundles[0], rounds=max(rounds, 5)))
    return measured
