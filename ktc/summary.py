"""What ``ktc inspect`` reports about a model, computed from the IR alone (no tensor data)."""

from __future__ import annotations

from dataclasses import dataclass

from ktc.formats.hardware_profile import format_bytes
from ktc.ir import ModelIR, TensorRef, TensorRole

# Roles outside the routed experts that get their own line; the rest is "other".
_ROLE_KEYS = {
    TensorRole.ATTENTION: "attention",
    TensorRole.EMBEDDING: "embeddings",
    TensorRole.SHARED_EXPERT: "shared_experts",
    TensorRole.DENSE_MLP: "dense_mlp",
}
BYTE_KEYS = ("routed_experts", "shared_experts", "attention", "embeddings", "dense_mlp", "other")


@dataclass(frozen=True)
class ModelSummary:
    family: str
    architecture: str
    format: str
    path: str
    files: int
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    num_shared_experts: int
    hidden_size: int
    expert_intermediate_size: int
    expert_dtype: str
    bytes: dict[str, int]
    expert_bytes: int
    kv_bytes_per_token: int
    attention: str
    # Per component, how many of its tensors are stored in each type ("Q4_K", "BF16",
    # "F8_E4M3 + 128x128 scales"...).
    types: dict[str, dict[str, int]]

    def to_json(self) -> dict[str, object]:
        return {
            "family": self.family,
            "architecture": self.architecture,
            "source_format": self.format,
            "path": self.path,
            "files": self.files,
            "num_layers": self.num_layers,
            "moe_layers": list(self.moe_layers),
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "num_shared_experts": self.num_shared_experts,
            "hidden_size": self.hidden_size,
            "expert_intermediate_size": self.expert_intermediate_size,
            "expert_dtype": self.expert_dtype,
            "bytes": dict(self.bytes),
            "expert_bytes": self.expert_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "attention": self.attention,
            "types": {k: dict(v) for k, v in self.types.items()},
        }


def _type_name(ref: TensorRef) -> str:
    if ref.scale is None:
        return ref.dtype
    block = "x".join(str(n) for n in ref.scale_block) if ref.scale_block else "block"
    return f"{ref.dtype} + {block} scales"


def summarize(ir: ModelIR) -> ModelSummary:
    """Sizes by component at the source dtype, one expert's bytes and the KV cost per token."""
    totals = dict.fromkeys(BYTE_KEYS, 0)
    types: dict[str, dict[str, int]] = {k: {} for k in BYTE_KEYS}

    def count(key: str, ref: TensorRef) -> None:
        if len(ref.shape) >= 2:  # matrices: norms and biases are float everywhere
            types[key][_type_name(ref)] = types[key].get(_type_name(ref), 0) + 1

    for layer in ir.moe_layers:
        totals["routed_experts"] += sum(e.nbytes for e in layer.experts)
        totals["shared_experts"] += sum(e.nbytes for e in layer.shared_experts)
        for expert in layer.experts:
            for ref in (expert.gate, expert.up, expert.down):
                count("routed_experts", ref)
        for shared in layer.shared_experts:
            for ref in shared.tensors:
                count("shared_experts", ref)
        for ref in (layer.shared_expert_gate,):
            if ref is not None:
                totals["shared_experts"] += ref.nbytes
        for ref in (layer.router, layer.router_bias, layer.score_correction_bias):
            if ref is not None:
                totals["other"] += ref.nbytes
    for tensor in ir.dense:
        totals[_ROLE_KEYS.get(tensor.role, "other")] += tensor.ref.nbytes
        count(_ROLE_KEYS.get(tensor.role, "other"), tensor.ref)
    first = ir.moe_layers[0].experts[0] if ir.moe_layers else None
    cfg = ir.config
    return ModelSummary(
        family=ir.family,
        architecture=cfg.architecture,
        format=ir.source.format,
        path=ir.source.path,
        files=len(ir.source.files),
        num_layers=cfg.num_layers,
        moe_layers=ir.moe_layer_indices,
        num_experts=cfg.num_experts,
        top_k=cfg.top_k,
        num_shared_experts=cfg.num_shared_experts,
        hidden_size=cfg.hidden_size,
        expert_intermediate_size=first.intermediate_size if first else 0,
        expert_dtype=first.gate.dtype if first else "",
        bytes=totals,
        expert_bytes=first.nbytes if first else 0,
        kv_bytes_per_token=cfg.kv_bytes_per_token(2),
        attention=cfg.attention.value,
        types={k: v for k, v in types.items() if v},
    )


def format_ranges(values: tuple[int, ...]) -> str:
    """(0, 1, 2, 5, 7, 8) -> '0-2, 5, 7-8'."""
    parts: list[str] = []
    start = prev = None
    for v in values:
        if start is None:
            start = prev = v
        elif v == prev + 1:
            prev = v
        else:
            parts.append(f"{start}-{prev}" if start != prev else f"{start}")
            start = prev = v
    if start is not None:
        parts.append(f"{start}-{prev}" if start != prev else f"{start}")
    return ", ".join(parts)


def render_text(s: ModelSummary) -> str:
    b = s.bytes
    lines = [
        f"{s.path}  ({s.format}, {s.files} file{'s' if s.files != 1 else ''})",
        f"family        {s.family}  ({s.architecture})",
        f"layers        {s.num_layers}, MoE layers {format_ranges(s.moe_layers)}",
        f"experts       {s.num_experts} per layer, top-{s.top_k}, {s.num_shared_experts} shared; "
        f"hidden {s.hidden_size}, expert FFN {s.expert_intermediate_size}",
        f"one expert    {format_bytes(s.expert_bytes)} at {s.expert_dtype}",
        "bytes         " + ", ".join(f"{k.replace('_', ' ')} {format_bytes(b[k])}" for k in b),
        f"total         {format_bytes(sum(b.values()))}",
        f"KV cache      {format_bytes(s.kv_bytes_per_token)} per token at 16 bits ({s.attention.upper()})",
        "stored as     " + "; ".join(f"{k.replace('_', ' ')} " + ", ".join(
            f"{name} x{n}" for name, n in sorted(v.items(), key=lambda item: -item[1]))
            for k, v in s.types.items()),
    ]
    return "\n".join(lines)
