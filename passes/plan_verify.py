"""Check any placement from scratch: memory against the budgets, pins, and predicted time.

Deliberately written apart from the planner (plain loops over the IR, no shared arithmetic
beyond the byte-size function the bundle also uses), so a bug in one is caught by the other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ktc.errors import InternalError
from ktc.formats.activation_profile import ActivationProfile
from ktc.formats.hardware_profile import HardwareProfile
from ktc.formats.schemes import ExpertShape, expert_footprint, non_expert_bytes
from ktc.ir import Device, ModelIR, Placement, TensorRole

from .plan import Plan, PlannerOptions, Workload, workspace_bytes


@dataclass(frozen=True)
class VerifiedCost:
    vram_bytes: int
    ram_bytes: int
    ms_per_step: float
    problems: tuple[str, ...]


def _tensor_refs(ir: ModelIR):
    """Every non-routed-expert tensor the serving model loads: (ref, on the CPU?, router?)."""
    for tensor in ir.dense:
        if tensor.layer is not None and tensor.layer >= ir.config.num_layers:
            continue  # extra layers (multi-token prediction) are not loaded
        name = tensor.ref.name
        on_cpu = (tensor.role is TensorRole.EMBEDDING and not ir.config.tie_word_embeddings
                  and ("embed_tokens" in name or "token_embd" in name or "wte" in name))
        yield tensor.ref, on_cpu, tensor.role is TensorRole.ROUTER
    for layer in ir.moe_layers:
        for ref in (layer.router, layer.router_bias, layer.score_correction_bias, layer.shared_expert_gate):
            if ref is not None:
                yield ref, False, True
        for ref in (t for e in layer.shared_experts for t in e.tensors):
            yield ref, False, False


def recompute(ir: ModelIR, placement: Placement, hardware: HardwareProfile, workload: Workload,
              profile: ActivationProfile, options: PlannerOptions) -> VerifiedCost:
    """Memory and predicted time of ``placement``, recomputed from the IR and inputs."""
    problems = []
    cfg = ir.config
    vram = ram = 0
    gpu_read = cpu_read = 0
    cpu_only = hardware.cpu_only  # no GPU: every weight and buffer in RAM, read by the CPU
    for ref, on_cpu, router in _tensor_refs(ir):
        size = non_expert_bytes(ref.shape, router=router, dense_scheme=options.dense_scheme, source_dtype=ref.dtype)
        if on_cpu:
            ram += size
        elif cpu_only:
            ram += size
            cpu_read += size
        else:
            vram += size
            gpu_read += size
    # KV cache, workspace and reserve: the planner's estimate of the workspace is part of its
    # memory model; the verifier recomputes the KV cache and takes the rest as fixed inputs.
    if cfg.kv_lora_rank:
        kv_token = cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * workload.kv_element_bytes
    else:
        kv_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * workload.kv_element_bytes
    if cpu_only:
        ram += kv_token * workload.max_tokens + workspace_bytes(ir, workload)
    else:
        vram += kv_token * workload.max_tokens + workspace_bytes(ir, workload) + hardware.reserve_bytes

    pins = {(l, e): Device.GPU for l, e in options.pin_gpu}
    pins.update({(l, e): Device.CPU for l, e in options.pin_cpu})
    total_seconds = gpu_read / hardware.gpu_bandwidth + cpu_read / hardware.cpu_bandwidth
    if placement.layers != ir.moe_layer_indices:
        problems.append(f"placement covers layers {placement.layers}, the model {ir.moe_layer_indices}")
    for row, layer in enumerate(ir.moe_layers):
        counts = profile.counts[row]
        tokens = sum(counts)
        gpu_seconds = cpu_seconds = 0.0
        cpu_used = gpu_used = False
        for expert in layer.experts:
            where = placement.experts[row][expert.index]
            allowed = options.gpu_schemes if where.device is Device.GPU else options.cpu_schemes
            if where.scheme not in allowed:
                problems.append(f"layer {layer.layer} expert {expert.index}: scheme {where.scheme} is "
                                f"not allowed on the {where.device.value}")
            pinned = pins.get((layer.layer, expert.index))
            on_cpu_side = where.device is Device.DISK and pinned is Device.CPU  # pinned off the GPU
            if pinned is not None and pinned is not where.device and not on_cpu_side:
                problems.append(f"layer {layer.layer} expert {expert.index} is pinned to the "
                                f"{pinned.value} but placed on the {where.device.value}")
            shape = ExpertShape(cfg.hidden_size, expert.gate.shape[0], expert.gate_bias is not None)
            footprint = expert_footprint(shape, where.scheme)
            p_token = cfg.top_k * counts[expert.index] / tokens if tokens > 0 else cfg.top_k / cfg.num_experts
            p_token = min(max(p_token, 0.0), 1.0)
            p_step = 1.0 - (1.0 - p_token) ** workload.batch
            if where.device is Device.GPU:
                vram += footprint.stored_bytes
                gpu_seconds += p_step * footprint.data_bytes / hardware.gpu_bandwidth
                gpu_used = gpu_used or p_step > 0
            else:  # the disk tier: no RAM, its bytes read from disk first
                ram += footprint.stored_bytes if where.device is Device.CPU else 0
                cpu_seconds += p_step * footprint.data_bytes / hardware.cpu_bandwidth
                if where.device is Device.DISK:
                    cpu_seconds += p_step * footprint.stored_bytes / hardware.disk_bandwidth if \
                        hardware.disk_bandwidth > 0 else float("inf")
                cpu_used = cpu_used or p_step > 0
        total_seconds += max(gpu_seconds, cpu_seconds)
        if gpu_used:
            total_seconds += hardware.device_step_seconds
        if cpu_used and not cpu_only:
            total_seconds += hardware.sync_seconds + 4 * workload.batch * cfg.hidden_size / hardware.pcie_bandwidth
    if any(p.device is Device.DISK for row in placement.experts for p in row):
        # the disk experts' pages in flight: a step's distinct experts of two layers at the
        # largest CPU scheme
        first = ir.moe_layers[0].experts[0]
        shape = ExpertShape(cfg.hidden_size, first.gate.shape[0], first.gate_bias is not None)
        largest = max(expert_footprint(shape, name).stored_bytes for name in options.cpu_schemes)
        ram += 2 * min(cfg.num_experts, cfg.top_k * workload.batch) * largest
    if vram > hardware.vram_bytes:
        problems.append(f"VRAM {vram} bytes exceeds the budget {hardware.vram_bytes}")
    if ram > hardware.ram_bytes:
        problems.append(f"RAM {ram} bytes exceeds the budget {hardware.ram_bytes}")
    return VerifiedCost(vram, ram, 1e3 * total_seconds, tuple(problems))


def verify_plan(ir: ModelIR, plan: Plan, *, rel_tol: float = 1e-9) -> VerifiedCost:
    """Recompute ``plan`` and raise ``InternalError`` if anything disagrees or breaks a budget."""
    result = recompute(ir, plan.placement, plan.hardware, plan.workload, plan.profile, plan.options)
    problems = list(result.problems)
    if result.vram_bytes != plan.memory.vram_total:
        problems.append(f"VRAM: plan says {plan.memory.vram_total}, recomputed {result.vram_bytes}")
    if result.ram_bytes != plan.memory.ram_total:
        problems.append(f"RAM: plan says {plan.memory.ram_total}, recomputed {result.ram_bytes}")
    if not math.isclose(result.ms_per_step, plan.predicted_ms_per_step, rel_tol=rel_tol, abs_tol=1e-12):
        problems.append(f"time: plan says {plan.predicted_ms_per_step} ms, recomputed {result.ms_per_step} ms")
    for baseline in plan.baselines:
        if baseline.placement is None:
            continue
        other = recompute(ir, baseline.placement, plan.hardware, plan.workload, plan.profile,
                          PlannerOptions(gpu_schemes=plan.options.gpu_schemes,
                                         cpu_schemes=plan.options.cpu_schemes,
                                         dense_scheme=plan.options.dense_scheme))
        problems += [f"baseline {baseline.name}: {p}" for p in other.problems]
        if not math.isclose(other.ms_per_step, baseline.predicted_ms_per_step or 0.0, rel_tol=rel_tol):
            problems.append(f"baseline {baseline.name}: says {baseline.predicted_ms_per_step} ms, "
                            f"recomputed {other.ms_per_step} ms")
    if problems:
        raise InternalError("plan verification failed: " + "; ".join(problems[:5]))
    return result
