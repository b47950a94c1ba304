"""Lay out a bundle: which tensors go in which segment, in which order, at which offsets.

Everything here is metadata; ``passes/emit.py`` moves the bytes. Nothing depends on the compiling
machine (cores, NUMA nodes): the same IR and placement give the same layout everywhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import ClassVar

from ktc.errors import ConfigError, InternalError
from ktc.formats.schemes import (
    EXPERT_ALIGN, TENSOR_ALIGN, align, dense_scheme_name, expert_scheme_name, expert_schemes, get_scheme,
    non_expert_scheme,
)
from ktc.ir import Device, Expert, ModelIR, Placement, QuantPlan, TensorRef, TensorRole

from .base import Pass, PassContext
from .planner import check_placement

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
    source: str | None = None  # the checkpoint's name of a non-expert tensor


@dataclass(frozen=True)
class RunFile:
    """A file the bundle carries so that it runs without its source (a tokenizer file)."""

    name: str
    data: bytes = field(repr=False)


@dataclass(frozen=True)
class BlockJob:
    """A checksummed unit: one expert (``kind == "expert"``), one non-expert tensor, or one file
    (``kind == "file"``, its bytes in ``payload``)."""

    kind: str
    name: str
    segment: str
    length: int  # uncompressed, padded
    tensors: tuple[TensorJob, ...]
    layer: int | None = None
    expert: int | None = None
    device: str | None = None  # for experts: "gpu" or "cpu"
    scheme: str | None = None
    payload: bytes | None = field(default=None, repr=False)

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
    inter, hidden = expert.gate.shape  # choose_schemes has checked that the scheme fits
    gate_up, down = expert_schemes(scheme)
    prefix = f"layers.{expert.layer}.experts.{expert.index}."
    specs: list[tuple[str, tuple[int, ...], str, tuple[TensorRef, ...], str]] = [
        ("gate_up", (2 * inter, hidden), gate_up.name, (expert.gate, expert.up), LAYOUT_GATE_UP),
        ("down", (hidden, inter), down.name, (expert.down,), LAYOUT_ROWS),
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
                    device.value, expert_scheme_name(scheme))


def _tensor_block(name: str, ref: TensorRef, role: str, segment: str, scheme: str,
                  layer: int | None) -> BlockJob:
    shape = ref.shape if len(ref.shape) <= 2 else (ref.shape[0], _prod(ref.shape[1:]))
    nbytes = _matrix_bytes(scheme, shape)
    job = TensorJob(name, role, scheme, shape, nbytes, 0, (ref,), LAYOUT_ROWS, layer, source=ref.name)
    return BlockJob("tensor", name, segment, align(nbytes, TENSOR_ALIGN), (job,), layer)


def _prod(values: tuple[int, ...]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _is_input_embedding(ir: ModelIR, ref: TensorRef, role: TensorRole) -> bool:
    return (role is TensorRole.EMBEDDING and not ir.config.tie_word_embeddings
            and any(k in ref.name for k in ("embed_tokens", "token_embd", "wte")))


@dataclass(frozen=True)
class NonExpertTensor:
    """A tensor the bundle stores outside the experts."""

    name: str
    ref: TensorRef
    role: str
    layer: int | None
    router: bool  # routers (and their biases) are kept exact
    host: bool  # the input embedding table: a lookup, kept in host memory


def non_expert_tensors(ir: ModelIR) -> Iterator[NonExpertTensor]:
    """Every non-expert tensor the bundle stores, in bundle order: dense tensors, then each MoE
    layer's router, biases and shared experts."""
    for tensor in ir.dense:
        if tensor.layer is not None and tensor.layer >= ir.config.num_layers:
            continue  # extra layers (DeepSeek-V3's multi-token prediction) are not served
        yield NonExpertTensor(tensor.ref.name, tensor.ref, tensor.role.value, tensor.layer,
                              tensor.role is TensorRole.ROUTER, _is_input_embedding(ir, tensor.ref, tensor.role))
    for layer in ir.moe_layers:
        prefix = f"layers.{layer.layer}."
        named = [("router", layer.router, True), ("router_bias", layer.router_bias, True),
                 ("score_correction_bias", layer.score_correction_bias, True),
                 ("shared_expert_gate", layer.shared_expert_gate, True)]
        for expert in layer.shared_experts:
            named += [("shared_experts.gate", expert.gate, False), ("shared_experts.up", expert.up, False),
                      ("shared_experts.down", expert.down, False)]
        for suffix, ref, router in named:
            if ref is not None:
                yield NonExpertTensor(prefix + suffix, ref, "router" if router else "shared_experts",
                                      layer.layer, router, False)


def choose_schemes(ir: ModelIR, placement: Placement, dense_scheme: str = "auto") -> QuantPlan:
    """Every stored tensor's scheme: experts as placed, non-expert tensors by
    ``formats.schemes.non_expert_scheme``. Refuses a placement made for another model and a
    scheme that does not fit an expert's rows."""
    check_placement(ir, placement)
    rows = []
    for row, layer in zip(placement.experts, ir.moe_layers):
        for where, expert in zip(row, layer.experts):
            _check_fits(expert, where.scheme)
        rows.append(tuple(expert_scheme_name(where.scheme) for where in row))
    tensors = tuple((t.name, non_expert_scheme(t.ref.shape, router=t.router, dense_scheme=dense_scheme,
                                               source_dtype=t.ref.dtype))
                    for t in non_expert_tensors(ir))
    return QuantPlan(placement.layers, tuple(rows), tensors, dense_scheme_name(dense_scheme))


def _check_fits(expert: Expert, scheme: str) -> None:
    inter, hidden = expert.gate.shape
    for s, cols in zip(expert_schemes(scheme), (hidden, inter)):
        if not s.fits(cols):
            raise ConfigError(f"scheme {s.name} needs rows that are a multiple of {s.block_elems} values; "
                              f"layer {expert.layer} expert {expert.index} has rows of {hidden} and {inter}",
                              hint="choose another scheme for this model")


def plan_layout(ir: ModelIR, placement: Placement, quant: QuantPlan,
                files: tuple[RunFile, ...] = ()) -> BundleLayout:
    """The bundle's blocks in file order. Device segment: non-expert GPU tensors, then GPU
    experts by (layer, expert). Host segment: CPU experts by (layer, expert), the input
    embedding table, then ``files``. Blocks within a segment follow each other; the last is
    padded to a page."""
    schemes = dict(quant.tensors)
    device_tensors: list[BlockJob] = []
    host_tensors: list[BlockJob] = []
    for t in non_expert_tensors(ir):
        block = _tensor_block(t.name, t.ref, t.role, HOST if t.host else DEVICE, schemes[t.name], t.layer)
        (host_tensors if t.host else device_tensors).append(block)
    gpu_experts: list[BlockJob] = []
    cpu_experts: list[BlockJob] = []
    for row, expert_schemes, layer in zip(placement.experts, quant.experts, ir.moe_layers):
        for where, scheme, expert in zip(row, expert_schemes, layer.experts):
            block = expert_block(expert, where.device, scheme)
            (gpu_experts if where.device is Device.GPU else cpu_experts).append(block)
    # Every expert starts on a page: the device segment's tensors are padded to one before the
    # GPU experts that follow them (the host segment starts with its experts).
    file_blocks = [BlockJob("file", f.name, HOST, align(len(f.data), TENSOR_ALIGN), (), payload=f.data)
                   for f in files]
    blocks = (_pad_last(_pad_last(device_tensors) + gpu_experts)
              + _pad_last(cpu_experts + host_tensors + file_blocks))
    return BundleLayout(tuple(blocks))


def _pad_last(blocks: list[BlockJob]) -> list[BlockJob]:
    """Segments are page-aligned: the last block of a segment absorbs the padding."""
    if not blocks:
        return blocks
    total = sum(b.length for b in blocks)
    pad = align(total, EXPERT_ALIGN) - total
    last = blocks[-1]
    blocks[-1] = replace(last, length=last.length + pad)
    return blocks


class ChooseSchemes(Pass):
    """Attach every stored tensor's scheme (``ModelIR.quant``) from the placement."""

    name: ClassVar[str] = "quantize"
    requires: ClassVar[frozenset[str]] = frozenset({"experts", "placement"})
    produces: ClassVar[frozenset[str]] = frozenset({"quant"})

    def __init__(self, dense_scheme: str = "auto") -> None:
        self.dense_scheme = dense_scheme

    def run(self, ir: ModelIR | None, ctx: PassContext) -> ModelIR:
        if ir is None or ir.placement is None:
            raise InternalError("quantize needs an IR with a placement")
        return replace(ir, quant=choose_schemes(ir, ir.placement, self.dense_scheme))

    def verify(self, ir: ModelIR) -> None:
        quant, placement = ir.quant, ir.placement
        if quant is None or placement is None:
            raise InternalError("quantize produced no schemes")
        for row, schemes in zip(placement.experts, quant.experts):
            if tuple(expert_scheme_name(p.scheme) for p in row) != schemes:
                raise InternalError("expert schemes differ from the placement's")
        stored = {t.name for t in non_expert_tensors(ir)}
        if {name for name, _ in quant.tensors} != stored:
            raise InternalError("non-expert schemes do not cover the stored tensors")


class LayOut(Pass):
    """Order, align and size every block of the bundle (``ModelIR.layout``), with ``files``
    (the run files: tokenizer and such) at the end of the host segment."""

    name: ClassVar[str] = "layout"
    requires: ClassVar[frozenset[str]] = frozenset({"experts", "placement", "quant"})
    produces: ClassVar[frozenset[str]] = frozenset({"layout"})

    def __init__(self, files: tuple[RunFile, ...] = ()) -> None:
        self.files = files

    def run(self, ir: ModelIR | None, ctx: PassContext) -> ModelIR:
        if ir is None or ir.placement is None or ir.quant is None:
            raise InternalError("layout needs an IR with a placement and schemes")
        return replace(ir, layout=plan_layout(ir, ir.placement, ir.quant, self.files))

    def verify(self, ir: ModelIR) -> None:
        layout = ir.layout
        if not isinstance(layout, BundleLayout):
            raise InternalError("layout produced no bundle layout")
        verify_layout(layout)


def verify_layout(layout: BundleLayout) -> None:
    """The layout's invariants: device segment before host, every expert starting on a page
    (blocks follow each other from a page-aligned start), tensors aligned to 64 inside their
    block and not overlapping, segments whole pages."""
    seen_host = False
    at = 0
    for block in layout.blocks:
        if block.segment not in (DEVICE, HOST):
            raise InternalError(f"{block.name}: unknown segment {block.segment!r}")
        if block.segment == DEVICE and seen_host:
            raise InternalError(f"{block.name}: a device block after the host segment began")
        seen_host |= block.segment == HOST
        if block.kind == "expert" and at % EXPERT_ALIGN:
            raise InternalError(f"{block.name}: starts {at} bytes into the data, not on a page")
        end = 0
        for t in block.tensors:
            if t.offset % TENSOR_ALIGN or t.offset < end:
                raise InternalError(f"{t.name}: offset {t.offset} misaligned or overlapping")
            if t.nbytes != _matrix_bytes(t.scheme, t.shape):
                raise InternalError(f"{t.name}: {t.nbytes} bytes for {t.shape} in {t.scheme}")
            end = t.offset + t.nbytes
        if end > block.length:
            raise InternalError(f"{block.name}: tensors run past the block")
        at += block.length
    for segment in (DEVICE, HOST):
        if sum(b.length for b in layout.segment_blocks(segment)) % EXPERT_ALIGN:
            raise InternalError(f"the {segment} segment is not whole pages")
