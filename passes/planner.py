"""The planner: memory model, cost model, the placement it solves for, and today's baselines.

docs/planner.md describes the model in full; the short version:

- VRAM holds the non-expert weights (attention, norms, routers, shared experts, dense MLPs,
  lm_head) at ``dense_scheme``, the KV cache for ``max_tokens``, an activation workspace, the
  reserve, and the GPU experts. RAM holds the CPU experts and the input embedding table.
- A decode step reads every GPU-resident non-expert weight once (a constant), then per MoE layer
  the experts the batch routes to. GPU and CPU experts run at once, so a layer costs
  ``max(gpu_time, cpu_time)`` plus a synchronisation when a CPU expert can be used.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from ktc.errors import BudgetError, ConfigError, InternalError
from ktc.formats.activation_profile import ActivationProfile, uniform_profile
from ktc.formats.hardware_profile import HardwareProfile, format_bytes, format_parts
from ktc.formats.schemes import (
    ExpertShape, expert_footprint, expert_scheme_error, expert_scheme_name, expert_schemes,
    expert_tensor_bytes, non_expert_bytes, source_scheme,
)
from ktc.ir import Device, ExpertPlacement, ModelIR, Placement, TensorRole, is_input_embedding

from .base import Pass, PassContext
from .decode_cost import rate
from .placement_solver import (
    CPU, DISK, GPU, PlacementOption, PlacementProblem, PlacementSolution, evaluate, is_feasible,
    solve_placement,
)
from .plan import (
    BaselineResult, MemoryBreakdown, ModelFacts, Plan, PlannerOptions, SolveInfo, Workload,
    workspace_bytes,
)
from .plan_verify import verify_plan

# ----------------------------------------------------------------------------------------------
# Memory model


def expert_shape(ir: ModelIR) -> ExpertShape:
    expert = ir.moe_layers[0].experts[0]
    return ExpertShape(ir.config.hidden_size, expert.intermediate_size, expert.gate_bias is not None)


def non_expert_memory(ir: ModelIR, scheme: str) -> tuple[dict[str, int], dict[str, int], int]:
    """(VRAM bytes by component, RAM bytes by component, bytes read per decode step: all of
    the VRAM part).

    Layers past ``num_layers`` (DeepSeek-V3's multi-token-prediction layer) are not loaded.
    The input embedding table stays in RAM (one row is read per token); lm_head is on the GPU.
    """
    vram = dict.fromkeys(("attention", "norms", "routers", "shared_experts", "dense_mlp",
                          "lm_head", "other"), 0)
    ram = {"embeddings": 0}
    role_key = {TensorRole.ATTENTION: "attention", TensorRole.NORM: "norms",
                TensorRole.ROUTER: "routers", TensorRole.SHARED_EXPERT: "shared_experts",
                TensorRole.DENSE_MLP: "dense_mlp", TensorRole.OTHER: "other"}
    for tensor in ir.dense:
        if tensor.layer is not None and tensor.layer >= ir.config.num_layers:
            continue
        nbytes = non_expert_bytes(tensor.ref.shape, router=tensor.role is TensorRole.ROUTER,
                                  dense_scheme=scheme, source_dtype=tensor.ref.dtype)
        if tensor.role is TensorRole.EMBEDDING:
            is_input = is_input_embedding(tensor.ref.name)
            if is_input and not ir.config.tie_word_embeddings:
                ram["embeddings"] += nbytes
                continue
            vram["lm_head"] += nbytes
        else:
            vram[role_key.get(tensor.role, "other")] += nbytes
    for layer in ir.moe_layers:
        for ref in (layer.router, layer.router_bias, layer.score_correction_bias):
            if ref is not None:
                vram["routers"] += non_expert_bytes(ref.shape, router=True, dense_scheme=scheme)
        if layer.shared_expert_gate is not None:
            vram["shared_experts"] += non_expert_bytes(layer.shared_expert_gate.shape, router=True,
                                                       dense_scheme=scheme)
        vram["shared_experts"] += sum(non_expert_bytes(t.shape, router=False, dense_scheme=scheme,
                                                       source_dtype=t.dtype)
                                      for e in layer.shared_experts for t in e.tensors)
    return vram, ram, sum(vram.values())


# ----------------------------------------------------------------------------------------------
# Building the problem


@dataclass(frozen=True, eq=False)
class PlanningContext:
    """Everything derived from the model and budgets before solving."""

    problem: PlacementProblem
    profile: ActivationProfile
    fixed_vram: dict[str, int]  # everything in VRAM but the experts
    fixed_ram: dict[str, int]
    constant_seconds: float
    kv_bytes_per_token: int
    moe_layers: tuple[int, ...]


def source_layer_schemes(ir: ModelIR, *, floats: bool = False) -> tuple[str | None, ...]:
    """Per MoE layer, the expert scheme its experts are already stored in, which the compiler
    passes through unchanged: a GGUF's ``q4_k``, or ``q4_k+q6_k`` where its ``ffn_down`` is Q6_K
    (Q4_K_M), gpt-oss's MXFP4 and DeepSeek's FP8 (both converted exactly); None for float experts
    (unless ``floats``) or mixed types."""
    def own(ref: Any) -> str | None:
        scheme = source_scheme(ref.dtype, scaled=ref.scale is not None)
        return scheme.name if scheme is not None and (floats or not scheme.plain) else None

    result = []
    for layer in ir.moe_layers:
        names = {(own(e.gate), own(e.up), own(e.down)) for e in layer.experts}
        if len(names) != 1:
            result.append(None)
            continue
        gate, up, down = names.pop()
        ok = gate is not None and gate == up and down is not None
        result.append(None if not ok else expert_scheme_name(f"{gate}+{down}"))
    return tuple(result)


def source_expert_scheme(ir: ModelIR) -> str | None:
    """The one expert scheme every MoE layer's experts are stored in (``source_layer_schemes``)."""
    names = set(source_layer_schemes(ir))
    return names.pop() if len(names) == 1 and None not in names else None


def default_expert_schemes(ir: ModelIR, *, floats: bool = False
                           ) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(GPU schemes, CPU schemes, per-layer schemes) when none are given: where every layer's
    experts are stored in block schemes (with ``floats``, in any scheme), those (passed through,
    no requantizing; each layer keeps its own), else bf16 on the GPU and int8 on the CPU with
    no per-layer restriction."""
    own = source_layer_schemes(ir, floats=floats)
    if own and None not in own:
        names = tuple(dict.fromkeys(n for n in own if n is not None))
        return names, names, tuple(n for n in own if n is not None)
    return ("bf16",), ("int8",), ()


def _passes_through(name: str, own: str | None) -> bool:
    """Whether expert scheme ``name`` can be made for a layer stored in ``own``: each of its
    matrices' schemes has a quantizer, or is the source's own for that matrix."""
    mine = expert_schemes(name)
    theirs = expert_schemes(own) if own else (None, None)
    return all(s.quantize is not None or s is o for s, o in zip(mine, theirs))


def check_source_allows(ir: ModelIR, name: str, *, every_layer: bool = False,
                        owns: tuple[str | None, ...] | None = None) -> None:
    """An expert scheme with a matrix scheme that has no quantizer is only the source's own
    bytes, passed through: some layer (with ``every_layer``, every one) must store its experts
    that way. ``owns``: ``source_layer_schemes(ir)``, when the caller has it."""
    owns = source_layer_schemes(ir) if owns is None else owns
    fits = [_passes_through(name, own) for own in owns]
    if all(fits) or (any(fits) and not every_layer):
        return
    missing = next(s for s in expert_schemes(name) if s.quantize is None)
    where = "this model's experts" if not any(fits) else \
        f"layer {ir.moe_layer_indices[fits.index(False)]}'s experts ({owns[fits.index(False)] or 'float'})"
    raise ConfigError(f"scheme {missing.name} cannot be made from {where}: ktc has no "
                      f"{missing.name} quantizer, it passes {', '.join(missing.sources)} tensors through",
                      hint="pick a scheme ktc quantizes to (see ktc plan --help)")


def _options(ir: ModelIR, hw: HardwareProfile, opts: PlannerOptions) -> tuple[PlacementOption, ...]:
    shape = expert_shape(ir)
    owns = source_layer_schemes(ir)  # one pass over every expert, not one per option
    result = []
    for device, names, bandwidth in ((GPU, opts.gpu_schemes, hw.gpu_bandwidth),
                                     (CPU, opts.cpu_schemes, hw.cpu_bandwidth)):
        for name in names:
            check_source_allows(ir, name, owns=owns)
            gate_up, down = expert_schemes(name)
            for scheme, cols in ((gate_up, shape.hidden), (down, shape.intermediate)):
                if not scheme.fits(cols):
                    raise ConfigError(f"scheme {scheme.name} needs rows that are a multiple of "
                                      f"{scheme.block_elems} values; this model's experts have rows of "
                                      f"{shape.hidden} and {shape.intermediate}",
                                      hint="pick another --gpu-schemes / --cpu-schemes")
            fp = expert_footprint(shape, name)
            seconds = fp.data_bytes / bandwidth
            if device == CPU and hw.cpu_scheme_bandwidth:  # calibrated: each matrix at its scheme's rate
                seconds = sum(nbytes / rate(hw, s.name, "experts") for (_, nbytes), s in
                              zip(expert_tensor_bytes(shape, name), (gate_up, down)))
            result.append(PlacementOption(
                device=device, scheme=name,
                vram_bytes=fp.stored_bytes if device == GPU else 0,
                ram_bytes=fp.stored_bytes if device == CPU else 0,
                seconds_per_use=seconds,
                error=expert_scheme_error(name)))
            if device == CPU and hw.disk_bandwidth > 0:
                # The disk tier: the same expert left in the bundle's map outside the RAM budget,
                # read from disk at each use (the page cache's help ignored) and then computed as
                # on the CPU.
                result.append(dataclasses.replace(result[-1], device=DISK, ram_bytes=0,
                                                  seconds_per_use=seconds + fp.stored_bytes / hw.disk_bandwidth))
    return tuple(result)


def _layer_errors(opts: PlannerOptions, options: tuple[PlacementOption, ...], layers: int) -> np.ndarray | None:
    """[layers, options] errors measured on activations where ``opts`` has them (every option's
    scheme must be among them), else None (the nominal errors)."""
    if not opts.activation_errors:
        return None
    measured = dict(opts.activation_errors)
    missing = sorted({o.scheme for o in options} - set(measured))
    if missing:
        raise ConfigError(f"no activation error was measured for {', '.join(missing)}")
    if any(len(v) != layers for v in measured.values()):
        raise ConfigError(f"activation errors are given for {len(next(iter(measured.values())))} MoE layers; "
                          f"the model has {layers}")
    return np.array([measured[o.scheme] for o in options], dtype=np.float64).T


def usage_probability(profile: ActivationProfile, top_k: int, batch: int) -> np.ndarray:
    """Probability that a decode step of ``batch`` independent tokens uses each expert."""
    p = profile.selection_probability(top_k)
    return 1.0 - (1.0 - p) ** batch


def disk_staging_bytes(ir: ModelIR, workload: Workload, opts: PlannerOptions) -> int:
    """RAM for the disk experts' pages in flight where a plan keeps experts on disk: a step's
    distinct experts of a layer (``top_k`` a token, at most every expert) at the largest CPU
    scheme, for the layer that runs and the one pre-gating pages in ahead of it."""
    cfg = ir.config
    largest = max(expert_footprint(expert_shape(ir), name).stored_bytes for name in opts.cpu_schemes)
    return 2 * min(cfg.num_experts, cfg.top_k * workload.batch) * largest


def build_context(ir: ModelIR, hw: HardwareProfile, workload: Workload,
                  profile: ActivationProfile | None, opts: PlannerOptions, *,
                  disk_staging: bool = False) -> PlanningContext:
    """The problem to solve; with ``disk_staging``, RAM also holds ``disk_staging_bytes`` (the
    planner solves again with it where the first solution keeps experts on disk)."""
    if not ir.moe_layers:
        raise ConfigError("the model has no MoE layers to plan")
    cfg = ir.config
    layers = ir.moe_layer_indices
    if profile is None:
        profile = uniform_profile(layers, cfg.num_experts)
    if profile.layers != layers or profile.num_experts != cfg.num_experts:
        raise ConfigError(f"activation profile is [{len(profile.layers)} layers x {profile.num_experts} "
                          f"experts]; the model has [{len(layers)} x {cfg.num_experts}]",
                          path=profile.source)
    vram, ram, read = non_expert_memory(ir, opts.dense_scheme)
    kv_per_token = cfg.kv_bytes_per_token(workload.kv_element_bytes)
    vram["kv_cache"] = kv_per_token * workload.max_tokens
    vram["workspace"] = workspace_bytes(ir, workload)
    vram["reserve"] = hw.reserve_bytes
    if opts.cache_vram:
        vram["cache_slots"] = opts.cache_vram
    if opts.offload_vram:
        vram["prefill_offload"] = opts.offload_vram
    cpu_only = hw.cpu_only
    if cpu_only:
        # No GPU (--vram 0): what would live in VRAM lives in RAM beside the CPU experts (the
        # reserve, VRAM kept free for CUDA, is not needed), the CPU reads every weight, and no
        # layer hands work to a device. The GPU options stay in the problem and never fit.
        if opts.cache_vram or opts.offload_vram:
            raise ConfigError("cache slots and the prefill offload's buffer need a GPU (--vram above 0)")
        if opts.pin_gpu:
            layer, expert = opts.pin_gpu[0]
            raise ConfigError(f"expert {layer}:{expert} is pinned to the GPU, and --vram 0 plans without one",
                              hint="drop --pin-gpu, or give the GPU's --vram")
        del vram["reserve"]
        ram.update((name, nbytes) for name, nbytes in vram.items() if nbytes)
        vram = {}
    if disk_staging:
        ram["disk_staging"] = disk_staging_bytes(ir, workload, opts)
    options = _options(ir, hw, opts)
    usage = usage_probability(profile, cfg.top_k, workload.batch)
    allowed = np.ones((len(layers), cfg.num_experts, len(options)), dtype=bool)
    own = source_layer_schemes(ir)
    for i, option in enumerate(options):  # a scheme without a quantizer only where it is the source's
        for li, layer_own in enumerate(own):
            if not _passes_through(option.scheme, layer_own):
                allowed[li, :, i] = False
    if opts.layer_schemes:  # the source's own, layer by layer
        if len(opts.layer_schemes) != len(layers):
            raise ConfigError(f"{len(opts.layer_schemes)} per-layer schemes for {len(layers)} MoE layers")
        for i, option in enumerate(options):
            allowed[:, :, i] &= np.array([option.scheme == s for s in opts.layer_schemes])[:, None]
    on_gpu = np.array([o.device == GPU for o in options])
    for pins, device_mask in ((opts.pin_gpu, on_gpu), (opts.pin_cpu, ~on_gpu)):
        for layer, expert in pins:
            if layer not in layers or not 0 <= expert < cfg.num_experts:
                raise ConfigError(f"pin {layer}:{expert} is not an expert of this model (MoE layers "
                                  f"{layers[0]}-{layers[-1]}, experts 0-{cfg.num_experts - 1})")
            allowed[layers.index(layer), expert] &= device_mask
    # Moving a layer's hidden states to the CPU and the results back, on top of the sync.
    transfer = 2 * workload.batch * cfg.hidden_size * 2 / hw.pcie_bandwidth
    sync = np.full(len(layers), 0.0 if cpu_only else hw.sync_seconds + transfer)
    problem = PlacementProblem(
        usage=usage, options=options, allowed=allowed,
        vram_budget=hw.vram_bytes - sum(vram.values()),
        ram_budget=hw.ram_bytes - sum(ram.values()),
        sync_seconds=sync, quality_weight=opts.quality_weight,
        layer_errors=_layer_errors(opts, options, len(layers)),
        device_seconds=np.full(len(layers), hw.device_step_seconds))
    return PlanningContext(problem, profile, vram, ram, read / (hw.cpu_bandwidth if cpu_only else hw.gpu_bandwidth),
                           kv_per_token, layers)


# ----------------------------------------------------------------------------------------------
# Infeasible budgets


def _min_expert_vram(problem: PlacementProblem) -> int | None:
    """Fewest VRAM bytes the experts need so that the rest fit in RAM (None: never)."""
    gpu = [o for o in problem.options if o.device == GPU]
    cpu = [o for o in problem.options if o.device == CPU]
    total = problem.usage.size
    smallest_cpu = min(o.ram_bytes for o in cpu)
    smallest_gpu = min(o.vram_bytes for o in gpu)
    pinned_gpu = int((~problem.allowed[..., [o.device == CPU for o in problem.options]].any(axis=-1)).sum())
    pinned_cpu = int((~problem.allowed[..., [o.device == GPU for o in problem.options]].any(axis=-1)).sum())
    if pinned_cpu * smallest_cpu > problem.ram_budget:
        return None
    on_cpu_max = min(total - pinned_gpu, max(problem.ram_budget, 0) // smallest_cpu)
    return (total - on_cpu_max) * smallest_gpu


def _max_gpu_experts(problem: PlacementProblem) -> int:
    """Most experts the VRAM left for experts holds, at the smallest GPU scheme."""
    smallest_gpu = min(o.vram_bytes for o in problem.options if o.device == GPU)
    pinned_cpu = int((~problem.allowed[..., [o.device == GPU for o in problem.options]].any(axis=-1)).sum())
    return min(problem.usage.size - pinned_cpu, max(problem.vram_budget, 0) // smallest_gpu)


def budget_error(ctx: PlanningContext, hw: HardwareProfile, workload: Workload) -> BudgetError:
    """A ``BudgetError`` that says which budget binds (VRAM, RAM, or the two together), what each
    would need given the other, each component, the flags that change it, and the largest
    ``--max-tokens`` that fits when one does."""
    if hw.cpu_only:
        return _budget_error_without_gpu(ctx, hw)
    problem = ctx.problem
    smallest_cpu = min(o.ram_bytes for o in problem.options if o.device == CPU)
    fixed_vram, fixed_ram = sum(ctx.fixed_vram.values()), sum(ctx.fixed_ram.values())
    need_vram = _min_expert_vram(problem)  # experts' VRAM, given the RAM budget
    vram_needed = None if need_vram is None else fixed_vram + need_vram
    ram_needed = fixed_ram + (problem.usage.size - _max_gpu_experts(problem)) * smallest_cpu
    if fixed_vram > hw.vram_bytes:
        binds = "VRAM binds: the weights and buffers that always live on the GPU do not fit"
    elif fixed_ram > hw.ram_bytes:
        binds = "RAM binds: what always lives in RAM does not fit"
    elif vram_needed is None:
        binds = "RAM binds: the experts pinned to the CPU do not fit in it"
    else:
        binds = "VRAM and RAM together are too small for the experts; more of either would do"
    lines = [f"the model does not fit: {binds}"]
    vram_line = (f"  VRAM {format_bytes(hw.vram_bytes)}: fixed {format_bytes(fixed_vram)} (" +
                 format_parts(ctx.fixed_vram.items()) + ")")
    if vram_needed is not None and vram_needed > hw.vram_bytes:
        vram_line += f"; with this RAM it needs {format_bytes(vram_needed)} (--vram)"
    lines.append(vram_line)
    ram_line = (f"  RAM  {format_bytes(hw.ram_bytes)}: fixed {format_bytes(fixed_ram)} (" +
                format_parts(ctx.fixed_ram.items()) + f"), {format_bytes(smallest_cpu)} per CPU expert")
    if ram_needed > hw.ram_bytes:
        ram_line += f"; with this VRAM it needs {format_bytes(ram_needed)} (--ram)"
    lines.append(ram_line)
    largest = largest_feasible_max_tokens(ctx, hw, workload)
    if largest is None or need_vram is None:
        hint = ("no --max-tokens fits; smaller experts (--cpu-schemes/--gpu-schemes int4_g128), "
                "non-expert weights (--dense-scheme q8_0), a smaller --reserve, or more --vram/--ram")
    else:
        hint = f"the largest --max-tokens that fits is {largest}"
    error = BudgetError("\n".join(lines), hint=hint)
    error.largest_max_tokens = largest  # type: ignore[attr-defined]
    return error


def _budget_error_without_gpu(ctx: PlanningContext, hw: HardwareProfile) -> BudgetError:
    """``budget_error`` for a plan without a GPU (``--vram 0``): RAM alone binds. It holds the
    fixed part and every expert (none with a disk tier, which takes the experts that do not fit)."""
    problem = ctx.problem
    smallest_cpu = min(o.ram_bytes for o in problem.options if o.device == CPU)
    disk_tier = any(o.device == DISK for o in problem.options)
    fixed = sum(ctx.fixed_ram.values())
    experts = 0 if disk_tier else problem.usage.size * smallest_cpu
    line = (f"  RAM  {format_bytes(hw.ram_bytes)}: fixed {format_bytes(fixed)} (" +
            format_parts(ctx.fixed_ram.items()) +
            f"), {format_bytes(smallest_cpu)} per CPU expert; it needs {format_bytes(fixed + experts)} (--ram)")
    room = hw.ram_bytes - (fixed - ctx.fixed_ram.get("kv_cache", 0)) - experts
    largest = room // ctx.kv_bytes_per_token if room >= 0 and ctx.kv_bytes_per_token > 0 else None
    ways = [f"the largest --max-tokens that fits is {largest}" if largest is not None else
            "more --ram, smaller experts (--cpu-schemes int4_g128) or non-expert weights (--dense-scheme q8_0)"]
    if not disk_tier:
        ways.append("--disk-bandwidth RATE (ktc doctor --disk DIR measures it) keeps the least used experts on disk")
    hint = "; or ".join(ways)
    what = "what always lives in RAM does not" if disk_tier else "what always lives in RAM and the experts do not"
    error = BudgetError(f"the model does not fit: RAM binds (no GPU, --vram 0): {what} fit\n{line}", hint=hint)
    error.largest_max_tokens = largest  # type: ignore[attr-defined]
    return error


def largest_feasible_max_tokens(ctx: PlanningContext, hw: HardwareProfile,
                                workload: Workload) -> int | None:
    need = _min_expert_vram(ctx.problem)
    if need is None or ctx.kv_bytes_per_token <= 0:
        return None
    fixed = sum(v for k, v in ctx.fixed_vram.items() if k != "kv_cache")
    room = hw.vram_bytes - fixed - need
    return room // ctx.kv_bytes_per_token if room >= 0 else None


# ----------------------------------------------------------------------------------------------
# Baselines: what users do today, under the same memory and cost model


# A baseline's schemes: (GPU option, CPU option) indices, each one for every layer or an array of
# one per MoE layer (where options are allowed per layer: a source's own types, layer by layer).
Pair = tuple[Any, Any]


def _per_expert(index: Any) -> Any:
    return np.asarray(index).reshape(-1, 1) if np.ndim(index) else index


def _fill(gpu_mask: np.ndarray, pair: Pair) -> np.ndarray:
    """Choice array: option ``pair[0]`` (a GPU one) where ``gpu_mask``, else ``pair[1]`` (CPU)."""
    return np.where(gpu_mask, _per_expert(pair[0]), _per_expert(pair[1]))


def _largest_feasible(problem: PlacementProblem, masks: list[np.ndarray],
                      pair: Pair) -> tuple[int, np.ndarray] | None:
    """The last of increasingly GPU-heavy masks that fits (masks[0] is the CPU-only extreme)."""
    best = None
    for i, mask in enumerate(masks):
        choice = _fill(mask, pair)
        if is_feasible(problem, choice):
            best = (i, choice)
        elif best is not None:
            break
    return best


def baseline_uniform(problem: PlacementProblem, pair: Pair) -> tuple[str, np.ndarray] | None:
    """KTransformers' --kt-num-gpu-experts N: experts 0..N-1 of every layer on the GPU."""
    n_layers, n_experts = problem.shape
    masks = [np.broadcast_to(np.arange(n_experts) < n, (n_layers, n_experts)) for n in range(n_experts + 1)]
    found = _largest_feasible(problem, masks, pair)
    return (f"--kt-num-gpu-experts {found[0]}", found[1]) if found else None


def baseline_global_topk(problem: PlacementProblem, pair: Pair) -> tuple[str, np.ndarray] | None:
    """KTransformers' generate_gpu_experts_masks: the k most used experts of the whole model."""
    order = np.argsort(-problem.usage, axis=None, kind="stable")
    n = problem.usage.size
    # The largest k that fits, computed directly rather than by trying every k: the GPU bytes of
    # the k most used experts, and the CPU bytes of the rest.
    vram = np.array([o.vram_bytes for o in problem.options])[_fill(np.ones(problem.shape, bool), pair)]
    ram = np.array([o.ram_bytes for o in problem.options])[_fill(np.zeros(problem.shape, bool), pair)]
    vram_first = np.concatenate([[0], np.cumsum(vram.reshape(-1)[order])])
    ram_rest = ram.sum() - np.concatenate([[0], np.cumsum(ram.reshape(-1)[order])])
    fits = (vram_first <= problem.vram_budget) & (ram_rest <= problem.ram_budget)
    if not fits.any():
        return None
    k = int(np.nonzero(fits)[0][-1])
    mask = np.zeros(n, dtype=bool)
    mask[order[:k]] = True
    choice = _fill(mask.reshape(problem.shape), pair)
    return (f"top {k} experts", choice) if is_feasible(problem, choice) else None


def baseline_n_cpu_moe(problem: PlacementProblem, pair: Pair) -> tuple[str, np.ndarray] | None:
    """llama.cpp's --n-cpu-moe N: all experts of the first N MoE layers on the CPU."""
    n_layers, n_experts = problem.shape
    masks = [np.broadcast_to((np.arange(n_layers) >= n)[:, None], (n_layers, n_experts))
             for n in range(n_layers, -1, -1)]
    found = _largest_feasible(problem, masks, pair)
    return (f"--n-cpu-moe {n_layers - found[0]}", found[1]) if found else None


BASELINES = (
    ("uniform", "same N experts per layer on the GPU (KTransformers --kt-num-gpu-experts)", baseline_uniform),
    ("global_topk", "globally most used experts on the GPU (KTransformers generate_gpu_experts_masks)",
     baseline_global_topk),
    ("n_cpu_moe", "experts of the first N layers on the CPU (llama.cpp --n-cpu-moe)", baseline_n_cpu_moe),
)


def scheme_pairs(problem: PlacementProblem) -> list[Pair]:
    """Every (GPU option, CPU option) pair: one scheme per device, as the baselines' tools use.
    Where options are allowed per layer (a source's own types, layer by layer), one pair of
    per-layer arrays: each layer's fastest allowed option on each device."""
    gpu = [i for i, o in enumerate(problem.options) if o.device == GPU]
    cpu = [i for i, o in enumerate(problem.options) if o.device == CPU]
    in_layer = problem.allowed.any(axis=1)  # [layers, options]
    if in_layer.all():
        return [(g, c) for g in gpu for c in cpu]

    def fastest(indices: list[int]) -> np.ndarray:
        return np.array([min((i for i in indices if in_layer[layer, i]),
                             key=lambda i: problem.options[i].seconds_per_use, default=indices[0])
                         for layer in range(in_layer.shape[0])])

    return [(fastest(gpu), fastest(cpu))]


def _pair_key(pair: Pair) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(np.atleast_1d(index).tolist()) for index in pair)


def best_baseline(problem: PlacementProblem, method: Any) -> tuple[str, np.ndarray, Pair] | None:
    """A baseline at its best single scheme per device (the fastest feasible over every pair of
    allowed schemes), so that it differs from ktc's plan by its placement, not by the order of
    the scheme lists."""
    best = None
    for pair in scheme_pairs(problem):
        found = method(problem, pair)
        if found is None:
            continue
        seconds = evaluate(problem, found[1]).expert_seconds
        if best is None or seconds < best[0]:
            best = (seconds, found[0], found[1], pair)
    return None if best is None else best[1:]


def single_scheme_solution(problem: PlacementProblem, time_limit: float, pairs: list[tuple[int, int]]
                           ) -> tuple[PlacementSolution, tuple[int, int]] | None:
    """ktc's own placement with one scheme per device (the best of ``pairs``), on the full
    problem's option indices: what placement alone gains, before mixing schemes."""
    best = None
    for pair in pairs:
        sub = dataclasses.replace(problem, options=tuple(problem.options[i] for i in pair),
                                  allowed=problem.allowed[..., list(pair)])
        try:
            solution = solve_placement(sub, time_limit=time_limit)
        except BudgetError:
            continue
        choice = np.asarray(pair)[solution.choice]
        if best is None or solution.objective < best[0].objective:
            best = (dataclasses.replace(solution, choice=choice), pair)
    return best


# ----------------------------------------------------------------------------------------------
# Planning


def model_facts(ir: ModelIR) -> ModelFacts:
    shape = expert_shape(ir)
    return ModelFacts(ir.family, ir.config.architecture, ir.config.num_layers, ir.moe_layer_indices,
                      ir.config.num_experts, ir.config.top_k, ir.config.hidden_size,
                      shape.intermediate, shape.biases)


def to_placement(ctx: PlanningContext, choice: np.ndarray) -> Placement:
    opts = [ExpertPlacement(Device(o.device), o.scheme) for o in ctx.problem.options]
    return Placement(ctx.moe_layers, tuple(tuple(opts[c] for c in row) for row in choice.tolist()))


def placement_ms_per_token(ir: ModelIR, plan: Plan, placement: Placement) -> float:
    """The predicted ms per token of ``placement`` (another plan's, say: one made without a
    profile) under ``plan``'s model, budget, workload and routing profile."""
    ctx = build_context(ir, plan.hardware, plan.workload, plan.profile, plan.options)
    index = {(o.device, o.scheme): i for i, o in enumerate(ctx.problem.options)}
    try:
        choice = np.array([[index[(p.device.value, p.scheme)] for p in row] for row in placement.experts])
    except KeyError as exc:
        raise InternalError(f"placement option {exc} is not one of this plan's") from None
    return 1e3 * (ctx.constant_seconds + evaluate(ctx.problem, choice).expert_seconds) / plan.workload.batch


def plan_placement(ir: ModelIR, hardware: HardwareProfile, workload: Workload | None = None,
                   profile: ActivationProfile | None = None,
                   options: PlannerOptions | None = None) -> Plan:
    """Solve the placement of every routed expert and compare it with today's baselines."""
    workload = workload or Workload()
    options = options or PlannerOptions()
    ctx = build_context(ir, hardware, workload, profile, options)
    problem = ctx.problem
    if problem.vram_budget < 0 or problem.ram_budget < 0:
        raise budget_error(ctx, hardware, workload)
    unstaged = problem  # the baselines have no disk tier, and need no RAM for one
    try:
        solution: PlacementSolution = solve_placement(problem, time_limit=options.time_limit)
        if any(problem.options[i].device == DISK for i in np.unique(solution.choice).tolist()):
            # experts on disk: their pages in flight need RAM too, which the first solve left out
            ctx = build_context(ir, hardware, workload, profile, options, disk_staging=True)
            problem = ctx.problem
            if problem.ram_budget < 0:
                raise BudgetError("no RAM left for the disk experts' pages in flight")
            solution = solve_placement(problem, time_limit=options.time_limit)
    except BudgetError:
        raise budget_error(ctx, hardware, workload) from None
    ev = evaluate(problem, solution.choice)
    if not is_feasible(problem, solution.choice):
        raise InternalError("the solver returned a placement that breaks the budgets or pins")
    def result(name: str, description: str, setting: str, choice: np.ndarray, pair: Pair) -> BaselineResult:
        g, c = ("/".join(dict.fromkeys(problem.options[i].scheme for i in np.atleast_1d(index).tolist()))
                for index in pair)
        ms = 1e3 * (ctx.constant_seconds + evaluate(problem, choice).expert_seconds)
        on_gpu = int(np.array([o.device == GPU for o in problem.options])[choice].sum())
        return BaselineResult(name, description, True, ms, on_gpu, setting, to_placement(ctx, choice),
                              f"gpu {g}, cpu {c}")

    baselines = []
    baseline_pairs: list[Pair] = []
    for name, description, method in BASELINES:
        found = best_baseline(unstaged, method)
        if found is None:
            baselines.append(BaselineResult(name, description, False, None, 0, "does not fit"))
            continue
        baselines.append(result(name, description, *found))
        baseline_pairs += [found[2]] if _pair_key(found[2]) not in map(_pair_key, baseline_pairs) else []
    single = None
    if len(scheme_pairs(problem)) > 1:
        # At the pairs the baselines chose (every pair when none fits): one or two solves of a
        # two-option problem, not one per pair (six for three GPU and two CPU schemes).
        best_single = single_scheme_solution(problem, options.time_limit,
                                             baseline_pairs or scheme_pairs(problem))
        if best_single is not None:
            single = result("single_scheme", "ktc's placement with one scheme per device", "ktc",
                            best_single[0].choice, best_single[1])
    memory = MemoryBreakdown(
        vram=tuple(ctx.fixed_vram.items()) + (("gpu_experts", ev.vram_bytes),),
        ram=tuple(ctx.fixed_ram.items()) + (("cpu_experts", ev.ram_bytes),),
        vram_budget=hardware.vram_bytes, ram_budget=hardware.ram_bytes)
    quality = ev.objective - ev.expert_seconds
    return Plan(
        model=model_facts(ir), hardware=hardware, workload=workload, options=options,
        placement=to_placement(ctx, solution.choice), memory=memory,
        constant_ms=1e3 * ctx.constant_seconds, expert_ms=1e3 * ev.expert_seconds,
        baselines=tuple(baselines), single_scheme=single,
        solve=SolveInfo(solution.solve_seconds, solution.optimal, solution.gap,
                        1e3 * max(solution.lower_bound - quality, 0.0), solution.method),
        profile=ctx.profile, usage=problem.usage, layer_ms=tuple(1e3 * s for s in ev.layer_seconds))


class PlanPlacement(Pass):
    """Decide each expert's device and scheme under the budgets."""

    name: ClassVar[str] = "plan"
    requires: ClassVar[frozenset[str]] = frozenset({"experts", "config"})
    produces: ClassVar[frozenset[str]] = frozenset({"placement"})

    def __init__(self, hardware: HardwareProfile, workload: Workload | None = None,
                 profile: ActivationProfile | None = None, options: PlannerOptions | None = None) -> None:
        self.hardware, self.workload, self.profile, self.options = hardware, workload, profile, options
        self.plan: Plan | None = None

    def run(self, ir: ModelIR | None, ctx: PassContext) -> ModelIR:
        from dataclasses import replace

        if ir is None:
            raise InternalError("plan needs an IR")
        self.plan = plan_placement(ir, self.hardware, self.workload, self.profile, self.options)
        return replace(ir, placement=self.plan.placement)

    def verify(self, ir: ModelIR) -> None:
        if self.plan is None or ir.placement is None:
            raise InternalError("plan pass produced no placement")
        verify_plan(ir, self.plan)


class UsePlacement(Pass):
    """Take the placement from elsewhere (a plan file, the planner run through ``ktc.plan``, or
    every expert on the CPU): ``decide(ir)`` returns it and what the manifest records of it."""

    name: ClassVar[str] = "plan"
    requires: ClassVar[frozenset[str]] = frozenset({"experts", "config"})
    produces: ClassVar[frozenset[str]] = frozenset({"placement"})

    def __init__(self, decide: Callable[[ModelIR], tuple[Placement, dict[str, Any]]]) -> None:
        self.decide = decide
        self.info: dict[str, Any] = {}

    def run(self, ir: ModelIR | None, ctx: PassContext) -> ModelIR:
        from dataclasses import replace

        if ir is None:
            raise InternalError("plan needs an IR")
        placement, self.info = self.decide(ir)
        check_placement(ir, placement)
        return replace(ir, placement=placement)

    def verify(self, ir: ModelIR) -> None:
        if ir.placement is None:  # that it fits the model, run() checked (check_placement)
            raise InternalError("plan produced no placement")


def check_placement(ir: ModelIR, placement: Placement) -> None:
    """``ConfigError`` unless ``placement`` places every expert of this model."""
    if placement.layers != ir.moe_layer_indices:
        raise ConfigError(f"the plan places experts of layers {list(placement.layers)[:8]}...; this "
                          f"model's MoE layers are {list(ir.moe_layer_indices)[:8]}...",
                          hint="the plan was made for another model")
    for row, layer in zip(placement.experts, ir.moe_layers):
        if len(row) != len(layer.experts):
            raise ConfigError(f"the plan has {len(row)} experts for layer {layer.layer}; the model has "
                              f"{len(layer.experts)}", hint="the plan was made for another model")
