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
from ktc.passes.plan import Plan
from ktc.formats.hardware_profile import format_parts
from ktc.summary import format_bytes, format_ranges


def _speedup(plan: Plan, ms: float | None) -> str:
    if ms is None:
        return "does not fit"
    if ms <= 0:
        return ""
    ratio = ms / plan.predicted_ms_per_step
    return "same as ktc" if f"{ratio:.2f}" == "1.00" else f"ktc is {ratio:.2f}x faster"


def _from_source(plan: Plan, schemes: tuple[str, ...] | None = None) -> str:
    """A note for a scheme list that is the source's own expert type (the default)."""
    own = plan.options.from_source
    if not own or (schemes is not None and ", ".join(schemes) != own):
        return ""
    per_layer = " layer by layer" if len(set(plan.options.layer_schemes)) > 1 else ""
    return f" ({own}: the source's own, passed through as stored{per_layer})"


def _routing(plan: Plan) -> str:
    """Where the plan's routing statistics came from, and how many tokens they hold."""
    profile = plan.profile
    if profile.source == "uniform":
        return "uniform (no --profile)"
    tokens = profile.counts.sum(axis=1).max() / max(plan.model.top_k, 1)
    return f"the profile {profile.source} ({tokens:,.0f} tokens a layer)"


def render_plan_text(plan: Plan) -> str:
    m = plan.model
    mem = plan.memory
    lines = [
        f"plan for {m.family} ({m.architecture}): {len(m.moe_layers)} MoE layers x {m.num_experts} "
        f"experts, top-{m.top_k}; batch {plan.workload.batch}, KV cache {plan.workload.max_tokens} "
        f"tokens at {plan.workload.kv_dtype}",
        f"VRAM {format_bytes(mem.vram_total)} of {format_bytes(mem.vram_budget)}: " + format_parts(mem.vram)
        if not plan.hardware.cpu_only else
        "VRAM: none (--vram 0): the model runs on the CPU, every weight and buffer in RAM",
        f"RAM  {format_bytes(mem.ram_total)} of {format_bytes(mem.ram_budget)}: " + format_parts(mem.ram),
    ]
    from ktc.formats.model_config import OTHER_ROUTERS

    lines.append(f"routing statistics: {_routing(plan)}")
    if plan.options.activation_errors:
        lines.append("scheme errors (quality term, weight " + f"{plan.options.quality_weight:g}): measured on the "
                     "calibration text's activations, mean over layers " +
                     ", ".join(f"{s} {sum(e) / len(e):.4f}" for s, e in plan.options.activation_errors))
    if m.family in OTHER_ROUTERS:
        lines.append(f"routing: {m.family} routes with {OTHER_ROUTERS[m.family]}, which ktc's MoE layer "
                     "does not compute; the plan takes its statistics from the profile (uniform without one)")
    per_layer = plan.placement.gpu_experts_per_layer()
    lines.append(f"GPU experts: {sum(per_layer)} of {len(per_layer) * m.num_experts}; per layer "
                 f"{_runs(plan.placement.layers, per_layer)}")
    lines.append("schemes: " + ", ".join(f"{d} {k} x{v}" for (d, k), v in sorted(_scheme_counts(plan).items()))
                 + _from_source(plan))
    on_disk = sum(p.device is Device.DISK for row in plan.placement.experts for p in row)
    if on_disk:
        lines.append(f"disk tier: {on_disk} experts, the least used where RAM is short, stay in the bundle's map "
                     f"outside the RAM budget, read at {plan.hardware.disk_bandwidth / 1e9:.1f} GB/s when used "
                     "(ktc run reads the RAM experts in and pages these in a layer ahead)")
    status = "optimal" if plan.solve.optimal else f"within {100 * plan.solve.gap:.2f}% of optimal (proven)"
    lines.append(f"predicted: {plan.predicted_ms_per_token:.3f} ms/token, {plan.tokens_per_second:.1f} "
                 f"tokens/s ({plan.constant_ms:.3f} ms non-expert weights + {plan.expert_ms:.3f} ms "
                 f"experts per step); solved in {plan.solve.seconds:.2f} s, {status}")
    if sum(per_layer) and plan.hardware.device_step_seconds == 0:
        lines.append("device step: not modelled: the runtime's fixed cost of a layer's step with GPU experts "
                     "(ktc doctor --calibrate on the serving machine measures it; --device-step-us) was about "
                     "1.1 ms on one H200 machine, where such small experts as Qwen3-30B-A3B's lose to the CPU")
    lines += streaming_lines(plan)
    single = plan.single_scheme
    width = max([len(b.schemes) for b in plan.baselines] + [len(single.schemes) if single else 0]) + 1
    held = [f"{format_bytes(b)} for {what}" for b, what in ((plan.options.cache_vram, "cache slots"),
                                                             (plan.options.offload_vram, "the prefill offload"))
            if b]
    lines.append("baselines on the same budget" + (f" (less the {' and '.join(held)}, as ktc's)" if held else "")
                 + " and model, each at its best one scheme per device:")
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


def streaming_lines(plan: Plan) -> list[str]:
    """The streaming plan (``ktc.streaming``): the cache slots and what they were chosen on,
    and the prefill offload's threshold, buffer and predicted gain."""
    return cache_lines(plan) + offload_lines(plan)


def cache_lines(plan: Plan) -> list[str]:
    """The device cache's slots and what they were chosen on."""
    st = plan.streaming
    if st is None or st.slot_scheme is None:
        return []
    lines = []
    if st.splits:
        static, chosen = st.static, st.chosen
        tried = ", ".join(f"{s.label}: {s.ms_per_token:.3f}" for s in st.splits)
        lines.append(f"device cache: {st.evidence}; predicted ms/token by slots a layer: {tried}")
        if st.cache_slots and chosen is not None and static is not None:
            where = ("a layer" if chosen.held == len(chosen.layer_slots)
                     else f"a layer in {chosen.held} of the {len(chosen.layer_slots)} MoE layers")
            lines.append(f"  chosen: {st.cache_slots} slot{'s' * (st.cache_slots != 1)} {where} at {st.slot_scheme} "
                         f"({format_bytes(plan.options.cache_vram)}), {static.gpu_experts - chosen.gpu_experts} "
                         f"residents fewer; {chosen.ms_per_token:.3f} ms/token, {100 * chosen.hit_rate:.1f}% of "
                         f"expert uses on the device, against the static plan's {static.ms_per_token:.3f} "
                         f"({100 * static.hit_rate:.1f}%): {static.ms_per_token / chosen.ms_per_token:.2f}x")
            if st.slot_scheme not in plan.options.gpu_schemes:
                lines.append(f"  (the slots hold the CPU experts' {st.slot_scheme}, which the residents may not use: "
                             "part of the gain can be its smaller bytes; plan with --gpu-schemes "
                             f"{','.join(plan.options.gpu_schemes)},{st.slot_scheme} to let the residents take it too)")
        else:
            lines.append("  chosen: no slots (none predicts a faster decode than the static plan on this trace)")
    else:
        lines.append(f"device cache: no slots ({st.evidence})")
    return lines


def offload_lines(plan: Plan) -> list[str]:
    """The prefill offload's threshold, the VRAM its copies get and what that rests on."""
    st = plan.streaming
    if st is None or st.slot_scheme is None:
        return []
    lines = []
    free = plan.hardware.vram_bytes - plan.memory.vram_total
    held = plan.options.offload_vram
    room = (f"the {format_bytes(held)} held for them and the {format_bytes(max(free, 0))} the plan leaves free"
            if held else f"the {format_bytes(max(free, 0))} the plan leaves free")
    line = (f"prefill offload: from {st.prefill_min_tokens} tokens a forward, {st.prefill_basis}; its copies get "
            f"{room}")
    if st.prefill_static_tokens_per_s and st.prefill_offload_tokens_per_s:
        line += (f"; a {plan.workload.prefill_chunk}-token chunk's MoE experts {st.prefill_static_tokens_per_s:.0f} "
                 f"tokens/s on the CPU alone, {st.prefill_offload_tokens_per_s:.0f} with the offload "
                 f"({st.prefill_offload_tokens_per_s / st.prefill_static_tokens_per_s:.2f}x)")
    lines.append(line)
    if st.offload_splits:
        base = st.offload_splits[0]
        tried = ", ".join(f"{format_bytes(s.vram)}: {s.request_seconds:.3g} s" for s in st.offload_splits)
        lines.append(f"  buffer for its copies: {st.offload_evidence}; predicted request by buffer: {tried}")
        chosen = next((s for s in st.offload_splits if s.vram == held), base)
        if held:
            lines.append(f"  chosen: {format_bytes(held)}, {base.gpu_experts - chosen.gpu_experts} residents fewer; "
                         f"prefill {chosen.prefill_tokens_per_s:.0f} against {base.prefill_tokens_per_s:.0f} tokens/s, "
                         f"decode {chosen.decode_ms_per_step:.3f} against {base.decode_ms_per_step:.3f} ms a step")
    else:
        lines.append(f"  buffer for its copies: none ({st.offload_evidence})")
    return lines


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


def _layer_times(plan: Plan) -> tuple[np.ndarray, np.ndarray]:
    """Per MoE layer, the predicted ms per step of its GPU experts and of its CPU experts."""
    seconds = {(o.device, o.scheme): o.seconds_per_use for o in _problem_options(plan)}
    gpu = np.zeros(len(plan.placement.layers))
    cpu = np.zeros(len(plan.placement.layers))
    for i, row in enumerate(plan.placement.experts):
        for e, p in enumerate(row):
            side = gpu if p.device is Device.GPU else cpu  # the disk tier computes on the CPU
            side[i] += plan.usage[i, e] * seconds[(p.device.value, p.scheme)] * 1e3
    return gpu, cpu


_HUE = {Device.GPU: 215, Device.CPU: 28, Device.DISK: 280}  # blue, orange, purple


def _shade(device: Device, level: float) -> str:
    """Light (rarely used) to dark (often used), in the device's own hue."""
    return f"hsl({_HUE[device]},75%,{88 - 58 * level:.0f}%)"


def render_plan_html(plan: Plan) -> str:
    """A self-contained page. Per MoE layer, its experts sorted by how often they are routed to
    (so the GPU/CPU split reads as a frontier; the expert's index is in the tooltip), each cell
    shaded in its device's colour scale; beside each row a bar of the layer's predicted GPU and
    CPU time and its GPU expert count. Below: schemes, budgets, bandwidths, the memory
    breakdown, the baselines with ktc's own row, and the exports."""
    usage = plan.usage
    layers, experts = usage.shape
    gap = 1  # a white line between cells: neighbours on one device do not merge into a bar
    cell = max(6, min(24, 1000 // max(experts, 1)))  # 256 experts: 6 px each, the map scrolls
    height = max(8, min(24, 640 // max(layers, 1)))
    label, bar_width, text_width = 40, 150, 270
    bars_x = label + 4
    map_x = bars_x + bar_width + text_width  # the map last: a wide one scrolls, the bars stay
    top = float(usage.max()) if usage.size and usage.max() > 0 else 1.0
    gpu_ms, cpu_ms = _layer_times(plan)
    sync_ms = 1e3 * plan.hardware.sync_seconds
    longest = max(float(max(gpu_ms.max(initial=0), cpu_ms.max(initial=0))), 1e-12)
    map_width = experts * cell
    parts = []
    axis_y = layers * height + 14
    ticks = [0] + [r for r in (experts // 4, experts // 2, 3 * experts // 4) if 0 < r < experts - 1] + [experts - 1]
    for rank in sorted(set(ticks)):
        x = map_x + rank * cell + cell / 2
        parts.append(f'<line x1="{x}" y1="{layers * height}" x2="{x}" y2="{layers * height + 4}" stroke="#555"/>'
                     f'<text x="{x}" y="{axis_y}" font-size="10" text-anchor="middle" fill="#555">{rank + 1}</text>')
    parts.append(f'<text x="{map_x}" y="{axis_y + 14}" font-size="11" fill="#333">experts of the layer by '
                 f'rank, most routed to first</text>')
    parts.append(f'<text x="{bars_x}" y="{axis_y}" font-size="11" fill="#333">ms per step: GPU experts '
                 f'(blue), CPU experts (orange)</text>')
    for i, layer in enumerate(plan.placement.layers):
        y = i * height
        row = plan.placement.experts[i]
        if layers <= 32 or i % max(1, layers // 16) == 0:
            parts.append(f'<text x="{label - 4}" y="{y + height - 2}" font-size="{min(height - 1, 11)}" '
                         f'text-anchor="end" fill="#555">{layer}</text>')
        order = np.argsort(-usage[i], kind="stable")
        for rank, e in enumerate(order.tolist()):
            p = row[e]
            level = float(usage[i, e]) / top
            parts.append(f'<rect x="{map_x + rank * cell}" y="{y}" width="{cell - gap}" height="{height - gap}" '
                         f'fill="{_shade(p.device, level)}"><title>layer {layer}, expert {e} (rank {rank + 1}): '
                         f'{p.device.value} {p.scheme}, used {float(usage[i, e]):.3f} per step</title></rect>')
        n_gpu = sum(p.device is Device.GPU for p in row)
        g = bar_width * float(gpu_ms[i]) / longest
        c = bar_width * float(cpu_ms[i]) / longest
        note = ", no sync (all GPU)" if n_gpu == experts else ""
        parts.append(f'<rect x="{bars_x}" y="{y + 1}" width="{g:.1f}" height="{max(height / 2 - 1, 2):.1f}" '
                     f'fill="{_shade(Device.GPU, 0.7)}"><title>layer {layer}: GPU experts {gpu_ms[i]:.4f} ms'
                     f'</title></rect>'
                     f'<rect x="{bars_x}" y="{y + height / 2:.1f}" width="{c:.1f}" height="{max(height / 2 - 1, 2):.1f}" '
                     f'fill="{_shade(Device.CPU, 0.7)}"><title>layer {layer}: CPU experts {cpu_ms[i]:.4f} ms'
                     f'{"" if n_gpu == experts else f" + sync {sync_ms:.3f} ms"}</title></rect>'
                     f'<text x="{bars_x + bar_width + 6}" y="{y + height - 2}" font-size="{min(height - 1, 11)}" '
                     f'fill="#333">{n_gpu}/{experts} GPU, {plan.layer_ms[i] if plan.layer_ms else 0:.3g} ms'
                     f'{note}</text>')
    svg_width = map_x + max(map_width, 260) + 8  # room for the axis caption under a narrow map
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{svg_width}" height="{axis_y + 22}" '
           f'shape-rendering="crispEdges">{"".join(parts)}</svg>')
    scale = "".join(
        f'<span class="scale"><b>{device.value.upper()}</b> {_scale_stops(device)} '
        f'rarely routed to (0) &rarr; most ({top:.3f} per step)</span>' for device in (Device.GPU, Device.CPU))

    def table(rows: list[tuple[str, ...]], head: tuple[str, ...]) -> str:
        cells = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
        return "<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>" + cells + "</table>"

    m, hw, w, o = plan.model, plan.hardware, plan.workload, plan.options
    memory = table([(k.replace("_", " "), format_bytes(v)) for k, v in plan.memory.vram],
                   ("VRAM", f"{format_bytes(plan.memory.vram_total)} of {format_bytes(plan.memory.vram_budget)}"))
    memory += table([(k.replace("_", " "), format_bytes(v)) for k, v in plan.memory.ram],
                    ("RAM", f"{format_bytes(plan.memory.ram_total)} of {format_bytes(plan.memory.ram_budget)}"))
    base_rows = [("ktc", "this plan", "mixed" if len(o.gpu_schemes) + len(o.cpu_schemes) > 2 else
                  f"gpu {o.gpu_schemes[0]}, cpu {o.cpu_schemes[0]}",
                  f"{plan.predicted_ms_per_token:.3f}", "")]
    if plan.single_scheme is not None:
        s1 = plan.single_scheme
        base_rows.append(("ktc", "one scheme per device", s1.schemes,
                          f"{s1.predicted_ms_per_step / w.batch:.3f}", _speedup(plan, s1.predicted_ms_per_step)))
    base_rows += [(b.name, b.setting, b.schemes,
                   "-" if b.predicted_ms_per_step is None else f"{b.predicted_ms_per_step / w.batch:.3f}",
                   _speedup(plan, b.predicted_ms_per_step)) for b in plan.baselines]
    baselines = table(base_rows, ("placement", "setting", "schemes", "ms/token", "against ktc"))
    schemes = ", ".join(f"{d} {k} x{v}" for (d, k), v in sorted(_scheme_counts(plan).items()))
    assumptions = table([
        ("GPU schemes allowed", ", ".join(o.gpu_schemes) + _from_source(plan, o.gpu_schemes)),
        ("CPU schemes allowed", ", ".join(o.cpu_schemes) + _from_source(plan, o.cpu_schemes)),
        ("non-expert weights", o.dense_scheme), ("schemes used", schemes),
        ("VRAM budget", f"{format_bytes(hw.vram_bytes)} (reserve {format_bytes(hw.reserve_bytes)})"),
        ("RAM budget", format_bytes(hw.ram_bytes)),
        ("bandwidths", f"CPU {hw.cpu_bandwidth / 1e9:.0f} GB/s, GPU {hw.gpu_bandwidth / 1e9:.0f} GB/s, "
                       f"PCIe {hw.pcie_bandwidth / 1e9:.0f} GB/s"),
        ("CPU-GPU sync", f"{sync_ms * 1e3:.0f} us per layer with a CPU expert"),
        ("device step", f"{hw.device_step_seconds * 1e6:.0f} us per layer with a GPU expert"
         if hw.device_step_seconds > 0 else "not modelled (ktc doctor --calibrate on a CUDA machine measures it)"),
        ("workload", f"batch {w.batch}, KV cache {w.max_tokens} tokens at {w.kv_dtype}"),
        ("routing", _routing(plan)),
    ], ("assumption", "value"))
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>ktc plan: {html.escape(m.family)}</title>
<style>
body{{font-family:system-ui,sans-serif;margin:24px;color:#222}}
table{{border-collapse:collapse;margin:8px 16px 20px 0;display:inline-table;vertical-align:top}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:left}}
.scale{{display:inline-block;margin-right:28px}}.scale i{{display:inline-block;width:18px;height:12px}}
.map{{overflow:auto;border:1px solid #ccc;max-width:100%;padding:6px 0}}
</style></head><body>
<h1>ktc plan: {html.escape(m.family)} ({html.escape(m.architecture)})</h1>
<p>{len(m.moe_layers)} MoE layers x {m.num_experts} experts, top-{m.top_k}. Predicted
<b>{plan.predicted_ms_per_token:.3f} ms/token</b> ({plan.tokens_per_second:.1f} tokens/s),
{sum(plan.placement.gpu_experts_per_layer())} experts on the GPU.</p>
<p>Each row is a MoE layer (numbered on the left); its experts are sorted by how often they are
routed to, most first, so the GPU experts of a layer form its left part. Hover a cell for the
expert's index, device, scheme and use. The bars give each layer's predicted time of its GPU
and of its CPU experts (which run at the same time), then its GPU experts and time. A layer with
every expert on the GPU saves the CPU-GPU synchronisation, which is why a nearly full layer is
often filled.</p>
<p>{scale}</p>
<div class="map">{svg}</div>
<h2>Against the baselines</h2>
{baselines}
<h2>Assumptions and memory</h2>
{assumptions}{memory}
<h2>Exports</h2>
<p><code>ktc plan MODEL ... -o plan.json</code> then <code>ktc compile MODEL --plan plan.json -o model.ktb</code>;
<code>--export-kt DIR</code> for SGLang with KTransformers (a mask, an expert distribution and a command
line); <code>--export-llamacpp</code> for llama.cpp's <code>-ot</code> rules or <code>--n-cpu-moe</code>.</p>
</body></html>
"""


def _scale_stops(device: Device) -> str:
    return "".join(f'<i style="background:{_shade(device, level)}"></i>' for level in (0.0, 0.25, 0.5, 0.75, 1.0))


def _scheme_counts(plan: Plan) -> dict[tuple[str, str], int]:
    counts: dict[tuple[str, str], int] = {}
    for row in plan.placement.experts:
        for p in row:
            counts[(p.device.value, p.scheme)] = counts.get((p.device.value, p.scheme), 0) + 1
    return counts


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
    ratio = min(1.0, (total + 0.25) / (layers * plan.model.num_experts)) if total else 0.0
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
    predicted_ms_per_step: float | None  # None: not predicted (no GPU, experts that do not fit RAM)
    rules: str
    optimal: bool


def llamacpp_plan(plan: Plan) -> LlamaCppPlan:
    """The best placement at llama.cpp's granularity: a layer's experts are one tensor each, so
    a whole layer's experts sit on one device. Solved exactly with the same cost model."""
    if plan.hardware.cpu_only:
        # No GPU: llama.cpp keeps every layer on the CPU, as ktc's plan, at the same predicted
        # time, unless the plan keeps experts on disk: llama.cpp reads those through its map as
        # the page cache allows, which the cost model does not predict.
        disk = any(p.device is Device.DISK for row in plan.placement.experts for p in row)
        return LlamaCppPlan(plan.placement.layers, None if disk else plan.predicted_ms_per_step, "-ngl 0", True)
    usage = plan.usage
    layers, experts = usage.shape
    # One item per layer and device: its usage-weighted expert traffic at the first GPU / CPU
    # scheme allowed, or at the layer's own where the plan keeps each layer's (llama.cpp loads a
    # GGUF's tensors at their stored types).
    options = _problem_options(plan)
    own = plan.options.layer_schemes or (None,) * layers
    items: list[PlacementOption] = []
    allowed = np.zeros((layers, 1, 0), dtype=bool)
    for layer, scheme in enumerate(own):
        for device in (GPU, CPU):
            o = next((o for o in options if o.device == device and o.scheme == scheme),
                     next(o for o in options if o.device == device))
            item = PlacementOption(device, o.scheme, o.vram_bytes * experts, o.ram_bytes * experts,
                                   o.seconds_per_use)
            if item not in items:
                items.append(item)
                allowed = np.concatenate([allowed, np.zeros((layers, 1, 1), dtype=bool)], axis=2)
            allowed[layer, 0, items.index(item)] = True
    fixed_vram = sum(v for k, v in plan.memory.vram if k != "gpu_experts")
    fixed_ram = sum(v for k, v in plan.memory.ram if k != "cpu_experts")
    transfer = 4 * plan.workload.batch * plan.model.hidden_size / plan.hardware.pcie_bandwidth
    problem = PlacementProblem(
        usage=usage.sum(axis=1, keepdims=True), options=tuple(items), allowed=allowed,
        vram_budget=plan.memory.vram_budget - fixed_vram, ram_budget=plan.memory.ram_budget - fixed_ram,
        sync_seconds=np.full(layers, plan.hardware.sync_seconds + transfer),
        device_seconds=np.full(layers, plan.hardware.device_step_seconds))
    try:
        solution = solve_placement(problem)
    except KtcError as exc:
        raise KtcError("no whole-layer placement fits: " + exc.message) from None
    cpu_layers = tuple(layer for layer, c in zip(plan.placement.layers, solution.choice[:, 0])
                       if items[c].device == CPU)
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
    from ktc.formats.schemes import expert_footprint
    from ktc.passes.plan import expert_shape_from_facts

    shape = expert_shape_from_facts(plan.model)
    out = []
    for device, names, bw in ((GPU, plan.options.gpu_schemes, plan.hardware.gpu_bandwidth),
                              (CPU, plan.options.cpu_schemes, plan.hardware.cpu_bandwidth)):
        for name in names:
            fp = expert_footprint(shape, name)
            out.append(PlacementOption(device, name, fp.stored_bytes if device == GPU else 0,
                                       fp.stored_bytes if device == CPU else 0, fp.data_bytes / bw))
    return tuple(out)
