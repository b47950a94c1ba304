"""Ways to show and export a plan: text, an HTML heatmap, KTransformers masks, llama.cpp rules."""

from __future__ import annotations

import html
import json
import os
from dataclasses import dataclass

import numpy as np

from ktc.errors import KtcError
from ktc.ir import Device
from ktc.passes.placement_solver import CPU, GPU, PlacementOption, PlacementProblem, solve_placement
from ktc.passes.planner import Plan
from ktc.summary import format_bytes, format_ranges


def _speedup(plan: Plan, ms: float | None) -> str:
    if ms is None:
        return "does not fit"
    if ms <= 0:
        return ""
    ratio = ms / plan.predicted_ms_per_step
    return "same as ktc" if f"{ratio:.2f}" == "1.00" else f"ktc is {ratio:.2f}x faster"


def render_plan_text(plan: Plan) -> str:
    m = plan.model
    mem = plan.memory
    lines = [
        f"plan for {m.family} ({m.architecture}): {len(m.moe_layers)} MoE layers x {m.num_experts} "
        f"experts, top-{m.top_k}; batch {plan.workload.batch}, KV cache {plan.workload.max_tokens} "
        f"tokens at {plan.workload.kv_dtype}",
        f"VRAM {format_bytes(mem.vram_total)} of {format_bytes(mem.vram_budget)}: " +
        ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in mem.vram if v),
        f"RAM  {format_bytes(mem.ram_total)} of {format_bytes(mem.ram_budget)}: " +
        ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in mem.ram if v),
    ]
    from ktc.formats.model_config import OTHER_ROUTERS

    if m.family in OTHER_ROUTERS:
        source = "the profile's" if plan.profile.source != "uniform" else "uniform (no --profile)"
        lines.append(f"routing: {m.family} routes with {OTHER_ROUTERS[m.family]}, which ktc's MoE layer "
                     f"does not compute; the routing statistics here are {source}")
    per_layer = plan.placement.gpu_experts_per_layer()
    lines.append(f"GPU experts: {sum(per_layer)} of {len(per_layer) * m.num_experts}; per layer "
                 f"{_runs(plan.placement.layers, per_layer)}")
    schemes: dict[str, int] = {}
    for row in plan.placement.experts:
        for p in row:
            key = f"{p.device.value} {p.scheme}"
            schemes[key] = schemes.get(key, 0) + 1
    lines.append("schemes: " + ", ".join(f"{k} x{v}" for k, v in sorted(schemes.items())))
    status = "optimal" if plan.solve.optimal else f"within {100 * plan.solve.gap:.2f}% of optimal (proven)"
    lines.append(f"predicted: {plan.predicted_ms_per_token:.3f} ms/token, {plan.tokens_per_second:.1f} "
                 f"tokens/s ({plan.constant_ms:.3f} ms non-expert weights + {plan.expert_ms:.3f} ms "
                 f"experts per step); solved in {plan.solve.seconds:.2f} s, {status}")
    single = plan.single_scheme
    width = max([len(b.schemes) for b in plan.baselines] + [len(single.schemes) if single else 0]) + 1
    lines.append("baselines on the same budget and model, each at its best one scheme per device:")
    for b in plan.baselines:
        ms = (f"{b.predicted_ms_per_step / plan.workload.batch:.3f} ms/token"
              if b.predicted_ms_per_step is not None else "-")
        line = f"  {b.name:<12} {b.setting:<26} {b.schemes:<{width}} {ms:<18} {_speedup(plan, b.predicted_ms_per_step)}"
        if single is not None and b.predicted_ms_per_step is not None and single.predicted_ms_per_step:
            line += f" (placement {b.predicted_ms_per_step / single.predicted_ms_per_step:.2f}x)"
        lines.append(line)
    if single is not None and single.predicted_ms_per_step:
        ms = f"{single.predicted_ms_per_step / plan.workload.batch:.3f} ms/token"
        lines.append(f"  {'ktc':<12} {'one scheme per device':<26} {single.schemes:<{width}} {ms:<18} "
                     f"mixing schemes: {_speedup(plan, single.predicted_ms_per_step)}")
    return "\n".join(lines)


def _runs(layers: tuple[int, ...], values: tuple[int, ...]) -> str:
    """'0-2: 5, 3: 7, 4-47: 8' from per-layer values."""
    parts: list[str] = []
    start = 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            parts.append(f"{format_ranges(layers[start:i])}: {values[start]}")
            start = i
    return ", ".join(parts)


# ----------------------------------------------------------------------------------------------
# HTML


def render_plan_html(plan: Plan) -> str:
    """A self-contained page: a layer x expert heatmap (colour: routing frequency; blue: GPU,
    orange: CPU) above the memory breakdown and the baselines."""
    usage = plan.usage
    layers, experts = usage.shape
    width = max(3, min(28, 1000 // max(experts, 1)))
    height = max(6, min(28, 560 // max(layers, 1)))
    label = 34  # room for layer numbers on the left
    top = float(usage.max()) if usage.size and usage.max() > 0 else 1.0
    rects = []
    for i, layer in enumerate(plan.placement.layers):
        y = i * height
        if i % max(1, 14 // height) == 0 or len(plan.placement.layers) <= 16:
            rects.append(f'<text x="{label - 4}" y="{y + height - 1}" font-size="{min(height, 11)}" '
                         f'text-anchor="end" fill="#555">{layer}</text>')
        for e in range(experts):
            p = plan.placement.experts[i][e]
            level = 0.12 + 0.88 * float(usage[i, e]) / top
            hue = 215 if p.device is Device.GPU else 28
            light = 92 - 55 * level
            rects.append(f'<rect x="{label + e * width}" y="{y}" width="{width}" height="{height}" '
                         f'fill="hsl({hue},80%,{light:.0f}%)"><title>layer {layer} expert {e}: '
                         f'{p.device.value} {p.scheme}, used {float(usage[i, e]):.3f} per step</title></rect>')
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{label + experts * width}" '
           f'height="{layers * height}" shape-rendering="crispEdges">{"".join(rects)}</svg>')
    rows = "".join(f"<tr><td>{html.escape(k.replace('_', ' '))}</td><td>{format_bytes(v)}</td></tr>"
                   for k, v in plan.memory.vram)
    ram_rows = "".join(f"<tr><td>{html.escape(k.replace('_', ' '))}</td><td>{format_bytes(v)}</td></tr>"
                       for k, v in plan.memory.ram)
    base_rows = "".join(
        f"<tr><td>{html.escape(b.name)}</td><td>{html.escape(b.setting)}</td><td>"
        f"{'-' if b.predicted_ms_per_step is None else f'{b.predicted_ms_per_step:.3f}'}</td><td>"
        f"{html.escape(_speedup(plan, b.predicted_ms_per_step))}</td></tr>" for b in plan.baselines)
    m = plan.model
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>ktc plan: {html.escape(m.family)}</title>
<style>
body{{font-family:system-ui,sans-serif;margin:24px;color:#222}}
table{{border-collapse:collapse;margin:8px 0 20px}}td,th{{border:1px solid #ccc;padding:3px 8px;text-align:left}}
.key span{{display:inline-block;width:14px;height:14px;vertical-align:middle;margin:0 4px 0 12px}}
.map{{overflow:auto;border:1px solid #ccc;display:inline-block;max-width:100%}}
</style></head><body>
<h1>ktc plan: {html.escape(m.family)} ({html.escape(m.architecture)})</h1>
<p>{len(m.moe_layers)} MoE layers x {m.num_experts} experts, top-{m.top_k}. Predicted
<b>{plan.predicted_ms_per_token:.3f} ms/token</b> ({plan.tokens_per_second:.1f} tokens/s),
{sum(plan.placement.gpu_experts_per_layer())} experts on the GPU.</p>
<p class="key">Rows: MoE layers (numbered on the left); columns: experts 0 to {m.num_experts - 1}. Hover a cell for details.
<span style="background:hsl(215,80%,40%)"></span>GPU
<span style="background:hsl(28,80%,40%)"></span>CPU; darker = routed to more often.</p>
<div class="map">{svg}</div>
<h2>Memory</h2>
<table><tr><th>VRAM</th><th>{format_bytes(plan.memory.vram_total)} of {format_bytes(plan.memory.vram_budget)}</th></tr>{rows}</table>
<table><tr><th>RAM</th><th>{format_bytes(plan.memory.ram_total)} of {format_bytes(plan.memory.ram_budget)}</th></tr>{ram_rows}</table>
<h2>Baselines on the same budget</h2>
<table><tr><th>baseline</th><th>setting</th><th>ms/step</th><th></th></tr>{base_rows}</table>
</body></html>
"""


# ----------------------------------------------------------------------------------------------
# KTransformers


def kt_mask(plan: Plan) -> np.ndarray:
    """Boolean [num_hidden_layers, num_experts]: True where the expert is on the GPU (dense
    layers are all False), the shape of KTransformers' ``gpu_experts_mask``."""
    mask = np.zeros((plan.model.num_layers, plan.model.num_experts), dtype=bool)
    for layer, row in zip(plan.placement.layers, plan.placement.experts):
        mask[layer] = [p.device is Device.GPU for p in row]
    return mask


# The SGLang + KTransformers integration whose flags the export targets: the kvcache-ai fork
# (`pip install sglang-kt`, KTransformers v0.5.1 and later), as its experts-scheduling tutorial
# documents them: --kt-num-gpu-experts (per MoE layer), --kt-gpu-experts-ratio (of all experts,
# overriding it), --kt-expert-placement-strategy frequency with --init-expert-location FILE.pt.
SGLANG_KT_TARGET = "sglang-kt (KTransformers v0.5.1+)"


def export_kt(plan: Plan, folder: str) -> dict[str, object]:
    """Write ``gpu_experts_mask.pt`` (KTransformers' mask), ``activation_stats.pt`` (an expert
    distribution whose most frequent experts, per layer and overall, are ktc's GPU experts) and
    ``kt_args.json`` into ``folder``; returns what ``kt_args.json`` holds, with a command line."""
    import torch

    os.makedirs(folder, exist_ok=True)
    mask = kt_mask(plan)
    mask_path = os.path.join(folder, "gpu_experts_mask.pt")
    torch.save(torch.from_numpy(mask), mask_path + ".tmp")
    os.replace(mask_path + ".tmp", mask_path)
    # The frequency strategy puts the most used experts on the GPU: ktc's GPU experts get the
    # profile's counts plus more than any count, so they rank first in every layer and overall.
    counts = np.zeros(mask.shape, dtype=np.float64)
    counts[list(plan.placement.layers)] = plan.profile.counts
    counts[mask] += counts.max() + 1.0
    stats_path = os.path.join(folder, "activation_stats.pt")
    torch.save({"logical_count": torch.from_numpy(counts[None])}, stats_path + ".tmp")
    os.replace(stats_path + ".tmp", stats_path)
    total = int(mask.sum())
    layers = max(len(plan.model.moe_layers), 1)
    uniform = plan.baseline("uniform")
    most_uniform = uniform.gpu_experts // layers if uniform.feasible else 0
    per_layer = min(round(total / layers), most_uniform)  # a suggestion that fits the budget
    # The ratio of all experts that gives exactly ktc's count whether it is floored or rounded.
    ratio = (total + 0.25) / (layers * plan.model.num_experts) if total else 0.0
    command = (f"python -m sglang.launch_server --model MODEL --kt-gpu-experts-ratio {ratio:.8f} "
               f"--kt-expert-placement-strategy frequency --init-expert-location {stats_path}")
    info = {"gpu_experts_mask": mask_path, "activation_stats": stats_path, "gpu_experts_total": total,
            "kt_num_gpu_experts": per_layer, "kt_gpu_experts_ratio": round(ratio, 8),
            "sglang_command": command, "targets": SGLANG_KT_TARGET,
            "note": "--kt-num-gpu-experts is per MoE layer; the largest that fits this budget with the "
                    "same number in every layer is kt_num_gpu_experts. The ratio command places "
                    "ktc's GPU experts through the frequency strategy."}
    with open(os.path.join(folder, "kt_args.json"), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=1)
    return info


# ----------------------------------------------------------------------------------------------
# llama.cpp


@dataclass(frozen=True)
class LlamaCppPlan:
    cpu_layers: tuple[int, ...]
    predicted_ms_per_step: float
    rules: str
    optimal: bool


def llamacpp_plan(plan: Plan) -> LlamaCppPlan:
    """The best placement at llama.cpp's granularity: a layer's experts are one tensor each, so
    a whole layer's experts sit on one device. Solved exactly with the same cost model."""
    usage = plan.usage
    layers, experts = usage.shape
    gpu_opt = next(o for o in _problem_options(plan) if o.device == GPU)
    cpu_opt = next(o for o in _problem_options(plan) if o.device == CPU)
    # One item per layer: its usage-weighted expert traffic at the first GPU / CPU scheme.
    items = (
        PlacementOption(GPU, gpu_opt.scheme, gpu_opt.vram_bytes * experts, 0, gpu_opt.seconds_per_use),
        PlacementOption(CPU, cpu_opt.scheme, 0, cpu_opt.ram_bytes * experts, cpu_opt.seconds_per_use),
    )
    fixed_vram = sum(v for k, v in plan.memory.vram if k != "gpu_experts")
    fixed_ram = sum(v for k, v in plan.memory.ram if k != "cpu_experts")
    transfer = 4 * plan.workload.batch * plan.model.hidden_size / plan.hardware.pcie_bandwidth
    problem = PlacementProblem(
        usage=usage.sum(axis=1, keepdims=True), options=items,
        allowed=np.ones((layers, 1, 2), dtype=bool),
        vram_budget=plan.memory.vram_budget - fixed_vram, ram_budget=plan.memory.ram_budget - fixed_ram,
        sync_seconds=np.full(layers, plan.hardware.sync_seconds + transfer))
    try:
        solution = solve_placement(problem)
    except KtcError as exc:
        raise KtcError("no whole-layer placement fits: " + exc.message) from None
    cpu_layers = tuple(layer for layer, c in zip(plan.placement.layers, solution.choice[:, 0]) if c == 1)
    if cpu_layers and cpu_layers == plan.placement.layers[:len(cpu_layers)]:
        # The first MoE layers on the CPU: llama.cpp's own flag (it counts every layer from 0).
        rules = f"-ngl 999 --n-cpu-moe {cpu_layers[-1] + 1}"
    elif cpu_layers:
        pattern = "|".join(str(layer) for layer in cpu_layers)
        rules = f'-ngl 999 -ot "blk\\.({pattern})\\.ffn_(up|down|gate|gate_up)_exps\\.=CPU"'
    else:
        rules = "-ngl 999"
    ms = plan.constant_ms + 1e3 * solution.objective
    return LlamaCppPlan(cpu_layers, ms, rules, solution.optimal)


def _problem_options(plan: Plan) -> tuple[PlacementOption, ...]:
    from ktc.formats.schemes import expert_footprint, get_scheme
    from ktc.passes.planner import expert_shape_from_facts

    shape = expert_shape_from_facts(plan.model)
    out = []
    for device, names, bw in ((GPU, plan.options.gpu_schemes, plan.hardware.gpu_bandwidth),
                              (CPU, plan.options.cpu_schemes, plan.hardware.cpu_bandwidth)):
        for name in names:
            fp = expert_footprint(shape, get_scheme(name))
            out.append(PlacementOption(device, name, fp.stored_bytes if device == GPU else 0,
                                       fp.stored_bytes if device == CPU else 0, fp.data_bytes / bw))
    return tuple(out)
