"""Quantization schemes of the bundle: how many bytes a weight matrix takes in each, and how an
expert is laid out. The planner sizes experts with ``expert_footprint`` and the compiler lays
them out with the same function, so a plan's byte counts are the bundle's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The codecs, each adding its schemes to ``SCHEMES`` as it is imported.
from . import codec_float, codec_fp8, codec_ggml, codec_int, codec_kquants  # noqa: F401
from .scheme import ALIASES, SCHEMES, Scheme

# Alignment of every tensor inside an expert, and of every expert's start (a page).
TENSOR_ALIGN = 64
EXPERT_ALIGN = 4096


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

