"""Quantization schemes of the bundle: how many bytes a weight matrix takes in each, and how an
expert is laid out. The planner sizes experts with ``expert_footprint`` and the compiler lays
them out with the same function, so a plan's byte counts are the bundle's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

# Alignment of every tensor inside an expert, and of every expert's start (a page).
TENSOR_ALIGN = 64
EXPERT_ALIGN = 4096


@dataclass(frozen=True)
class Scheme:
    """A storage scheme for a 2-D weight [rows, cols]: one registered object per scheme.

    Layout: each row is ``cols / block_elems`` blocks of ``block_bytes`` bytes (scales inside
    the blocks, as ggml does), plus ``row_extra_bytes`` per row (a per-row scale). Codec:
    ``quantize(values, out)`` (float32 [rows, cols] -> uint8 [rows, row_bytes], into ``out``
    when given; None where the scheme only passes through) and ``dequantize(raw, cols)`` (the
    reference decoder). ``error``: nominal relative RMS error on Gaussian weights, which the
    planner weighs. ``sources``: source storage types whose bytes are this scheme's, passed
    through unchanged. ``half_scales`` / ``e8m0_scales``: byte offsets in a block of its fp16
    / e8m0 scales (a block's values are finite when they are). ``devices``: where the runtime
    runs it (``"cpu"``, ``"gpu"``); the runtime's kernel tables are keyed by ``name`` and a
    test checks they agree.
    """

    name: str
    bits: float  # nominal bits per weight, for people
    block_elems: int
    block_bytes: int
    dequantize: Callable[[np.ndarray, int], np.ndarray] = field(compare=False, repr=False)
    quantize: Callable[..., np.ndarray] | None = field(default=None, compare=False, repr=False)
    error: float = 0.1
    row_extra_bytes: int = 0
    gguf_type: str | None = None  # byte-compatible ggml type, when there is one
    sources: tuple[str, ...] = ()
    # Source types stored with a separate scale tensor that convert to this scheme exactly
    # (FP8 with block scales, gpt-oss's MXFP4 blocks): ``from_scaled(ref, start, stop, finite)``
    # gives rows start:stop of such a tensor in this scheme.
    scaled_sources: tuple[str, ...] = ()
    from_scaled: Callable[..., np.ndarray] | None = field(default=None, compare=False, repr=False)
    half_scales: tuple[int, ...] = ()
    e8m0_scales: tuple[int, ...] = ()
    devices: frozenset[str] = frozenset({"cpu", "gpu"})
    description: str = ""

    def __post_init__(self) -> None:
        if self.block_elems <= 0 or self.block_bytes <= 0 or self.row_extra_bytes < 0:
            raise ValueError(f"scheme {self.name}: block sizes must be positive")

    def fits(self, cols: int) -> bool:
        return cols % self.block_elems == 0

    def matrix_bytes(self, rows: int, cols: int) -> int:
        """Bytes of a [rows, cols] matrix; ``ValueError`` if a row is not whole blocks."""
        if not self.fits(cols):
            raise ValueError(f"scheme {self.name} needs rows that are a multiple of "
                             f"{self.block_elems} values; this row has {cols}")
        return rows * (cols // self.block_elems * self.block_bytes + self.row_extra_bytes)

    @property
    def plain(self) -> bool:
        """One stored value per weight (f32, f16, bf16): no blocks, no scales."""
        return self.block_elems == 1 and not self.row_extra_bytes


# Every scheme, in order of bits per weight (most first). The codec modules imported at the end
# of this file fill it through ``register``.
SCHEMES: dict[str, Scheme] = {}
# Short names people type.
ALIASES = {"int4": "int4_g128", "fp16": "f16", "fp32": "f32", "float16": "f16", "bfloat16": "bf16"}


def register(*schemes: Scheme) -> None:
    """Add schemes to the registry (a name registered twice is a programming error)."""
    for scheme in schemes:
        if scheme.name in SCHEMES or scheme.name in ALIASES:
            raise ValueError(f"scheme {scheme.name} registered twice")
        SCHEMES[scheme.name] = scheme
    ordered = sorted(SCHEMES.values(), key=lambda s: (-s.bits, s.name))
    SCHEMES.clear()
    SCHEMES.update((s.name, s) for s in ordered)


def get_scheme(name: str) -> Scheme:
    """The scheme called ``name`` (or an alias); ``KeyError`` lists the known ones."""
    key = ALIASES.get(name.lower(), name.lower())
    try:
        return SCHEMES[key]
    except KeyError:
        raise KeyError(f"unknown scheme {name!r}; known: {', '.join(SCHEMES)} "
                       f"(aliases: {', '.join(ALIASES)})") from None


def expert_schemes(name: str) -> tuple[Scheme, Scheme]:
    """The (gate/up, down) schemes of an expert scheme: one scheme for all three matrices
    (``q4_k``), or ``A+B``: gate and up in A, down in B, as llama.cpp's Q4_K_M and Q3_K_M store
    many layers' ``ffn_down`` at more bits. ``KeyError`` for an unknown name."""
    first, plus, second = name.partition("+")
    gate_up = get_scheme(first)
    down = get_scheme(second) if plus else gate_up
    return gate_up, down


def expert_scheme_name(name: str) -> str:
    """The canonical name of an expert scheme (``int4`` -> ``int4_g128``; ``q4_k+q4_k`` -> ``q4_k``)."""
    gate_up, down = expert_schemes(name)
    return gate_up.name if gate_up is down else f"{gate_up.name}+{down.name}"


def expert_scheme_error(name: str) -> float:
    """Nominal error of an expert scheme: its matrices' errors weighted by their share of the
    weights (gate and up two thirds, down one third)."""
    gate_up, down = expert_schemes(name)
    return (2 * gate_up.error + down.error) / 3


def source_scheme(dtype: str, *, scaled: bool = False) -> Scheme | None:
    """The scheme whose bytes a source tensor stored as ``dtype`` already is (passed through);
    with ``scaled``, for a tensor with a separate scale tensor (converted exactly)."""
    return next((s for s in SCHEMES.values() if dtype in (s.scaled_sources if scaled else s.sources)), None)


def align(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class ExpertShape:
    """What sizes an expert: hidden size, intermediate size, whether it has biases."""

    hidden: int
    intermediate: int
    biases: bool = False


@dataclass(frozen=True)
class ExpertFootprint:
    """An expert's size in one scheme: ``data_bytes`` read per use, ``stored_bytes`` it occupies
    in a bundle segment (tensors aligned to 64, the expert padded to a 4096-byte page)."""

    data_bytes: int
    stored_bytes: int


def expert_tensor_bytes(shape: ExpertShape, scheme: Scheme | str) -> tuple[tuple[str, int], ...]:
    """(name, bytes) of the tensors an expert is stored as: gate and up fused, then down, then
    float32 biases. The compiler writes them in this order. ``scheme``: a scheme, or an expert
    scheme name (``expert_schemes``)."""
    gate_up, down = (scheme, scheme) if isinstance(scheme, Scheme) else expert_schemes(scheme)
    tensors = [("gate_up", gate_up.matrix_bytes(2 * shape.intermediate, shape.hidden)),
               ("down", down.matrix_bytes(shape.hidden, shape.intermediate))]
    if shape.biases:
        tensors += [("gate_up_bias", 4 * 2 * shape.intermediate), ("down_bias", 4 * shape.hidden)]
    return tuple(tensors)


def expert_footprint(shape: ExpertShape, scheme: Scheme | str) -> ExpertFootprint:
    """Bytes of one expert stored in ``scheme`` (a scheme or an expert scheme name; see
    ``ExpertFootprint``)."""
    tensors = expert_tensor_bytes(shape, scheme)
    data = sum(n for _, n in tensors)
    packed = sum(align(n, TENSOR_ALIGN) for _, n in tensors)
    return ExpertFootprint(data, align(packed, EXPERT_ALIGN))


def dense_tensor_bytes(numel: int, scheme: Scheme | str = "bf16") -> int:
    """Bytes of a non-expert tensor of ``numel`` values stored in a plain ``scheme``, aligned."""
    if isinstance(scheme, str):
        scheme = get_scheme(scheme)
    if not scheme.plain:
        raise ValueError("a tensor given by its element count is stored in a plain float scheme")
    return align(numel * scheme.block_bytes, TENSOR_ALIGN)


# A quantized --dense-scheme stores a matrix whose rows are not whole blocks in this instead (as
# llama.cpp falls back to another type for tensors whose rows do not fit a block type).
DENSE_FALLBACK = "bf16"
# --dense-scheme auto: each non-expert matrix keeps the source's own block scheme (a Q4_K_M GGUF's
# attention stays Q4_K/Q6_K, byte for byte), and float ones are stored in DENSE_FALLBACK.
DENSE_AUTO = "auto"


def dense_scheme_name(name: str) -> str:
    """``auto`` or a scheme's canonical name (``KeyError`` for an unknown one)."""
    return DENSE_AUTO if name.lower() == DENSE_AUTO else get_scheme(name).name


def non_expert_scheme(shape: tuple[int, ...], *, router: bool, dense_scheme: str,
                      source_dtype: str | None = None) -> str:
    """The scheme a non-expert tensor is stored in: float32 for 1-D tensors (norms, biases) and
    for routers, whose scores pick the experts and are cheap to keep exact; ``dense_scheme`` for
    every other matrix (``[rows, everything else]``), or ``DENSE_FALLBACK`` where its rows are not
    whole blocks of a block scheme. With ``auto``, a 2-D matrix stored in a block scheme
    (``source_dtype``) keeps it."""
    if router or len(shape) <= 1:
        return "f32"
    cols = math.prod(shape[1:])
    if dense_scheme == DENSE_AUTO:
        own = (source_scheme(source_dtype) or source_scheme(source_dtype, scaled=True)) if source_dtype else None
        keep = own is not None and not own.plain and len(shape) == 2 and own.fits(cols)
        return own.name if keep and own is not None else DENSE_FALLBACK
    scheme = get_scheme(dense_scheme)
    return scheme.name if scheme.fits(cols) else DENSE_FALLBACK


def non_expert_bytes(shape: tuple[int, ...], *, router: bool, dense_scheme: str,
                     source_dtype: str | None = None) -> int:
    """Bytes a non-expert tensor occupies in a bundle (rounded up to the tensor alignment)."""
    scheme = get_scheme(non_expert_scheme(shape, router=router, dense_scheme=dense_scheme,
                                          source_dtype=source_dtype))
    if len(shape) <= 1 or scheme.plain:
        return dense_tensor_bytes(math.prod(shape), scheme)
    return align(scheme.matrix_bytes(shape[0], math.prod(shape[1:])), TENSOR_ALIGN)


# The codecs, each registering its schemes (imported last: they import this module).
from . import codec_float, codec_fp8, codec_ggml, codec_int, codec_kquants  # noqa: E402,F401
