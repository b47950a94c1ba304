"""Lay out a bundle: which tensors go in which segment, in which order, at which offsets.

Everything here is metadata; ``passes/emit.py`` moves the bytes. Nothing depends on the compiling
machine (cores, NUMA nodes): the same IR and placement give the same layout everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from ktc.errors import ConfigError
from ktc.formats.schemes import (
    EXPERT_ALIGN, TENSOR_ALIGN, align, get_scheme, non_expert_scheme,
)
from ktc.ir import Device, Expert, ModelIR, Placement, TensorRef, TensorRole

DEVICE, HOST = "device", "host"
# How rows are laid out, recorded per tensor in the manifest.
LAYOUT_GATE_UP = "rows: gate (intermediate rows) then up (intermediate rows); row-major"
LAYOUT_ROWS = "row-major"


@dataclass(frozen=True)
class TensorJob:
    """One tensor of the bundle and where its values come from.

    ``sources`` are stacked along rows (gate then up for ``gate_up``); ``shape`` is the logical
    [rows, cols] (or 1-D) shape; ``offset`` is relative to the start of its block.
    """

    name: str
    role: str
    scheme: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int
    sources: tuple[TensorRef, ...]
    layout: str = LAYOUT_ROWS
    layer: int | None = None
    expert: int | None = None


@dataclass(frozen=True)
class BlockJob:
    """A checksummed unit: one expert (``kind == "expert"``) or one non-expert tensor."""

    kind: str
    name: str
    segment: str
    length: int  # uncompressed, padded
    tensors: tuple[TensorJob, ...]
    layer: int | None = None
    expert: int | None = None
    device: str | None = None  # for experts: "gpu" or "cpu"
    scheme: str | None = None

    @property
    def source_bytes(self) -> int:
        return sum(s.nbytes for t in self.tensors for s in t.sources)


@dataclass(frozen=True)
class BundleLayout:
    blocks: tuple[BlockJob, ...]  # in file order: the device segment's, then the host segment's

    def segment_blocks(self, segment: str) -> tuple[BlockJob, ...]:
        return tuple(b for b in self.blocks if b.segment == segment)


def _matrix_bytes(scheme: str, shape: tuple[int, ...]) -> int:
    s = get_scheme(scheme)
    if len(shape) <= 1 or (s.block_elems == 1 and s.row_extra_bytes == 0):
        count = 1
        for d in shape:
            count *= d
        if s.block_elems != 1:
            raise ConfigError(f"scheme {scheme} cannot store a 1-D tensor")
        return count * s.block_bytes
    return s.matrix_bytes(shape[0], shape[1])


def expert_block(expert: Expert, device: Device, scheme: str) -> BlockJob:
    """An expert's block: gate and up fused, down, then float32 biases; tensors aligned to 64,
    the block to a page. The same order and sizes as ``formats.schemes.expert_footprint``."""
    inter, hidden = expert.gate.shape
    s = get_scheme(scheme)
    if not (s.fits(hidden) and s.fits(inter)):
        raise ConfigError(f"scheme {s.name} needs rows that are a multiple of {s.block_elems} values; "
                          f"layer {expert.layer} expert {expert.index} has rows of {hidden} and {inter}",
                          hint="choose another scheme for this model")
    prefix = f"layers.{expert.layer}.experts.{expert.index}."
    specs: list[tuple[str, tuple[int, ...], str, tuple[TensorRef, ...], str]] = [
        ("gate_up", (2 * inter, hidden), s.name, (expert.gate, expert.up), LAYOUT_GATE_UP),
        ("down", (hidden, inter), s.name, (expert.down,), LAYOUT_ROWS),
    ]
    if expert.gate_bias is not None and expert.up_bias is not None:
        specs.append(("gate_up_bias", (2 * inter,), "f32", (expert.gate_bias, expert.up_bias), LAYOUT_GATE_UP))
    if expert.down_bias is not None:
        specs.append(("down_bias", (hidden,), "f32", (expert.down_bias,), LAYOUT_ROWS))
    tensors = []
    offset = 0
    for suffix, shape, tensor_scheme, sources, layout in specs:
        nbytes = _matrix_bytes(tensor_scheme, shape)
        tensors.append(TensorJob(prefix + suffix, "expert", tensor_scheme, shape, nbytes, offset, sources,
                                 layout, expert.layer, expert.index))
        offset = align(offset + nbytes, TENSOR_ALIGN)
    segment = DEVICE if device is Device.GPU else HOST
    return BlockJob("expert", f"layers.{expert.layer}.experts.{expert.index}", segment,
                    align(offset, EXPERT_ALIGN), tuple(tensors), expert.layer, expert.index,
                    device.value, s.name)


def _tensor_block(name: str, ref: TensorRef, role: str, segment: str, scheme: str,
                  layer: int | None) -> BlockJob:
    shape = ref.shape if len(ref.shape) <= 2 else (ref.shape[0], _prod(ref.shape[1:]))
    nbytes = _matrix_bytes(scheme, shape)
    job = TensorJob(name, role, scheme, shape, nbytes, 0, (ref,), LAYOUT_ROWS, layer)
    return BlockJob("tensor", name, segment, align(nbytes, TENSOR_ALIGN), (job,), layer)


def _prod(values: tuple[int, ...]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _is_input_embedding(ir: ModelIR, ref: TensorRef, role: TensorRole) -> bool:
    return (role is TensorRole.EMBEDDING and not ir.config.tie_word_embeddings
            and any(k in ref.name for k in ("embed_tokens", "token_embd", "wte")))


def plan_layout(ir: ModelIR, placement: Placement, dense_scheme: str = "bf16") -> BundleLayout:
    """The bundle's blocks in file order. Device segment: non-expert GPU tensors, then GPU
    experts by (layer, expert). Host segment: CPU experts by (layer, expert), then the input
    embedding table. Blocks within a segment follow each other; the last is padded to a page."""
    if placement.layers != ir.moe_layer_indices:
        raise ConfigError(f"the plan places experts of layers {list(placement.layers)[:8]}...; this "
                          f"model's MoE layers are {list(ir.moe_layer_indices)[:8]}...",
                          hint="the plan was made for another model")
    device_tensors: list[BlockJob] = []
    host_tensors: list[BlockJob] = []
    for tensor in ir.dense:
        if tensor.layer is not None and tensor.layer >= ir.config.num_layers:
            continue  # extra layers (DeepSeek-V3's multi-token prediction) are not served
        scheme = non_expert_scheme(tensor.ref.shape, router=tensor.role is TensorRole.ROUTER,
                                   dense_scheme=dense_scheme)
        host = _is_input_embedding(ir, tensor.ref, tensor.role)
        block = _tensor_block(tensor.ref.name, tensor.ref, tensor.role.value, HOST if host else DEVICE,
                              scheme, tensor.layer)
        (host_tensors if host else device_tensors).append(block)
    for layer in ir.moe_layers:
        prefix = f"layers.{layer.layer}."
        named = [("router", layer.router, True), ("router_bias", layer.router_bias, True),
                 ("score_correction_bias", layer.score_correction_bias, True),
                 ("shared_expert_gate", layer.shared_expert_gate, True)]
        for expert in layer.shared_experts:
            named += [("shared_experts.gate", expert.gate, False), ("shared_experts.up", expert.up, False),
                      ("shared_experts.down", expert.down, False)]
        for suffix, ref, router in named:
            if ref is None:
                continue
            scheme = non_expert_scheme(ref.shape, router=router, dense_scheme=dense_scheme)
            role = "router" if router else "shared_experts"
            device_tensors.append(_tensor_block(prefix + suffix, ref, role, DEVICE, scheme, layer.layer))
    gpu_experts: list[BlockJob] = []
    cpu_experts: list[BlockJob] = []
    for row, layer in zip(placement.experts, ir.moe_layers):
        if len(row) != len(layer.experts):
            raise ConfigError(f"the plan has {len(row)} experts for layer {layer.layer}; the model has "
                              f"{len(layer.experts)}", hint="the plan was made for another model")
        for where, expert in zip(row, layer.experts):
            block = expert_block(expert, where.device, where.scheme)
            (gpu_experts if where.device is Device.GPU else cpu_experts).append(block)
    blocks = _pad_last(device_tensors + gpu_experts) + _pad_last(cpu_experts + host_tensors)
    return BundleLayout(tuple(blocks))


def _pad_last(blocks: list[BlockJob]) -> list[BlockJob]:
    """Segments are page-aligned: the last block of a segment absorbs the padding."""
    if not blocks:
        return blocks
    total = sum(b.length for b in blocks)
    pad = align(total, EXPERT_ALIGN) - total
    last = blocks[-1]
    blocks[-1] = BlockJob(last.kind, last.name, last.segment, last.length + pad, last.tensors, last.layer,
                          last.expert, last.device, last.scheme)
    return blocks
