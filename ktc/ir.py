"""The intermediate representation every pass reads and returns.

Everything here is a frozen dataclass. A ``TensorRef`` says where a tensor's bytes are and how to
view them; it never holds data, so an IR of a 1 TB model is a few megabytes of metadata and can be
sent to worker processes.
"""

from __future__ import annotations

import enum
import math
import mmap
import os
from dataclasses import dataclass, field
from typing import Union

import numpy as np

# --------------------------------------------------------------------------------------------
# Storage types


@dataclass(frozen=True)
class StorageType:
    """How one stored element type is laid out: ``block_elems`` values in ``block_bytes`` bytes.

    Plain types have ``block_elems == 1``. ``numpy`` is the dtype that ``TensorRef.load`` returns
    for the raw storage: the real type where numpy has it, the bit pattern (``uint16`` for bf16,
    ``uint8`` for fp8 and block-quantized data) where it does not.
    """

    name: str
    block_elems: int
    block_bytes: int
    numpy: str
    is_float: bool = False
    is_quantized: bool = False

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes that a tensor of ``shape`` occupies in this storage type."""
        count = math.prod(shape)
        if self.block_elems == 1:
            return count * self.block_bytes
        return count // self.block_elems * self.block_bytes


def _plain(name: str, numpy_name: str, size: int, is_float: bool) -> StorageType:
    return StorageType(name, 1, size, numpy_name, is_float=is_float)


# Block sizes of the ggml types are ggml's own (ggml-common.h); `tests/formats` checks this table
# against the gguf package's GGML_QUANT_SIZES so the two cannot drift apart.
_QUANT_BLOCKS: dict[str, tuple[int, int]] = {
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
    "Q8_0": (32, 34), "Q8_1": (32, 40),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176),
    "Q6_K": (256, 210), "Q8_K": (256, 292),
    "IQ2_XXS": (256, 66), "IQ2_XS": (256, 74), "IQ3_XXS": (256, 98), "IQ1_S": (256, 50),
    "IQ4_NL": (32, 18), "IQ3_S": (256, 110), "IQ2_S": (256, 82), "IQ4_XS": (256, 136),
    "IQ1_M": (256, 56), "TQ1_0": (256, 54), "TQ2_0": (256, 66),
    "MXFP4": (32, 17),
    # gpt-oss releases store MXFP4 as 16 bytes of nibbles per 32 values in `*_blocks`, with the
    # shared exponents in a separate `*_scales` tensor (see formats/dequant.py).
    "MXFP4_BLOCKS": (32, 16),
}

STORAGE_TYPES: dict[str, StorageType] = {
    t.name: t
    for t in (
        _plain("F64", "float64", 8, True),
        _plain("F32", "float32", 4, True),
        _plain("F16", "float16", 2, True),
        _plain("BF16", "uint16", 2, True),
        _plain("F8_E4M3", "uint8", 1, True),
        _plain("F8_E5M2", "uint8", 1, True),
        _plain("I64", "int64", 8, False),
        _plain("I32", "int32", 4, False),
        _plain("I16", "int16", 2, False),
        _plain("I8", "int8", 1, False),
        _plain("U64", "uint64", 8, False),
        _plain("U32", "uint32", 4, False),
        _plain("U16", "uint16", 2, False),
        _plain("U8", "uint8", 1, False),
        _plain("BOOL", "bool", 1, False),
        *(StorageType(name, elems, size, "uint8", is_float=True, is_quantized=True)
          for name, (elems, size) in _QUANT_BLOCKS.items()),
    )
}


def storage_type(name: str) -> StorageType:
    """The ``StorageType`` called ``name``; ``KeyError`` names the known ones."""
    try:
        return STORAGE_TYPES[name]
    except KeyError:
        raise KeyError(f"unknown storage type {name!r}; known: {', '.join(STORAGE_TYPES)}") from None


# --------------------------------------------------------------------------------------------
# Tensor references


@dataclass(frozen=True)
class ByteRange:
    """``nbytes`` bytes at absolute ``offset`` in ``path``; ``strides`` (in elements) when the
    stored tensor is not C-contiguous (a view saved by ``torch.save``)."""

    path: str
    offset: int
    nbytes: int
    strides: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Take:
    """Select index ``index`` of ``axis`` (the axis disappears): one expert of a stacked tensor."""

    axis: int
    index: int


@dataclass(frozen=True)
class Slice:
    """Keep ``start:stop:step`` of ``axis``: half of a fused gate_up, or gpt-oss's interleaving."""

    axis: int
    start: int
    stop: int
    step: int = 1


@dataclass(frozen=True)
class Transpose:
    """Swap the last two axes (gpt-oss stores expert weights as [in, out])."""


ViewOp = Union[Take, Slice, Transpose]


def _apply_shape(shape: tuple[int, ...], op: ViewOp) -> tuple[int, ...]:
    if isinstance(op, Take):
        return shape[: op.axis] + shape[op.axis + 1:]
    if isinstance(op, Slice):
        return shape[: op.axis] + (len(range(op.start, op.stop, op.step)),) + shape[op.axis + 1:]
    return shape[:-2] + (shape[-1], shape[-2])


def _apply_array(array: np.ndarray, op: ViewOp) -> np.ndarray:
    index: list[object] = [slice(None)] * array.ndim
    if isinstance(op, Take):
        index[op.axis] = op.index
        return array[tuple(index)]
    if isinstance(op, Slice):
        index[op.axis] = slice(op.start, op.stop, op.step)
        return array[tuple(index)]
    return np.swapaxes(array, -1, -2)


@dataclass(frozen=True)
class TensorRef:
    """A lazy handle on one tensor of a checkpoint.

    ``stored_shape`` is the shape in the file; ``view`` is a chain of zero-copy view operations
    (``Take``/``Slice``/``Transpose``) and ``shape`` the logical shape after them. Weights of
    experts are always viewed as ``[out_features, in_features]``, like ``torch.nn.Linear``.
    ``scale`` is a companion tensor of scales (DeepSeek-V3's ``weight_scale_inv`` for FP8 with
    ``scale_block`` = (128, 128); gpt-oss's ``*_scales`` for ``MXFP4_BLOCKS``).
    """

    name: str
    dtype: str
    stored_shape: tuple[int, ...]
    location: ByteRange
    view: tuple[ViewOp, ...] = ()
    scale: TensorRef | None = None
    scale_block: tuple[int, ...] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        shape = self.stored_shape
        for op in self.view:
            shape = _apply_shape(shape, op)
        return shape

    @property
    def storage(self) -> StorageType:
        return storage_type(self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of this (viewed) tensor at its stored type, scales included."""
        own = self.storage.nbytes(self.shape)
        return own + (self.scale.nbytes if self.scale is not None else 0)

    def with_view(self, *ops: ViewOp) -> TensorRef:
        """The same bytes seen through more view operations.

        Scales that share the weight's leading axes (per-row or per-block-of-a-row scales) take
        the same operations; 2-D block scales (``scale_block``) cannot follow a view.
        """
        scale = self.scale
        if scale is not None:
            if self.scale_block is not None or any(isinstance(op, Transpose) for op in ops):
                raise ValueError(f"{self.name}: cannot view a tensor with block scales")
            scale = scale.with_view(*ops)
        return TensorRef(self.name, self.dtype, self.stored_shape, self.location,
                         self.view + ops, scale, self.scale_block)

    def load(self, *, populate: bool = True) -> np.ndarray:
        """A zero-copy, read-only view of the stored representation (memory-mapped).

        ``populate`` maps the pages in at once (one call, cheaper than a fault per page for a
        reader in one thread); without it they are faulted in as read, which spreads the work
        over the threads of a parallel reader.

        Plain types come back as their numpy dtype (bf16 and fp8 as their bit patterns).
        Block-quantized types come back as ``uint8`` of shape ``shape[:-1] + (row_bytes,)``, so
        a view may select rows and experts but never split a row. ``formats.dequant`` turns any
        of them into float32.
        """
        st = self.storage
        loc = self.location
        stored_shape = self.stored_shape
        view = self.view
        offset, nbytes = loc.offset, loc.nbytes
        # Selecting one expert of a stacked tensor maps only that expert's bytes.
        while (view and isinstance(view[0], Take) and view[0].axis == 0 and loc.strides is None
               and len(stored_shape) > 1 and stored_shape[0] > 0):
            per_index = nbytes // stored_shape[0]
            offset += view[0].index * per_index
            nbytes = per_index
            stored_shape = stored_shape[1:]
            view = view[1:]
        if st.is_quantized:
            row_bytes = st.nbytes((stored_shape[-1],))
            raw_shape = stored_shape[:-1] + (row_bytes,)
        else:
            raw_shape = stored_shape
        dtype = np.dtype(st.numpy)
        if nbytes == 0:
            array = np.zeros(raw_shape, dtype=dtype)
        else:
            flat = _map_bytes(loc.path, offset, nbytes, populate).view(dtype)
            if loc.strides is not None:
                strides = tuple(s * dtype.itemsize for s in loc.strides)
                array = np.lib.stride_tricks.as_strided(flat, raw_shape, strides, writeable=False)
            else:
                array = flat.reshape(raw_shape)
        for op in view:
            if st.is_quantized and isinstance(op, Transpose):
                raise ValueError(f"{self.name}: a block-quantized tensor cannot be transposed")
            array = _apply_array(array, op)
        return array


def _map_bytes(path: str, offset: int, nbytes: int, populate: bool = True) -> np.ndarray:
    """A read-only uint8 view of ``nbytes`` at ``offset`` in ``path``, memory-mapped.

    With ``populate`` the pages are mapped in when the map is made (MAP_POPULATE, where the OS
    has it): callers read every byte they map, and for one reading thread one populate is much
    cheaper than faulting. A parallel reader (the Numba kernels) does better faulting them in
    from its threads: a compile ran 10-15% faster so. The map lives as long as the returned
    array; no descriptor outlives this call.
    """
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    length = offset + nbytes - start
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    fd = os.open(path, os.O_RDONLY)  # not open(): no buffered file object for one map
    try:
        mapped = mmap.mmap(fd, length, flags=flags, prot=mmap.PROT_READ, offset=start)
    finally:
        os.close(fd)
    array = np.frombuffer(mapped, dtype=np.uint8, count=nbytes, offset=offset - start)
    array.flags.writeable = False  # the pages are mapped read-only
    return array


# --------------------------------------------------------------------------------------------
# Model configuration


class Gating(str, enum.Enum):
    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"
    # A router ktc's MoE layer does not compute (PhiMoE's sparsemixer, ERNIE-4.5's softmax with
    # a selection bias): planned and compiled, run through transformers' own routing only.
    OTHER = "other"


class Attention(str, enum.Enum):
    GQA = "gqa"  # multi-head and grouped-query attention: K and V cached per KV head
    MLA = "mla"  # DeepSeek's multi-head latent attention: one compressed latent cached


@dataclass(frozen=True)
class ModelConfig:
    """The model facts ktc needs, read from ``config.json`` or GGUF metadata."""

    architecture: str  # as the checkpoint names it: "MixtralForCausalLM", "deepseek2", ...
    model_type: str  # "mixtral", "qwen3_moe", ... or the GGUF architecture
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_experts: int
    top_k: int
    num_shared_experts: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    dense_intermediate_size: int = 0
    first_dense_layers: int = 0  # DeepSeek's first_k_dense_replace
    moe_layer_step: int = 1  # Qwen's decoder_sparse_step: every step-th layer is MoE
    dense_layers: tuple[int, ...] = ()  # Qwen's mlp_only_layers
    gating: Gating = Gating.SOFTMAX
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    num_expert_groups: int = 1
    topk_groups: int = 1
    attention: Attention = Attention.GQA
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    tie_word_embeddings: bool = False
    swiglu_limit: float | None = None  # gpt-oss clamps its SwiGLU
    swiglu_alpha: float | None = None
    torch_dtype: str | None = None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has routed experts, by the config alone."""
        if layer < self.first_dense_layers or layer in self.dense_layers:
            return False
        return self.num_experts > 0 and (layer + 1) % max(self.moe_layer_step, 1) == 0

    def kv_bytes_per_token(self, element_bytes: int = 2) -> int:
        """KV-cache bytes per token over all layers at ``element_bytes`` per value.

        GQA/MHA: 2 (K and V) x layers x kv heads x head dim. MLA caches one latent of
        ``kv_lora_rank`` plus the shared rope key of ``qk_rope_head_dim`` per layer.
        """
        if self.attention is Attention.MLA:
            return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * element_bytes
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_bytes


# --------------------------------------------------------------------------------------------
# Experts and layers


class GateUpLayout(str, enum.Enum):
    """How gate and up projections are stored when they come fused in one tensor."""

    SEPARATE = "separate"  # two tensors
    CONCATENATED = "concatenated"  # [gate; up] along the output axis (transformers' fused experts)
    INTERLEAVED = "interleaved"  # gate, up, gate, up, ... along the output axis (gpt-oss)


class Activation(str, enum.Enum):
    SILU = "silu"  # down(silu(gate x) * up x)
    SWIGLU_CLAMPED = "swiglu_clamped"  # gpt-oss: clamped gate and up, x*sigmoid(alpha x)*(up+1)


@dataclass(frozen=True)
class Expert:
    """One feed-forward expert: ``down(act(gate x) * up x)``, weights as [out, in]."""

    layer: int
    index: int
    gate: TensorRef
    up: TensorRef
    down: TensorRef
    gate_bias: TensorRef | None = None
    up_bias: TensorRef | None = None
    down_bias: TensorRef | None = None
    source_layout: GateUpLayout = GateUpLayout.SEPARATE

    @property
    def tensors(self) -> tuple[TensorRef, ...]:
        return tuple(t for t in (self.gate, self.up, self.down, self.gate_bias, self.up_bias,
                                 self.down_bias) if t is not None)

    @property
    def nbytes(self) -> int:
        """Bytes of this expert at its source types (weights, biases and scales)."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def intermediate_size(self) -> int:
        return self.gate.shape[0]


@dataclass(frozen=True)
class MoELayer:
    """The routed-expert block of one decoder layer."""

    layer: int
    router: TensorRef
    experts: tuple[Expert, ...]
    top_k: int
    gating: Gating
    norm_topk_prob: bool
    activation: Activation = Activation.SILU
    router_bias: TensorRef | None = None  # gpt-oss router bias (added before top-k)
    score_correction_bias: TensorRef | None = None  # DeepSeek-V3 e_score_correction_bias
    shared_experts: tuple[Expert, ...] = ()
    shared_expert_gate: TensorRef | None = None  # Qwen2-MoE sigmoid gate of the shared expert
    routed_scaling_factor: float = 1.0
    num_groups: int = 1
    topk_groups: int = 1


class TensorRole(str, enum.Enum):
    """What a non-expert tensor is for; the planner counts bytes by role."""

    ATTENTION = "attention"
    EMBEDDING = "embeddings"  # token embeddings and lm_head
    NORM = "norm"
    ROUTER = "router"
    SHARED_EXPERT = "shared_experts"
    DENSE_MLP = "dense_mlp"
    OTHER = "other"


# Names of input embedding tables (transformers', llama.cpp's, GPT-2's): a token reads one row of
# one, unlike ``lm_head``, which the same role covers and every token reads whole.
INPUT_EMBEDDINGS = ("embed_tokens", "token_embd", "wte")


def is_input_embedding(name: str) -> bool:
    return any(k in name for k in INPUT_EMBEDDINGS)


@dataclass(frozen=True)
class DenseTensor:
    """A tensor that is not part of a routed expert, with its role and layer (None if global)."""

    ref: TensorRef
    role: TensorRole
    layer: int | None = None


class Device(str, enum.Enum):
    GPU = "gpu"
    CPU = "cpu"
    DISK = "disk"  # computed on the CPU, read from the bundle's map without a place in the RAM budget


@dataclass(frozen=True)
class ExpertPlacement:
    """Where one routed expert lives and in which scheme it is stored there."""

    device: Device
    scheme: str


@dataclass(frozen=True)
class Placement:
    """The planner's decision: ``experts[i][e]`` places expert e of MoE layer ``layers[i]``."""

    layers: tuple[int, ...]
    experts: tuple[tuple[ExpertPlacement, ...], ...]

    def of(self, layer: int, expert: int) -> ExpertPlacement:
        return self.experts[self.layers.index(layer)][expert]

    def gpu_experts_per_layer(self) -> tuple[int, ...]:
        return tuple(sum(p.device is Device.GPU for p in row) for row in self.experts)


@dataclass(frozen=True)
class QuantPlan:
    """The scheme of every tensor the bundle stores: ``experts[i][e]`` for expert e of MoE layer
    ``layers[i]`` (gate, up and down share it; biases stay float32), ``tensors`` for the
    non-expert tensors by name."""

    layers: tuple[int, ...]
    experts: tuple[tuple[str, ...], ...]
    tensors: tuple[tuple[str, str], ...]
    dense_scheme: str


@dataclass(frozen=True)
class SourceInfo:
    """Where the IR was read from."""

    format: str  # "safetensors", "pytorch" or "gguf"
    path: str
    files: tuple[str, ...]
    total_bytes: int  # bytes of the files (headers included)


@dataclass(frozen=True)
class ModelIR:
    """A whole model: its config, its MoE layers and everything else.

    ``placement``, ``quant`` and ``layout`` are the results of later passes, None until run.
    """

    family: str
    config: ModelConfig
    source: SourceInfo
    moe_layers: tuple[MoELayer, ...] = ()
    dense: tuple[DenseTensor, ...] = ()
    placement: Placement | None = field(default=None, compare=False)
    quant: QuantPlan | None = field(default=None, compare=False)
    layout: object | None = field(default=None, compare=False)

    @property
    def moe_layer_indices(self) -> tuple[int, ...]:
        return tuple(layer.layer for layer in self.moe_layers)

    def layer(self, index: int) -> MoELayer:
        for layer in self.moe_layers:
            if layer.layer == index:
                return layer
        raise KeyError(f"layer {index} has no experts; MoE layers: {self.moe_layer_indices}")
