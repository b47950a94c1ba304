"""The streaming plan: device cache slots beside the resident experts, the prefill offload's
threshold, and the disk tier, chosen with the placement under the same budgets.

The static solve (``passes/planner.py``) places each expert for good. Slots for the device
expert cache (``runtime/device_cache.py``) take VRAM the residents would otherwise hold, so
they pay only where routing moves: a profile's frequencies say nothing of that (under them the
slots would end up holding the experts a static plan places anyway, and pay the uploads on top).
A recorded routing trace (``ktc profile --trace``) does, so with one the planner tries each
split of the experts' VRAM — 0, 1, 2, 4 and 8 slots a MoE layer, and one slot in a quarter, a half
and three quarters of the MoE layers (those whose replay gains most from one: where the budget
holds under one expert a layer, the uniform splits cannot start), the residents solved again
under what the slots leave — and replays the trace through the cache's own policy
(``runtime.expert_cache``) under the plan's cost model: per layer and token the device's experts
(residents and slots that hit) at their device time, the others at their CPU time, the slower of
the two, a sync where the CPU has any; an upload crosses PCIe one after another and slows the
CPU's experts while under way (the copies read the same host memory). The split with the fewest
predicted milliseconds a token wins; no slots where none gains. Without a trace the plan keeps
no slots and says how to get them.

The prefill offload (``runtime/offload.py``) copies a forward's CPU experts to the device where
the copy beats the CPU: a CPU expert of ``b`` bytes used by ``n`` tokens costs ``b / cpu + n *
t`` (``t``: seconds a token through it, its multiply-adds over ``cpu_prefill_ops``), a copy
``b / pcie``. The fewest tokens a forward needs, on average over the experts, for a copy to pay
is the threshold the runtime then follows; without a measured ``cpu_prefill_ops``
(``ktc doctor --calibrate``) it is llama.cpp's 32. The prediction for a prompt chunk of the
workload's ``prefill_chunk`` tokens compares the MoE layers' experts with and without the
offload (attention and the device's own products left out).

With a typical request given (``Workload.prompt_tokens``/``new_tokens``, ``--request P:N``) the
planner also weighs prefill against decode: it solves the residents again with VRAM held for the
offload's copies (a quarter, half, one and two MoE layers of CPU experts' bytes) and keeps the
buffer whose request — the prompt at the offload's predicted prefill rate plus the new tokens at
the predicted decode — is fastest, none unless one gains at least 1%. A resident given up costs
every decode step; a buffer pays once a prompt, so only prompt-heavy requests hold one.

The disk tier is the solve's own (``disk:`` placements); the plan counts it here, and the
runtime reads the RAM experts in and prefetches the disk ones a layer ahead.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ktc.errors import BudgetError, ConfigError, FormatError
from ktc.ir import Device
from ktc.runtime.offload import LLAMA_CPP_MIN_TOKENS as DEFAULT_PREFILL_MIN_TOKENS  # where unmeasured

CANDIDATE_SLOTS = (1, 2, 4, 8)  # slots a MoE layer the split tries beside none
SPARSE_SHARES = (0.25, 0.5, 0.75)  # shares of the MoE layers the split also tries one slot in
REPLAY_TOKENS = 1024  # at most this many of a trace's tokens are replayed
# Offload buffers tried beside none, in MoE layers' worth of CPU experts' bytes: with copies made
# a layer ahead a forward's own take half the buffer, so 2 copies a whole layer.
OFFLOAD_LAYERS = (0.25, 0.5, 1.0, 2.0)
OFFLOAD_MIN_GAIN = 0.01  # a buffer is held only where the request is at least this much faster


@dataclass(frozen=True)
class SplitResult:
    """One split of the experts' VRAM between residents and slots, replayed."""

    slots: int  # a MoE layer, of the layers that hold any
    gpu_experts: int  # residents
    ms_per_token: float  # predicted decode: the plan's constant part plus the replayed experts
    hit_rate: float  # expert uses on the device (residents and slot hits)
    uploaded_per_token: float  # bytes
    layer_slots: tuple[int, ...] = ()  # each MoE layer's

    @property
    def held(self) -> int:
        """The MoE layers that hold slots."""
        return sum(n > 0 for n in self.layer_slots)

    @property
    def label(self) -> str:
        """``4`` (a layer), or ``1 in 8 layers`` where some layers hold none."""
        held = self.held
        if not self.slots or held == len(self.layer_slots):
            return str(self.slots)
        return f"{self.slots} in {held} layer{'s' * (held != 1)}"


@dataclass(frozen=True)
class OffloadSplit:
    """One split of the experts' VRAM between residents and the prefill offload's buffer."""

    vram: int  # bytes held for the offload's copies
    gpu_experts: int  # residents
    decode_ms_per_step: float
    prefill_tokens_per_s: float  # the MoE layers' experts, a prompt chunk, with the offload
    request_seconds: float  # the prompt's prefill plus the new tokens' decode


@dataclass(frozen=True)
class StreamingPlan:
    cache_slots: int  # device slots a MoE layer the runtime keeps (0: none), in the layers that hold any
    slot_scheme: str | None  # the CPU experts' most common scheme: what a slot holds
    slot_bytes: int  # one slot
    evidence: str  # what the choice of slots rests on
    splits: tuple[SplitResult, ...]  # the static plan's first (0 slots), then each split tried
    prefill_min_tokens: int | None  # a forward's fewest tokens for the offload (None: no CPU experts)
    prefill_basis: str
    prefill_static_tokens_per_s: float | None  # the MoE layers' experts, a prompt chunk
    prefill_offload_tokens_per_s: float | None
    disk_experts: int
    offload_vram: int = 0  # VRAM held for the offload's copies in place of residents
    offload_evidence: str = ""  # what the buffer's size rests on
    offload_splits: tuple[OffloadSplit, ...] = ()  # no buffer first, then each tried
    layer_slots: tuple[int, ...] = ()  # each MoE layer's slots (empty: ``cache_slots`` in every layer)

    @property
    def chosen(self) -> SplitResult | None:
        if not self.cache_slots:
            return self.static
        return next((s for s in self.splits if s.layer_slots == self.layer_slots), None)

    @property
    def static(self) -> SplitResult | None:
        return self.splits[0] if self.splits else None

    def to_json(self) -> dict[str, Any]:
        return {"cache_slots": self.cache_slots, "slot_scheme": self.slot_scheme, "slot_bytes": self.slot_bytes,
                "cache_vram_bytes": 0,  # filled by the plan (every layer's slots)
                "evidence": self.evidence, "splits": [dataclasses.asdict(s) for s in self.splits],
                "prefill_min_tokens": self.prefill_min_tokens, "prefill_basis": self.prefill_basis,
                "prefill_static_tokens_per_s": self.prefill_static_tokens_per_s,
                "prefill_offload_tokens_per_s": self.prefill_offload_tokens_per_s,
                "disk_experts": self.disk_experts,
                "prefill_offload_vram_bytes": self.offload_vram, "offload_evidence": self.offload_evidence,
                "offload_splits": [dataclasses.asdict(s) for s in self.offload_splits],
                "layer_slots": list(self.layer_slots)}


def load_trace(path: str, moe_layers: int, num_experts: int) -> np.ndarray:
    """A routing trace written by ``ktc profile --trace`` ([tokens, MoE layers, k] expert
    numbers), checked against the model."""
    try:
        routes = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise FormatError(f"cannot read the routing trace ({exc})", path=path) from None
    if routes.ndim != 3 or not np.issubdtype(routes.dtype, np.integer) or routes.shape[0] < 2:
        raise FormatError(f"not a routing trace: an integer array [tokens, MoE layers, k] was expected, "
                          f"this one is {routes.dtype} {list(routes.shape)}", path=path,
                          hint="write one with ktc profile BUNDLE --text FILE -o p.json --trace routes.npy")
    if routes.shape[1] != moe_layers or routes.min() < 0 or routes.max() >= num_experts:
        raise ConfigError(f"the routing trace has {routes.shape[1]} MoE layers and experts up to "
                          f"{int(routes.max())}; this model has {moe_layers} MoE layers of {num_experts} experts",
                          path=path, hint="record the trace with a bundle of this model")
    return routes


def _slot_scheme(placement: Any) -> str | None:
    """The CPU experts' most common scheme (the runtime's slots hold that one)."""
    counts: dict[str, int] = {}
    for row in placement.experts:
        for p in row:
            if p.device is Device.CPU:
                counts[p.scheme] = counts.get(p.scheme, 0) + 1
    return max(counts, key=lambda s: (counts[s], s)) if counts else None


def _seconds(ctx: Any, placement: Any) -> tuple[np.ndarray, np.ndarray]:
    """([layers, experts] seconds a use of each expert takes where the plan keeps it, whether
    that is on the device)."""
    index = {(o.device, o.scheme): o for o in ctx.problem.options}
    seconds = np.array([[index[(p.device.value, p.scheme)].seconds_per_use for p in row]
                        for row in placement.experts])
    on_gpu = np.array([[p.device is Device.GPU for p in row] for row in placement.experts])
    return seconds, on_gpu


def replay(routes: np.ndarray, plan: Any, ctx: Any, slots: int | tuple[int, ...], slot_scheme: str | None,
           slot_bytes: int) -> SplitResult:
    """The trace under ``plan``'s placement with ``slots`` cache slots a layer (or each MoE
    layer's, a tuple; see the module's docstring for the time model)."""
    return _replay(routes, plan, ctx, slots, slot_scheme, slot_bytes)[0]


def _replay(routes: np.ndarray, plan: Any, ctx: Any, slots: int | tuple[int, ...], slot_scheme: str | None,
            slot_bytes: int) -> tuple[SplitResult, Any]:
    """``replay``, and the ``expert_cache.Replay`` it rests on (each layer's seconds too)."""
    from ktc.runtime.expert_cache import LayerCache, replay_trace

    hw = plan.hardware
    seconds, on_gpu = _seconds(ctx, plan.placement)
    layer_slots = (slots,) * len(on_gpu) if isinstance(slots, int) else tuple(slots)
    caches = None
    if any(layer_slots):
        usage = ctx.problem.usage
        caches = []
        for li, row in enumerate(plan.placement.experts):
            resident = tuple(int(e) for e in np.flatnonzero(on_gpu[li]))
            eligible = tuple(e for e, p in enumerate(row) if p.device is Device.CPU and p.scheme == slot_scheme)
            caches.append(LayerCache(len(row), layer_slots[li], slot_bytes, resident=resident, prior=usage[li],
                                     eligible=eligible))
    device_seconds = np.where(on_gpu, seconds, slot_bytes / hw.gpu_bandwidth)
    cpu_seconds = np.where(on_gpu, 0.0, seconds)
    result = replay_trace(routes, caches, [frozenset(np.flatnonzero(g).tolist()) for g in on_gpu],
                          device_seconds, cpu_seconds, ctx.problem.sync_seconds,
                          slot_bytes / hw.pcie_bandwidth, hw.cpu_bandwidth, hw.pcie_bandwidth,
                          hw.device_step_seconds)
    tokens = len(routes)
    return SplitResult(max(layer_slots, default=0), int(on_gpu.sum()), plan.constant_ms + 1e3 * result.seconds / tokens,
                       result.hits / max(result.uses, 1), result.uploaded * slot_bytes / tokens, layer_slots), result


def candidate_splits(gains: np.ndarray, room: int) -> list[tuple[int, ...]]:
    """Each MoE layer's slots in every split tried beside none, each once: one slot in
    ``SPARSE_SHARES`` of the layers (``sparse_slots`` of each layer's ``gains``), then
    ``CANDIDATE_SLOTS`` in every layer, growing; ``room``: the most slots a layer may take (its
    experts less the ones a token uses)."""
    layers = len(gains)
    tries = [sparse_slots(gains, share) for share in SPARSE_SHARES] if room >= 1 else []
    tries += [(n,) * layers for n in CANDIDATE_SLOTS if n <= room]
    return [t for t in dict.fromkeys(tries) if any(t)]


def sparse_slots(gains: np.ndarray, share: float) -> tuple[int, ...]:
    """One slot in ``share`` of the layers (rounded; at least one), those of the largest
    ``gains`` (seconds a layer saves with one slot) and only where it saves any: each layer's
    slots (all none where no layer gains)."""
    count = min(max(round(share * len(gains)), 1), int((gains > 0).sum()))
    chosen = np.argsort(-gains, kind="stable")[:count]
    out = np.zeros(len(gains), dtype=np.int64)
    out[chosen] = 1
    return tuple(int(n) for n in out)


def _prefill(plan: Any, shape: Any, slot_scheme: str, free_vram: int, chunk: int | None = None
             ) -> tuple[int, str, float | None, float | None]:
    """(a forward's fewest tokens for the offload, what it rests on, the MoE layers' experts'
    prefill tokens/s over a chunk — ``chunk`` tokens, else the workload's ``prefill_chunk`` —
    without and with the offload: None unmeasured)."""
    from ktc.formats.schemes import expert_footprint
    from ktc.runtime.offload import PrefillOffload

    hw, model = plan.hardware, plan.model
    stored = {}  # scheme -> an expert's bytes
    for row in plan.placement.experts:
        for p in row:
            if p.scheme not in stored:
                stored[p.scheme] = expert_footprint(shape, p.scheme).data_bytes
    ops = hw.cpu_prefill_ops
    if not ops > 0:
        return (DEFAULT_PREFILL_MIN_TOKENS, "llama.cpp's threshold (the CPU's prefill rate is not measured: "
                "ktc doctor --calibrate)", None, None)
    per_token = 6.0 * model.hidden_size * model.expert_intermediate_size / ops  # gate, up, down
    extra = stored[slot_scheme] * (1.0 / hw.pcie_bandwidth - 1.0 / hw.cpu_bandwidth)
    per_expert = max(math.ceil(extra / per_token), 1) if extra > 0 else 1
    # each of a forward's tokens uses k of the layer's experts: per_expert tokens each on average
    min_tokens = max(math.ceil(per_expert * model.num_experts / model.top_k), 1)
    chunk = chunk or plan.workload.prefill_chunk
    share = plan.profile.selection_probability(model.top_k)  # a token's use of each expert
    offload = PrefillOffload(hw.pcie_bandwidth, hw.cpu_bandwidth, free_vram, min_tokens=1)
    offload.lookahead = True  # as the runtime runs it: a forward's own copies take half the VRAM
    static = offloaded = 0.0
    for li, row in enumerate(plan.placement.experts):
        work = []
        for e, p in enumerate(row):
            if p.device is not Device.GPU:
                # (a disk expert's read counted at the RAM's bandwidth, as the runtime's offload does)
                offload.seconds_per_token[p.scheme] = per_token
                work.append((e, p.scheme, chunk * float(share[li, e]), stored[p.scheme]))
        cpu = sum(offload.cpu_seconds(s, n, b) or 0.0 for _, s, n, b in work)
        static += cpu
        # (below the threshold the runtime copies nothing)
        chosen = set(offload.choose(work, chunk)) if work and chunk >= min_tokens else set()
        left = sum(offload.cpu_seconds(s, n, b) or 0.0 for e, s, n, b in work if e not in chosen)
        copying = sum(b for e, _, _, b in work if e in chosen) / hw.pcie_bandwidth
        offloaded += max(left, copying)
    basis = (f"a copy pays from {per_expert} token{'s' * (per_expert > 1)} an expert (the CPU's measured "
             f"{ops / 1e9:.3g} GOP/s)")
    return min_tokens, basis, chunk / static if static > 0 else None, chunk / offloaded if offloaded > 0 else None


def plan_streaming(ir: Any, plan: Any, trace: str | None, *, replan: Any) -> tuple[Any, StreamingPlan]:
    """(the plan to keep — ``plan``, or the one solved under a split that gains — and its
    streaming plan). ``replan(cache_vram, offload_vram=0)``: the plan solved again with that many
    bytes of VRAM held for slots (and for the prefill offload's copies; ``BudgetError`` where it
    does not fit)."""
    from ktc.formats.schemes import expert_footprint
    from ktc.passes.planner import build_context, expert_shape

    slot_scheme = _slot_scheme(plan.placement)
    disk = sum(p.device is Device.DISK for row in plan.placement.experts for p in row)
    if slot_scheme is None:
        return plan, StreamingPlan(0, None, 0, "every expert is on the device", (), None,
                                   "no CPU experts", None, None, disk)
    if plan.hardware.cpu_only:
        return plan, StreamingPlan(0, None, 0, "no GPU (--vram 0)", (), None, "no GPU", None, None, disk)
    slot_bytes = expert_footprint(expert_shape(ir), slot_scheme).data_bytes  # what a slot holds
    layers = len(plan.placement.layers)
    chosen, splits = plan, []
    if trace is None:
        evidence = "no routing trace (ktc plan --trace FILE, from ktc profile --trace, plans cache slots)"
    elif plan.workload.batch != 1:
        evidence = "a routing trace replays one sequence: cache slots are planned for --batch 1"
    else:
        routes = load_trace(trace, layers, plan.model.num_experts)[:REPLAY_TOKENS]
        ctx = build_context(ir, plan.hardware, plan.workload, plan.profile, plan.options)
        base, base_run = _replay(routes, plan, ctx, 0, slot_scheme, slot_bytes)
        splits.append(base)
        best = base
        room = plan.model.num_experts - plan.model.top_k
        # each layer's seconds saved by one slot of its own, under the static placement
        gains = (base_run.layer_seconds - _replay(routes, plan, ctx, 1, slot_scheme, slot_bytes)[1].layer_seconds
                 if room >= 1 else np.zeros(layers))
        for layer_slots in candidate_splits(gains, room):
            try:
                candidate = replan(sum(layer_slots) * slot_bytes)
            except BudgetError:
                if len(set(layer_slots)) == 1:
                    break  # the uniform splits come in growing order
                continue
            result = replay(routes, candidate, ctx, layer_slots, slot_scheme, slot_bytes)
            splits.append(result)
            if result.ms_per_token < best.ms_per_token:
                best, chosen = result, candidate
        evidence = f"the routing trace {trace} ({len(routes)} tokens replayed)"
    layer_slots = best.layer_slots if chosen is not plan else ()
    slots = max(layer_slots, default=0)
    shape = expert_shape(ir)

    def decode_ms(candidate: Any) -> float:  # a step: the replay where slots are kept
        if not slots:
            return candidate.predicted_ms_per_step
        return replay(routes, candidate, ctx, layer_slots, slot_scheme, slot_bytes).ms_per_token

    cache_vram = chosen.options.cache_vram
    chosen, offload_evidence, offload_splits = _trade_for_offload(
        chosen, shape, slot_scheme, decode_ms, lambda vram: replan(cache_vram, vram))
    free = plan.hardware.vram_bytes - chosen.memory.vram_total + chosen.options.offload_vram
    min_tokens, basis, static, offloaded = _prefill(chosen, shape, slot_scheme, max(free, 0))
    return chosen, StreamingPlan(slots, slot_scheme, slot_bytes, evidence, tuple(splits), min_tokens, basis,
                                 static, offloaded, disk, chosen.options.offload_vram, offload_evidence,
                                 offload_splits, layer_slots)


def _trade_for_offload(plan: Any, shape: Any, slot_scheme: str, decode_ms: Any, replan: Any
                       ) -> tuple[Any, str, tuple[OffloadSplit, ...]]:
    """(the plan to keep — ``plan``, or one solved again with VRAM held for the prefill
    offload's copies — what that rests on, the splits tried). ``decode_ms(plan)``: a plan's
    predicted decode step; ``replan(offload_vram)``: the plan solved with that buffer."""
    from ktc.formats.schemes import expert_footprint

    workload, hw = plan.workload, plan.hardware
    if not workload.prompt_tokens:
        return plan, "no request given (--request PROMPT:NEW weighs prefill against decode)", ()
    if not hw.cpu_prefill_ops > 0:
        return plan, "the CPU's prefill rate is not measured (ktc doctor --calibrate)", ()
    chunk = min(workload.prompt_tokens, workload.prefill_chunk)
    layer_bytes = plan.model.num_experts * expert_footprint(shape, slot_scheme).data_bytes

    def split(candidate: Any, vram: int) -> OffloadSplit:
        free = hw.vram_bytes - candidate.memory.vram_total + vram
        _, _, static, offloaded = _prefill(candidate, shape, slot_scheme, max(free, 0), chunk)
        rate = offloaded or static or math.inf
        step = decode_ms(candidate)
        seconds = workload.prompt_tokens / rate + workload.new_tokens * step / 1e3
        return OffloadSplit(vram, sum(candidate.placement.gpu_experts_per_layer()), step, rate, seconds)

    splits = [split(plan, 0)]
    chosen, best = plan, splits[0]
    for layers in OFFLOAD_LAYERS:
        vram = int(layers * layer_bytes)
        try:
            candidate = replan(vram)
        except BudgetError:
            break
        result = split(candidate, vram)
        splits.append(result)
        if result.request_seconds < min(best.request_seconds, splits[0].request_seconds * (1 - OFFLOAD_MIN_GAIN)):
            chosen, best = candidate, result
        if not sum(candidate.placement.gpu_experts_per_layer()):
            break  # no residents left to trade
    request = f"a request of {workload.prompt_tokens} prompt and {workload.new_tokens} new tokens"
    if chosen is plan:
        return plan, f"{request}: no buffer makes it faster", tuple(splits)
    return chosen, (f"{request}: {best.request_seconds:.3g} s against {splits[0].request_seconds:.3g} s "
                    f"without a buffer"), tuple(splits)
