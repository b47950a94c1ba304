"""Many tokens times one matrix with the tokens in the vector lanes (prefill), in int8 through
AVX-512 VNNI.

The row kernels of ``vnni`` and ``kquants`` put a row's values in the lanes of a 512-bit vector:
every block of 32 values takes a conversion and two multiply-adds per token for its lanes of
``vpdpbusd`` sums, and that float work, not the integer products, bounds them at about a
quarter of the CPU's int8 rate. Here 16 tokens share a vector instead: their activations,
quantized to int8 per 256 values where the rows are whole 256s (``token_span``; else per 32, or
per int4 group), are laid out four values of each token a 32-bit lane
(``_activations``), and each ``vpdpbusd`` multiplies them by four codes of one row broadcast to
every lane; a block of 32 values is 8 such products into one int32 sum per token, then one
conversion and one multiply-add for its 16 tokens. The codes are unpacked to bytes a chunk of
rows at a time (``chunk_rows``; ``_unpack_intrinsic``, ``_superblock_intrinsic``: vector code; the
scales beside them), kept in the cache while every token goes over them, and the next chunk's
bytes are prefetched meanwhile. ``vpdpbusd`` multiplies unsigned bytes by signed ones: the
codes are stored unsigned (plus their kind's offset), and the offset times each block's sum of
activations is where the int32 sums start. q4_k's and q5_k's minimums (and int4_g32's, as
int16, from ``PAIRED_INT4_TOKENS`` tokens on) go in once a super-block by ``vpdpwssd``, int4's
others add one multiply-add a span; q6_k's 16-value scales split a block's sums in two. Where one weight
scale covers several blocks (int4's groups of 64 and 128 values, int8's rows: ``span``) the
activations are quantized per span and the integer sums run over it before its one conversion.
``kernels.in_place`` sends a matrix here from ``kernels.LANES_MIN_TOKENS`` tokens on.

Measured against the tiles of ``vnni.matmul_blocks``, ``kquants.matmul_k`` and torch's bf16
``F.linear`` in ``benchmarks/expert_kernels.py`` (part 3) and ``docs/runtime.md``.
"""
from __future__ import annotations

import contextlib
import threading

import numpy as np
from numba import get_num_threads, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ktc.formats.float_bits import bf16_value
from ktc.formats.kernel_args import read_only, writable

from . import interleave, vnni

_SCRATCH = threading.local()  # ``scratch``'s arrays, per thread
SCRATCH_KEEP_BYTES = 256 << 20  # larger ones are not kept (``scratch``)

LANE_TOKENS = 16  # tokens a vector: 16 int32 lanes of a 512-bit register
# Rows x groups of 16 tokens a call of the tile. Measured at Mixtral's 14336 x 4096 with 64
# tokens (q4_0), in-process and interleaved (medians of 7-9, two threads, GOP/s, torch bf16
# 420-690 in the same runs): 8 x 1 660-710, 4 x 1 630-715, 16 x 1 590, 2 x 2 690-710, 4 x 2
# 940-1180, 8 x 2 700-1120, 4 x 3 940-1090, 2 x 4 795, 4 x 4 390-770; the activations read
# from memory by each product instead of held in registers (4 x 4, 8 x 4, 8 x 2) 610-820.
# Splitting the columns so that a tile's activations stay in L1 did not help.
TILE_ROWS, TILE_GROUPS = 4, 2
_ACTIVATED_GROUPS = 16  # groups of 16 tokens an item of ``_activated`` at most
# Rows unpacked at a time (``chunk_rows``): at 64 tokens with an earlier tile 16 rows made 960
# GOP/s, 32 870, 64 775; with the tiles since (super-block activations, spans in a loop), 48 were
# faster from 48 tokens on (``chunk_rows``).
CHUNK_ROWS, WIDE_CHUNK_ROWS = 16, 48
# Rows (or slices of rows: ``SLICE_MIN_TOKENS``) up to this long take tiles of three groups of 16
# tokens where three fit (``_matmul``; four groups go 2 + 2): at 256 tokens a Mixtral-shaped
# gate/up (28672 x 4096) q4_k 39.2-40.7 ms against 41.9-42.2, q6_k 41.0-41.7 against 42.4-43.0,
# int8 34.5-34.6 against 37.1-40.0; 14336 x 4096 at 48 tokens 4.16 against 4.53-4.78. Whole rows
# of 14336 values with three took 10% longer (three groups' activations of such rows and a
# chunk's codes no longer share L2): hence the slices.
TRIPLE_COLS = 4096
# From this many tokens on longer rows (whole 256s) go in slices of up to TRIPLE_COLS values, a
# chunk's tiles over one slice after another, and take tiles of three groups too (``_matmul``).
# Alternate processes, two or three rounds: 4096 x 14336 at 256 tokens q4_k 20.7-21.5 ms against
# 22.5-23.1, q6_k 21.4-21.8 against 22.9-23.5, int4_g64 21.4-22.0 against 23.7-23.9, q4_0
# 19.2-19.5 against 20.6-22.6; at 128 q4_k 10.5-10.8 against 11.5-12.7, at 48 q4_0 4.0 against
# 4.6 (q4_k 5.0-5.3 against 4.9-5.0); DeepSeek-V3-shaped 4096 x 7168 at 256 q4_k 10.2-10.5
# against 10.6-11.2. At 32 tokens (two groups, 16-row chunks) slices were 0-8% slower.
SLICE_MIN_TOKENS = 33
PAIRED_INT4_TOKENS = 128  # int4_g32's minimums integers from this many tokens on (``_paired``)

# The schemes, their kind codes here, and the offset that makes their codes unsigned.
KINDS = {"q8_0": 1, "q4_0": 2, "mxfp4": 3, "iq4_nl": 4, "q4_k": 5, "q5_k": 6, "q6_k": 7, "iq4_xs": 8,
         "int4_g32": 9, "int4_g64": 10, "int4_g128": 11, "int8": 13}
_OFFSET = (0, 128, 8, 12, 128, 0, 0, 32, 128, 0, 0, 0, 0, 128)
# Per kind: bytes of a block (or super-block), values it holds, and where the block kinds'
# codes start. int4's rows are not blocks (all codes, then all scales, then all minimums): its
# size is that of a group's codes, its values the group's. fp8_e4m3 (``_FP8``) is AMX's alone
# (``amx.KINDS``): its values are no integers for ``vpdpbusd``. int8's rows (``_INT8``) are their
# codes and one float32 scale: a block here is 32 of its codes.
_SIZE = (0, 34, 18, 17, 18, 144, 176, 210, 136, 16, 32, 64, 132, 32)
_VALUES = (0, 32, 32, 32, 32, 256, 256, 256, 256, 32, 64, 128, 128, 32)
_CODES_AT = (0, 2, 2, 1, 2, 0, 0, 0, 0, 0, 0, 0, 4, 0)
_FP8 = 12
_INT8 = 13
_HALVES = 7  # q6_k: 16-value scales, two a block
_KQUANT_FIRST = 5  # q4_k to int4_g32: their tokens' scales 256 values (``token_span``)
_INT4 = 9  # kinds from here on: int4_g32, g64, g128
_INT4_G64 = 10


@njit(cache=True, nogil=True)
def span(kind, blocks):  # pragma: no cover - compiled
    """Blocks of 32 values that share one activation scale in a row of ``blocks`` blocks of
    ``kind``: where one weight scale covers several blocks (int4's groups of 64 and 128 values,
    int8's whole rows) the tile sums their integer products before its one conversion and
    multiply-add, and the activations are quantized per span to match (int8: per 256 values, as
    llama.cpp's q8_K, where the row is whole 256s). Else 1: a scale per block of 32 (the tiles
    are compiled for these spans alone)."""
    if kind == _INT8:
        return 8 if blocks % 8 == 0 else 1
    if _INT4 <= kind < _FP8:
        return _VALUES[kind] // 32
    return 1


@njit(cache=True, nogil=True)
def token_span(kind, blocks):  # pragma: no cover - compiled
    """Blocks of 32 values that share one activation scale (a multiple of ``span``): 256 values
    for the K-quants (q4_k, q5_k, q6_k) and iq4_xs, a super-block, as llama.cpp's q8_K (and
    ktc's one-token K-quant kernels) quantize them, and for int4_g32 where its rows are whole
    256s, though their rows' scales are a block's (or a half block's): the tile multiplies each
    block's sums by the row's scale and a super-block's by the tokens' (``_tile_intrinsic``'s
    ``shared``; 14336 x 4096 at 256 tokens: iq4_xs 22.2 against 22.9 ms, int4_g32 24.7 against
    25.4, and 6.3 against 6.9 at 64). The block kinds (q8_0, q4_0, mxfp4, iq4_nl) too, where their
    one-token kernels take llama.cpp's q8_0 activations, per 32: one multiply-add a block and row
    instead of a multiply and a multiply-add (alternate processes, three rounds, 256 tokens:
    28672 x 4096 q4_0 37.2-38.9 ms against 41.4-42.4, q8_0 37.4-38.3 against 41.8-43.0; 4096 x
    14336 q4_0 20.0-20.9 against 21.4-22.4), at a cost in accuracy the demo model's text does
    not show (``docs/runtime.md``). And int4_g64, whose spans of two blocks then go four a token
    scale (``_tile_intrinsic``'s ``span`` 2 and ``shared`` 4: a conversion and two multiply-adds a
    span instead of a conversion, a multiply and two multiply-adds; 28672 x 4096 at 256 tokens
    35.8-37.1 ms against 38.4-39.2, 4096 x 14336 17.9-19.3 against 19.7-19.9). int4_g128 keeps
    its own, per group (a multiply a span of four blocks is little to save). Else ``span``."""
    if (kind <= 4 or _KQUANT_FIRST <= kind <= _INT4_G64) and blocks % 8 == 0:
        return 8
    return span(kind, blocks)


@njit(cache=True, nogil=True)
def _paired(kind, blocks, n):  # pragma: no cover - compiled
    """Whether n tokens times rows of ``blocks`` blocks of ``kind`` take ``_tile_intrinsic``'s
    ``pairs`` tiles (and the tokens' code sums their layout): q4_k and q5_k in super-blocks, and
    int4_g32 where its rows are whole 256s from ``PAIRED_INT4_TOKENS`` tokens on
    (``_int16_minimums``: converting its minimums costs each row about as much as the tiles save
    at 64 tokens; 14336 x 4096 at 32 tokens 3.49-3.50 ms against 3.18-3.21, at 128 21.7-21.8
    against 22.0-22.7 for 28672 x 4096, at 256 20.9-21.1 against 21.7-22.0)."""
    if token_span(kind, blocks) != 8:
        return False
    return kind == 5 or kind == 6 or (kind == _INT4 and n >= PAIRED_INT4_TOKENS)


@njit(cache=True, nogil=True, inline="always")
def has_minimums(kind):  # pragma: no cover - compiled
    """Whether a kind's blocks add a minimum to their scaled codes: q4_k, q5_k and int4."""
    return kind == 5 or kind == 6 or _INT4 <= kind < _FP8


def _unpack_intrinsic(kind: int):  # type: ignore[no-untyped-def]
    """``unpack(flat, at, w, wat, sc, p, e8m0)``: the block of ``kind`` (q8_0, q4_0, mxfp4,
    iq4_nl) at byte ``at`` of ``flat`` as 32 unsigned bytes at w[wat:wat + 32] (its values plus
    the kind's ``_OFFSET``) and its scale (float32) at sc[p]. In vectors: element by element,
    Numba's loops cost more than the products they feed at 32 tokens."""
    from llvmlite import ir

    codes_at = _CODES_AT[kind]
    i8, i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()

    @intrinsic
    def unpack(typingctx, flat, at, w, wat, sc, p, e8m0):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            flat_a, w_a, sc_a, e8m0_a = vnni._arrays(context, builder, signature, args, (0, 2, 4, 6))
            at_v, wat_v, p_v = vnni._indices(context, builder, signature, args, (1, 3, 5))
            load = _loader(builder)
            codes_i = builder.add(at_v, ir.Constant(at_v.type, codes_at))
            bytes32, bytes16 = ir.VectorType(i8, 32), ir.VectorType(i8, 16)
            if kind == 1:  # q8_0: the signed codes, their sign bits flipped
                values = builder.xor(load(flat_a, codes_i, bytes32), ir.Constant(bytes32, [0x80] * 32))
            else:
                halves = _nibbles(builder, load(flat_a, codes_i, bytes16))
                if kind != 2:  # e2m1 codes or iq4 levels -> unsigned integers, a table look-up a byte
                    halves = _looked_up(builder, vnni.E2M1_TWICE_PLUS_12 if kind == 3 else vnni.IQ4_PLUS_128, halves)
                values = _joined(builder, *halves)
            _store(builder, values, w_a, wat_v)
            if kind == 3:  # e8m0: a power of two from the table, halved for the doubled values
                exponent = builder.zext(load(flat_a, at_v, i8), i32)
                scale = builder.fmul(load(e8m0_a, exponent, f32, 4), ir.Constant(f32, 0.5))
            else:  # fp16, converted by the CPU (F16C)
                scale = _fp16(builder, load(flat_a, at_v, i16))
            builder.store(scale, builder.gep(sc_a.data, [p_v]))
            return context.get_dummy_value()

        return types.void(flat, at, w, wat, sc, p, e8m0), codegen

    return unpack


def _unpack4_intrinsic(kind: int):  # type: ignore[no-untyped-def]
    """``unpack4(flat, at, w, wat, sc, p, e8m0)``: ``_unpack_intrinsic``'s four blocks in a row
    (from byte ``at``; their 128 codes at w[wat:], their scales at sc[p:p + 4]) in 512-bit
    vectors: the four blocks' packed codes joined in one register, split, looked up and put back
    in order two 64-byte stores: q4_0's rows from L2 0.97 ns a block of 32 where a block a call
    took 1.55 (and 0.44 with the kind compiled in, ``_unpack_rows``)."""
    from llvmlite import ir

    codes_at, size = _CODES_AT[kind], _SIZE[kind]
    i8, i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
    bytes16, bytes32, bytes64 = ir.VectorType(i8, 16), ir.VectorType(i8, 32), ir.VectorType(i8, 64)

    def joined(builder, parts):  # type: ignore[no-untyped-def]
        # equal byte vectors as one, in order (pairwise concatenations)
        while len(parts) > 1:
            n = parts[0].type.count
            mask = ir.Constant(ir.VectorType(i32, 2 * n), list(range(2 * n)))
            parts = [builder.shuffle_vector(parts[k], parts[k + 1], mask) for k in range(0, len(parts), 2)]
        return parts[0]

    @intrinsic
    def unpack4(typingctx, flat, at, w, wat, sc, p, e8m0):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            flat_a, w_a, sc_a, e8m0_a = vnni._arrays(context, builder, signature, args, (0, 2, 4, 6))
            at_v, wat_v, p_v = vnni._indices(context, builder, signature, args, (1, 3, 5))
            load = _loader(builder)
            index_t = at_v.type

            def const(k):  # type: ignore[no-untyped-def]
                return ir.Constant(index_t, k)

            starts = [builder.add(at_v, const(size * k)) for k in range(4)]
            if kind == 1:  # q8_0: the signed codes, their sign bits flipped
                flip = ir.Constant(bytes64, [0x80] * 64)
                halves = [builder.xor(joined(builder, [load(flat_a, builder.add(starts[k], const(codes_at)),
                                                            bytes32) for k in pair]), flip)
                          for pair in ((0, 1), (2, 3))]
            else:
                packed = joined(builder, [load(flat_a, builder.add(start, const(codes_at)), bytes16)
                                          for start in starts])
                low, high = _nibbles(builder, packed)
                if kind != 2:  # e2m1 codes or iq4 levels -> unsigned integers, a table look-up a byte
                    table = ir.Constant(bytes64, list(vnni.E2M1_TWICE_PLUS_12 if kind == 3 else vnni.IQ4_PLUS_128) * 4)
                    shuffle = cgutils.get_or_insert_function(
                        builder.module, ir.FunctionType(bytes64, [bytes64] * 2), "llvm.x86.avx512.pshuf.b.512")
                    low, high = (builder.call(shuffle, [table, v]) for v in (low, high))
                # block k's low codes are bytes 16k..16k+15 of low, its high ones of high: in order
                # [low 0, high 0, low 1, high 1] and [low 2, high 2, low 3, high 3]
                halves = [builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(i32, 64), [
                    (64 if half else 0) + 16 * k + j for k in pair for half in (0, 1) for j in range(16)]))
                    for pair in ((0, 1), (2, 3))]
            for k, value in enumerate(halves):
                _store(builder, value, w_a, builder.add(wat_v, const(64 * k)))
            for k, start in enumerate(starts):
                if kind == 3:  # e8m0: a power of two from the table, halved for the doubled values
                    exponent = builder.zext(load(flat_a, start, i8), i32)
                    scale = builder.fmul(load(e8m0_a, exponent, f32, 4), ir.Constant(f32, 0.5))
                else:  # fp16, converted by the CPU (F16C)
                    scale = _fp16(builder, load(flat_a, start, i16))
                builder.store(scale, builder.gep(sc_a.data, [builder.add(p_v, const(k))]))
            return context.get_dummy_value()

        return types.void(flat, at, w, wat, sc, p, e8m0), codegen

    return unpack4


def _loader(builder):  # type: ignore[no-untyped-def]
    """``load(array, index, type, align=1)``: a value of ``type`` at array[index]."""
    def load(array, index, t, align=1):  # type: ignore[no-untyped-def]
        return builder.load(builder.bitcast(builder.gep(array.data, [index]), t.as_pointer()), align=align)

    return load


def _fp16(builder, bits):  # type: ignore[no-untyped-def]
    """An fp16 value's 16 bits (an i16) as float32, converted by the CPU (F16C)."""
    from llvmlite import ir

    return builder.fpext(builder.bitcast(bits, ir.HalfType()), ir.FloatType())


def _splat(builder, value, count):  # type: ignore[no-untyped-def]
    """A vector of ``count`` copies of the scalar ``value``."""
    from llvmlite import ir

    t = ir.VectorType(value.type, count)
    one = builder.insert_element(ir.Constant(t, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, ir.Constant(t, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), count),
                                                                                 [0] * count))


def _store(builder, value, array, index):  # type: ignore[no-untyped-def]
    builder.store(value, builder.bitcast(builder.gep(array.data, [index]), value.type.as_pointer()), align=1)


def _nibbles(builder, packed):  # type: ignore[no-untyped-def]
    """A byte vector's low and high 4 bits, as bytes."""
    from llvmlite import ir

    t = packed.type
    return (builder.and_(packed, ir.Constant(t, [15] * t.count)),
            builder.lshr(packed, ir.Constant(t, [4] * t.count)))


def _looked_up(builder, table, vectors):  # type: ignore[no-untyped-def]
    """16-byte vectors of 4-bit codes as ``table``'s 16 bytes (one ``pshufb`` each)."""
    from llvmlite import ir

    bytes16 = ir.VectorType(ir.IntType(8), 16)
    shuffle = cgutils.get_or_insert_function(builder.module, ir.FunctionType(bytes16, [bytes16] * 2),
                                             "llvm.x86.ssse3.pshuf.b.128")
    return tuple(builder.call(shuffle, [ir.Constant(bytes16, list(table)), v]) for v in vectors)


def _joined(builder, first, second):  # type: ignore[no-untyped-def]
    """Two 16-byte vectors as one of 32 bytes."""
    from llvmlite import ir

    return builder.shuffle_vector(first, second, ir.Constant(ir.VectorType(ir.IntType(32), 32), list(range(32))))


def _codes_intrinsic(body):  # type: ignore[no-untyped-def]
    """``codes(flat, at, w, wat)``: an intrinsic writing codes unpacked from flat[at:] to w[wat:],
    its code emitted by ``body(builder, load, flat, at, w, wat)`` (``_loader``'s load; the
    arrays' structures and the indices' values)."""

    @intrinsic
    def codes(typingctx, flat, at, w, wat):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            flat_a, w_a = vnni._arrays(context, builder, signature, args, (0, 2))
            at_v, wat_v = vnni._indices(context, builder, signature, args, (1, 3))
            body(builder, _loader(builder), flat_a, at_v, w_a, wat_v)
            return context.get_dummy_value()

        return types.void(flat, at, w, wat), codegen

    return codes


def _superblock_intrinsic(kind: int):  # type: ignore[no-untyped-def]
    """``codes(flat, at, w, wat)``: the 256 codes of the super-block of ``kind`` (q4_k, q5_k,
    q6_k, iq4_xs) at byte ``at`` of ``flat`` as unsigned bytes at w[wat:wat + 256], in order
    (q6_k's unsigned, before its minus 32; iq4_xs's levels plus 128), assembled from their bit
    planes 32 at a time."""
    from llvmlite import ir

    i8 = ir.IntType(8)
    bytes32 = ir.VectorType(i8, 32)

    def spread(value):  # type: ignore[no-untyped-def]
        return ir.Constant(bytes32, [value] * 32)

    def body(builder, load, flat_a, at_v, w_a, wat_v):  # type: ignore[no-untyped-def]
        def at(k):  # type: ignore[no-untyped-def]
            return builder.add(at_v, ir.Constant(at_v.type, k))

        def put(value, k):  # type: ignore[no-untyped-def]
            _store(builder, value, w_a, builder.add(wat_v, ir.Constant(wat_v.type, k)))

        if kind in (5, 6):  # q4_k, q5_k: sub-block j is the low (j even) or high nibbles of 32 bytes
            first = 16 if kind == 5 else 48
            high_bits = load(flat_a, at(16), bytes32) if kind == 6 else None
            for i in range(4):
                for j, nibbles in zip((2 * i, 2 * i + 1), _nibbles(builder, load(flat_a, at(first + 32 * i),
                                                                                  bytes32))):
                    if high_bits is not None:  # q5_k: bit j of qh[l] is value l's fifth
                        fifth = builder.and_(builder.lshr(high_bits, spread(j)), spread(1))
                        nibbles = builder.or_(nibbles, builder.shl(fifth, spread(4)))
                    put(nibbles, 32 * j)
        elif kind == 8:  # iq4_xs: sub-block j's 16 bytes at 8 + 16 j, low nibbles then high, as iq4_nl's
            for j in range(8):
                halves = _nibbles(builder, load(flat_a, at(8 + 16 * j), ir.VectorType(i8, 16)))
                put(_joined(builder, *_looked_up(builder, vnni.IQ4_PLUS_128, halves)), 32 * j)
        else:  # q6_k: value 128 n + 32 s + l: ql[64 n + 32 (s % 2) + l] >> 4 (s // 2), qh[32 n + l] >> 2 s
            for n in range(2):
                high = load(flat_a, at(128 + 32 * n), bytes32)
                for s in range(4):
                    low = load(flat_a, at(64 * n + 32 * (s % 2)), bytes32)
                    low = builder.and_(builder.lshr(low, spread(4 * (s // 2))), spread(15))
                    top = builder.and_(builder.lshr(high, spread(2 * s)), spread(3))
                    put(builder.or_(low, builder.shl(top, spread(4))), 128 * n + 32 * s)

    return _codes_intrinsic(body)


def _int4_codes_intrinsic(group: int):  # type: ignore[no-untyped-def]
    """``codes(flat, at, w, wat)``: the ``group`` codes of one int4 group at byte ``at`` of
    ``flat`` (byte k: value k in its low nibble, value k + group / 2 in its high) as unsigned
    bytes at w[wat:wat + group], in order."""
    from llvmlite import ir

    i8 = ir.IntType(8)
    width = min(group // 2, 32)  # bytes a load: 16 for 32-value groups, else 32

    def body(builder, load, flat_a, at_v, w_a, wat_v):  # type: ignore[no-untyped-def]
        for k in range(0, group // 2, width):
            low, high = _nibbles(builder, load(flat_a, builder.add(at_v, ir.Constant(at_v.type, k)),
                                               ir.VectorType(i8, width)))
            if width == 16:  # a 32-value group: both halves one 32-byte store
                _store(builder, _joined(builder, low, high), w_a, wat_v)
                continue
            for value, first in ((low, k), (high, group // 2 + k)):
                _store(builder, value, w_a, builder.add(wat_v, ir.Constant(wat_v.type, first)))

    return _codes_intrinsic(body)


def _int8_codes_intrinsic():  # type: ignore[no-untyped-def]
    """``codes(flat, at, w, wat)``: 32 int8 codes at byte ``at`` of ``flat`` as unsigned bytes
    (their sign bits flipped: plus 128) at w[wat:wat + 32], in one vector."""
    from llvmlite import ir

    bytes32 = ir.VectorType(ir.IntType(8), 32)

    def body(builder, load, flat_a, at_v, w_a, wat_v):  # type: ignore[no-untyped-def]
        _store(builder, builder.xor(load(flat_a, at_v, bytes32), ir.Constant(bytes32, [128] * 32)), w_a, wat_v)

    return _codes_intrinsic(body)


def _int4_codes128_intrinsic(group: int):  # type: ignore[no-untyped-def]
    """``codes(flat, at, w, wat)``: 128 values of int4 groups of ``group`` (four groups of 32, two
    of 64 or one of 128) from the 64 bytes at byte ``at`` of ``flat`` as unsigned bytes at
    w[wat:wat + 128], in order: one 512-bit load, its nibbles, two 64-byte stores. int4_g32's
    rows, from L2, with their scales: 1.33 ns a group a call, 1.17 this way, 0.37 with the scales
    16 a vector too (``_bf16x16``)."""
    from llvmlite import ir

    i8, i32 = ir.IntType(8), ir.IntType(32)
    bytes64 = ir.VectorType(i8, 64)
    unit = group // 2  # a group's bytes: its low nibbles are its first half, its high ones the rest
    order = [(64 if half else 0) + k * unit + j for k in range(64 // unit) for half in (0, 1) for j in range(unit)]

    def body(builder, load, flat_a, at_v, w_a, wat_v):  # type: ignore[no-untyped-def]
        low, high = _nibbles(builder, load(flat_a, at_v, bytes64))
        for k in range(2):
            value = builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(i32, 64), order[64 * k:64 * k + 64]))
            _store(builder, value, w_a, builder.add(wat_v, ir.Constant(wat_v.type, 64 * k)))

    return _codes_intrinsic(body)


@intrinsic
def _bf16x16(typingctx, flat, at, out, oat):  # type: ignore[no-untyped-def]
    """16 bf16 values at byte ``at`` of the bytes ``flat`` as float32 at out[oat:oat + 16], in
    one vector (int4's scales and minimums: a value at a time they took most of its rows'
    unpacking, ``_int4_codes128_intrinsic``)."""
    from llvmlite import ir

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        flat_a, out_a = vnni._arrays(context, builder, signature, args, (0, 2))
        at_v, oat_v = vnni._indices(context, builder, signature, args, (1, 3))
        i32 = ir.IntType(32)
        bits = builder.zext(_loader(builder)(flat_a, at_v, ir.VectorType(ir.IntType(16), 16)), ir.VectorType(i32, 16))
        value = builder.bitcast(builder.shl(bits, ir.Constant(ir.VectorType(i32, 16), [16] * 16)),
                                ir.VectorType(ir.FloatType(), 16))
        builder.store(value, builder.bitcast(builder.gep(out_a.data, [oat_v]), value.type.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(flat, at, out, oat), codegen


def _code_sum_intrinsic(count: int):  # type: ignore[no-untyped-def]
    """``code_sum(codes, at)``: the sum of the ``count`` int8 values at codes[at:at + count], in
    a vector (``_activations``: a loop a value at a time over each block took the quantization of
    64 tokens of 2048 values from 38 to 85 us once the block kinds' tokens went per 256 values)."""
    from llvmlite import ir

    @intrinsic
    def code_sum(typingctx, codes, at):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            (codes_a,) = vnni._arrays(context, builder, signature, args, (0,))
            (at_v,) = vnni._indices(context, builder, signature, args, (1,))
            words = ir.VectorType(ir.IntType(32), count)
            values = builder.sext(_loader(builder)(codes_a, at_v, ir.VectorType(ir.IntType(8), count)), words)
            total = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), [words]),
                                                   f"llvm.vector.reduce.add.v{count}i32")
            return builder.call(total, [values])

        return types.int32(codes, at), codegen

    return code_sum


_code_sum16, _code_sum32 = _code_sum_intrinsic(16), _code_sum_intrinsic(32)


@intrinsic
def _packed16(typingctx, codes, at, stride, out, oat):  # type: ignore[no-untyped-def]
    """16 tokens' int8 codes of four values (int32 at codes.flat[at + k * stride + lane], k = 0 to
    3) as the tiles' words at out[oat:oat + 16], a byte a value, in vectors: ``_activated`` packed
    them a word at a time (scalar code, a third of its time for q4_0 at 256 tokens)."""
    from llvmlite import ir

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        codes_a, out_a = vnni._arrays(context, builder, signature, args, (0, 3))
        at_v, stride_v, oat_v = vnni._indices(context, builder, signature, args, (1, 2, 4))
        words = ir.VectorType(ir.IntType(32), 16)
        load = _loader(builder)
        word = ir.Constant(words, [0] * 16)
        for k in range(4):
            code = load(codes_a, builder.add(at_v, builder.mul(stride_v, ir.Constant(at_v.type, k))), words, 4)
            byte = builder.and_(code, ir.Constant(words, [255] * 16))
            word = builder.or_(word, builder.shl(byte, ir.Constant(words, [8 * k] * 16)) if k else byte)
        builder.store(word, builder.bitcast(builder.gep(out_a.data, [oat_v]), words.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(codes, at, stride, out, oat), codegen


def _scales_k4_intrinsic(integers: bool):  # type: ignore[no-untyped-def]
    """``scales(flat, at, sc, mn, p)``: the 8 scales and minimums of the q4_k or q5_k super-block
    at byte ``at`` of ``flat`` (its fp16 d and dmin, then 12 bytes of 6-bit values) as float32,
    times d at sc[p:p + 8] and times -dmin at mn[p:p + 8], in vectors (``kquants._scale_min_k4``'s
    bits): a value at a time they were two thirds of these rows' unpacking. With ``integers``
    the minimums stay integers instead, int16 at the bytes of mn[p:p + 4] (two a float's place:
    ``vpdpwssd``'s pairs, ``_tile_intrinsic``'s ``pairs``), and -dmin at mn[p + 4]."""
    @intrinsic
    def scales(typingctx, flat, at, sc, mn, p):  # type: ignore[no-untyped-def]
        return types.void(flat, at, sc, mn, p), _scales_k4_codegen(integers)

    return scales


def _scales_k4_codegen(integers: bool):  # type: ignore[no-untyped-def]
    from llvmlite import ir

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        flat_a, sc_a, mn_a = vnni._arrays(context, builder, signature, args, (0, 2, 3))
        at_v, p_v = vnni._indices(context, builder, signature, args, (1, 4))
        load = _loader(builder)
        i8, i32, f32 = ir.IntType(8), ir.IntType(32), ir.FloatType()
        eight, floats = ir.VectorType(i8, 8), ir.VectorType(f32, 8)

        def bytes_of(values):  # type: ignore[no-untyped-def]
            return ir.Constant(eight, values)

        def picked(vector, order):  # type: ignore[no-untyped-def]
            return builder.shuffle_vector(vector, vector, ir.Constant(ir.VectorType(i32, 8), order))

        def half(offset):  # type: ignore[no-untyped-def]
            return _fp16(builder, load(flat_a, builder.add(at_v, ir.Constant(at_v.type, offset)), ir.IntType(16)))

        b = load(flat_a, builder.add(at_v, ir.Constant(at_v.type, 4)), ir.VectorType(i8, 16))  # bytes 4..19
        top = bytes_of([0, 0, 0, 0, 48, 48, 48, 48])  # sub-blocks 4-7 take two high bits from bytes 0-7
        # scales: j < 4 the low 6 bits of byte j, else byte j + 4's low 4 and byte j - 4's top 2
        scales = builder.or_(builder.and_(picked(b, [0, 1, 2, 3, 8, 9, 10, 11]), bytes_of([63] * 4 + [15] * 4)),
                             builder.and_(builder.lshr(picked(b, [0, 0, 0, 0, 0, 1, 2, 3]), bytes_of([2] * 8)), top))
        # minimums: j < 4 the low 6 bits of byte j + 4, else byte j + 4's high 4 and byte j's top 2
        lows = builder.lshr(picked(b, [4, 5, 6, 7, 8, 9, 10, 11]), bytes_of([0] * 4 + [4] * 4))
        minimums = builder.or_(builder.and_(lows, bytes_of([63] * 4 + [15] * 4)),
                               builder.and_(builder.lshr(picked(b, [0, 0, 0, 0, 4, 5, 6, 7]), bytes_of([2] * 8)),
                                            top))

        def put(values, factor, array):  # type: ignore[no-untyped-def]
            value = builder.fmul(builder.uitofp(values, floats), _splat(builder, factor, 8))
            builder.store(value, builder.bitcast(builder.gep(array.data, [p_v]), floats.as_pointer()), align=4)

        put(scales, half(0), sc_a)
        if integers:
            wide = builder.zext(minimums, ir.VectorType(ir.IntType(16), 8))
            builder.store(wide, builder.bitcast(builder.gep(mn_a.data, [p_v]), wide.type.as_pointer()), align=4)
            builder.store(builder.fneg(half(2)), builder.gep(mn_a.data, [builder.add(p_v, ir.Constant(p_v.type, 4))]))
        else:
            put(minimums, builder.fneg(half(2)), mn_a)
        return context.get_dummy_value()

    return codegen


def _scales_intrinsic(kind: int):  # type: ignore[no-untyped-def]
    """``scales(flat, at, sc, p)``: the scales of the q6_k (16, int8 times d) or iq4_xs (8,
    6-bit minus 32, times d) super-block at byte ``at`` of ``flat`` as float32 at sc[p:], in one
    vector (a value at a time in a Numba loop: about half of these rows' unpacking)."""
    from llvmlite import ir

    i8, i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
    count = 16 if kind == _HALVES else 8
    words, floats = ir.VectorType(i32, count), ir.VectorType(f32, count)

    @intrinsic
    def scales(typingctx, flat, at, sc, p):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            flat_a, sc_a = vnni._arrays(context, builder, signature, args, (0, 2))
            at_v, p_v = vnni._indices(context, builder, signature, args, (1, 3))
            load = _loader(builder)

            def byte_at(offset, t):  # type: ignore[no-untyped-def]
                return load(flat_a, builder.add(at_v, ir.Constant(at_v.type, offset)), t)

            def lanes_of(values):  # type: ignore[no-untyped-def]
                return ir.Constant(words, values)

            if kind == _HALVES:  # q6_k: int8 scales at 192, fp16 d at 208
                values = builder.sitofp(byte_at(192, ir.VectorType(i8, 16)), floats)
                d = byte_at(208, i16)
            else:  # iq4_xs: fp16 d at 0, the scales' high bits (2 each) at 2, their low nibbles at 4
                low = builder.zext(byte_at(4, ir.VectorType(i8, 4)), ir.VectorType(i32, 4))
                low = builder.shuffle_vector(low, low, ir.Constant(words, [0, 0, 1, 1, 2, 2, 3, 3]))
                low = builder.and_(builder.lshr(low, lanes_of([0, 4] * 4)), lanes_of([15] * 8))
                high = _splat(builder, builder.zext(byte_at(2, i16), i32), 8)
                high = builder.and_(builder.lshr(high, lanes_of([2 * j for j in range(8)])), lanes_of([3] * 8))
                values = builder.sitofp(builder.sub(builder.or_(low, builder.shl(high, lanes_of([4] * 8))),
                                                    lanes_of([32] * 8)), floats)
                d = byte_at(0, i16)
            value = builder.fmul(values, _splat(builder, _fp16(builder, d), count))
            builder.store(value, builder.bitcast(builder.gep(sc_a.data, [p_v]), floats.as_pointer()), align=4)
            return context.get_dummy_value()

        return types.void(flat, at, sc, p), codegen

    return scales


@contextlib.contextmanager
def _blocks_of(builder, count, const):  # type: ignore[no-untyped-def]
    """The index of a span's block, 0 to ``count`` - 1: in a loop where ``count`` is over one
    (its blocks unrolled instead, LLVM scheduled the K-quants' and int8's tiles worse:
    ``_tile_intrinsic``, ``kernels.LANES_MAX_TOKENS``),
    else the constant 0."""
    if count == 1:
        yield const(0)
        return
    with cgutils.for_range(builder, const(count)) as loop:
        yield loop.index


def _tile_intrinsic(groups: int, halves: int = 1, minimums: bool = False, span: int = 1,  # type: ignore[no-untyped-def]
                    shared: int = 1, pairs: bool = False):
    """``tile(w, wbase, cols, sc, mn, pbase, blocks, act, abase, astride, dx, shift, dsum, dbase,
    dstride, out, obase, ostride, rstride, ahead, aat, init, last)``: TILE_ROWS rows of unsigned
    codes (row r at w[wbase + r * cols], rows of ``cols`` values; ``blocks`` blocks of 32 from
    there) times ``groups`` groups of 16 tokens (group
    m's int8 activations at act[abase + m * astride] as ``_activations`` lays them out). The
    blocks go ``span`` at a time (``span``; one with ``halves`` 2), each span with one scale and
    (with ``minimums``) one minimum a row at sc/mn[pbase + r * spans * halves], ``halves`` a
    span, and the tokens' scales, minus the codes' offset times their sums, and their scales
    times their sums at dx/shift/dsum[dbase + m * dstride] (a span's 16 tokens a vector): the
    span's integer products summed, then one conversion and multiply-add (two with minimums) a row
    and group. Row r's 16 sums for group m are stored at out[obase + m * ostride + r * rstride],
    and with ``init`` nonzero the sums start from what is there (a slice of the rows' values after
    another: ``_matmul``). Each block also prefetches two cache lines at ahead[aat + 128 b].

    With ``shared`` (``token_span``: 8 but for int4_g128 and rows not whole 256s), the tokens' scales
    at dx cover ``shared`` spans (their activations quantized per 256 values, as llama.cpp's q8_K;
    spans of one block but for int4_g64's, of two, four a super-block) while the rows' scales and
    minimums are a span's (a half block's with ``halves``): the totals
    are kept in units of the current super-block's tokens' scales, each block's (half block's) sums
    converted and multiplied by the row's scale into them, the minimums times the tokens' code sums
    (dsum, then a block's, as the shifts are) too; entering a super-block the totals are multiplied
    by the ratio of the scales (``_as_ratios``), and at the end by the last (at dx[last + m *
    dstride]; none where ``last`` is negative: a slice before another, its totals left in units of
    its last super-block's scales, as the next slice's first ratio takes them). One multiply-add a
    block and row where the other kinds take a multiply and a multiply-add: ``vpdpbusd`` shares the
    CPU's multiplying units with both (16 ``vpdpbusd`` and 4 multiplies or multiply-adds took as
    long as 20 ``vpdpbusd``; conversions and integer adds beside them cost nothing). q6_k's and
    q4_k's products of 14336 x 4096 at 256 tokens took 24.3 and 24.7 ms against 27.4 and 26.1 (and
    with the eight blocks unrolled, 31.7 for both).

    With ``pairs`` (q4_k, q5_k: their minimums integers, ``_scales_k4_intrinsic``) the minimums
    go in once a super-block instead of a block: ``vpdpwssd`` of the row's int16 minimums, two
    blocks a pair, by the tokens' int16 code sums (at dsum, a pair of blocks a 32-bit word, the
    super-block's first four places), then one multiply-add by -dmin."""
    from llvmlite import ir

    rows = TILE_ROWS
    i32, f32 = ir.IntType(32), ir.FloatType()
    words, floats = ir.VectorType(i32, 16), ir.VectorType(f32, 16)
    per_half = 8 // halves
    assert halves == 1 or span == 1
    assert shared == 1 or span == 1 or shared * span == 8  # int4_g64: spans of 2, 4 a token scale
    assert not pairs or (shared == 8 and minimums and halves == 1)

    @intrinsic
    def tile(typingctx, w, wbase, cols, sc, mn, pbase, blocks, act, abase, astride, dx, shift, dsum, dbase, dstride,
             out, obase, ostride, rstride, ahead, aat, init, last):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            w_a, sc_a, mn_a, act_a, dx_a, shift_a, dsum_a, out_a, ahead_a = vnni._arrays(
                context, builder, signature, args, (0, 3, 4, 7, 10, 11, 12, 15, 19))
            (wbase_v, cols_v, pbase_v, blocks_v, abase_v, astride_v, dbase_v, dstride_v, obase_v, ostride_v,
             rstride_v, aat_v, init_v, last_v) = vnni._indices(context, builder, signature, args,
                                                               (1, 2, 5, 6, 8, 9, 13, 14, 16, 17, 18, 20, 21, 22))
            index_t = wbase_v.type
            load = _loader(builder)

            def const(k):  # type: ignore[no-untyped-def]
                return ir.Constant(index_t, k)

            dpbusd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(words, [words] * 3),
                                                    "llvm.x86.avx512.vpdpbusd.512")
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(floats, [floats] * 3),
                                                 "llvm.fma.v16f32")
            prefetch = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), i32, i32, i32]),
                "llvm.prefetch.p0i8")
            accs = [[cgutils.alloca_once_value(builder, ir.Constant(floats, [0.0] * 16)) for _ in range(groups)]
                    for _ in range(rows)]

            def sums_at(r, m):  # type: ignore[no-untyped-def]
                at = builder.add(vnni._nth(builder, obase_v, ostride_v, m), vnni._nth(builder, const(0), rstride_v, r))
                return builder.bitcast(builder.gep(out_a.data, [at]), floats.as_pointer())

            with builder.if_then(builder.icmp_signed("!=", init_v, const(0))):
                for r in range(rows):
                    for m in range(groups):
                        builder.store(builder.load(sums_at(r, m), align=4), accs[r][m])
            spans_v = builder.sdiv(blocks_v, const(span * shared))
            params_per_row = builder.mul(builder.sdiv(cols_v, const(32 * span)), const(halves))
            with cgutils.for_range(builder, spans_v) as loop:
                s = loop.index
                scales = [load(dx_a, builder.add(vnni._nth(builder, dbase_v, dstride_v, m), builder.mul(s, const(16))),
                               floats, 4) for m in range(groups)]
                if shared > 1:  # the totals so far in units of this super-block's tokens' scales (``_as_ratios``)
                    for r in range(rows):
                        for m in range(groups):
                            builder.store(builder.fmul(builder.load(accs[r][m]), scales[m]), accs[r][m])
                with _blocks_of(builder, shared, const) as inner:
                    u = builder.add(builder.mul(s, const(shared)), inner)  # the weights' span
                    dsums, shifts = [], []
                    for m in range(groups):
                        base = builder.mul(vnni._nth(builder, dbase_v, dstride_v, m), const(shared))
                        if minimums and not pairs:
                            dsums.append(load(dsum_a, builder.add(base, builder.mul(u, const(16))), floats, 4))
                        s_i = builder.add(builder.mul(base, const(halves)), builder.mul(u, const(16 * halves)))
                        shifts.append([load(shift_a, builder.add(s_i, const(16 * h)), words, 4) for h in range(halves)])
                    p_rows = [builder.add(vnni._nth(builder, pbase_v, params_per_row, r), builder.mul(u, const(halves)))
                              for r in range(rows)]
                    first_block = builder.mul(u, const(span))
                    for h in range(halves):
                        # the sums start at minus the codes' offset times the tokens' sums (the same
                        # for every row) and take the span's (or half block's) products, code by code
                        # across the rows
                        sums = [[shifts[m][h] for m in range(groups)] for _ in range(rows)]
                        held = [[cgutils.alloca_once_value(builder, sums[r][m]) for m in range(groups)]
                                for r in range(rows)] if span > 1 else None
                        with _blocks_of(builder, span, const) as k:  # a loop where a span has several
                            b = builder.add(first_block, k)
                            if held:
                                sums = [[builder.load(held[r][m]) for m in range(groups)] for r in range(rows)]
                            if h == 0:
                                for line in (0, 64):  # the next chunk's bytes, into L2, while this one is multiplied
                                    at = builder.add(builder.add(aat_v, builder.mul(b, const(128))), const(line))
                                    builder.call(prefetch, [builder.gep(ahead_a.data, [at]), ir.Constant(i32, 0),
                                                            ir.Constant(i32, 1), ir.Constant(i32, 1)])
                            xs = []
                            for m in range(groups):
                                a_i = builder.add(vnni._nth(builder, abase_v, astride_v, m), builder.mul(b, const(512)))
                                xs.append({j: load(act_a, builder.add(a_i, const(64 * j)), words)
                                           for j in range(h * per_half, (h + 1) * per_half)})
                            firsts = [builder.add(vnni._nth(builder, wbase_v, cols_v, r), builder.mul(b, const(32)))
                                      for r in range(rows)]
                            for j in range(h * per_half, (h + 1) * per_half):
                                for r in range(rows):
                                    weights = _splat(builder, load(w_a, builder.add(firsts[r], const(4 * j)), i32), 16)
                                    sums[r] = [builder.call(dpbusd, [sums[r][m], weights, xs[m][j]])
                                               for m in range(groups)]
                            if held:
                                for r in range(rows):
                                    for m in range(groups):
                                        builder.store(sums[r][m], held[r][m])
                        if held:
                            sums = [[builder.load(held[r][m]) for m in range(groups)] for r in range(rows)]
                        for r in range(rows):  # one conversion and multiply-add by the row's and tokens' scales
                            p = builder.add(p_rows[r], const(h))
                            scale = _splat(builder, load(sc_a, p, f32, 4), 16)
                            lowest = _splat(builder, load(mn_a, p, f32, 4), 16) if minimums and not pairs else None
                            for m in range(groups):
                                # with ``shared`` the tokens' scales come once a super-block (above)
                                factor = scale if shared > 1 else builder.fmul(scale, scales[m])
                                total = builder.call(fma, [builder.sitofp(sums[r][m], floats), factor,
                                                           builder.load(accs[r][m])])
                                if minimums and not pairs:  # minus the minimum times the tokens' sums
                                    total = builder.call(fma, [lowest, dsums[m], total])
                                builder.store(total, accs[r][m])
                if pairs:  # the super-block's minimums times the tokens' code sums, two blocks an instruction
                    dpwssd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(words, [words] * 3),
                                                            "llvm.x86.avx512.vpdpwssd.512")
                    first_u = builder.mul(s, const(shared))
                    for r in range(rows):
                        p_s = builder.add(vnni._nth(builder, pbase_v, params_per_row, r), first_u)
                        paired = [_splat(builder, load(mn_a, builder.add(p_s, const(k)), i32, 4), 16) for k in range(4)]
                        lowest = _splat(builder, load(mn_a, builder.add(p_s, const(4)), f32, 4), 16)
                        for m in range(groups):
                            base = builder.mul(vnni._nth(builder, dbase_v, dstride_v, m), const(shared))
                            dot = ir.Constant(words, [0] * 16)
                            for k in range(4):
                                at = builder.add(base, builder.mul(builder.add(first_u, const(k)), const(16)))
                                dot = builder.call(dpwssd, [dot, paired[k], load(dsum_a, at, words, 4)])
                            total = builder.call(fma, [lowest, builder.sitofp(dot, floats), builder.load(accs[r][m])])
                            builder.store(total, accs[r][m])
            if shared > 1:  # times the last super-block's tokens' scales, which ``_as_ratios`` keeps first
                with builder.if_then(builder.icmp_signed(">=", last_v, const(0))):
                    for m in range(groups):
                        final = load(dx_a, vnni._nth(builder, last_v, dstride_v, m), floats, 4)
                        for r in range(rows):
                            builder.store(builder.fmul(builder.load(accs[r][m]), final), accs[r][m])
            for r in range(rows):
                for m in range(groups):
                    builder.store(builder.load(accs[r][m]), sums_at(r, m), align=4)
            return context.get_dummy_value()

        return (types.void(w, wbase, cols, sc, mn, pbase, blocks, act, abase, astride, dx, shift, dsum, dbase, dstride,
                           out, obase, ostride, rstride, ahead, aat, init, last), codegen)

    return tile


def _transpose_stages() -> list[list[tuple[int, int, list[int]]]]:
    """The four stages of a 16 x 16 transpose in two-source shuffles, as ``shufflevector``
    operands: per stage and output vector, its two inputs' numbers and the mask (lane k takes
    element mask[k] of the two inputs' 32). The stages are AVX-512's usual sequence (interleave
    32-bit pairs, then 64-bit pairs within 128-bit lanes, then two rounds of 128-bit lane
    shuffles), derived here by following each element, so that LLVM picks the instructions."""
    vectors = [[(i, j) for j in range(16)] for i in range(16)]

    def interleave(a, b, high, unit):  # unpack{lo,hi}_ps (unit 1) or _pd (unit 2) within 128-bit lanes
        out = []
        for lane in range(4):
            first = 4 * lane + (2 if high else 0)
            out += ([a[first], b[first], a[first + 1], b[first + 1]] if unit == 1
                    else [a[first], a[first + 1], b[first], b[first + 1]])
        return out

    def lanes(a, b, odd):  # shuffle_f32x4 with 0x88 (odd False) or 0xdd: a's lanes 0, 2 (1, 3), then b's
        pick = (1, 3) if odd else (0, 2)
        return [v for src in (a, b) for k in pick for v in src[4 * k:4 * k + 4]]

    def pair(o: int) -> tuple[int, int]:  # the second stage's inputs for output o
        first = 4 * (o // 4) + (o % 4) // 2
        return first, first + 2

    plans = [
        [(2 * (o // 2), 2 * (o // 2) + 1, lambda a, b, o=o: interleave(a, b, o % 2 == 1, 1)) for o in range(16)],
        [(*pair(o), lambda a, b, o=o: interleave(a, b, o % 2 == 1, 2)) for o in range(16)],
        [(8 * (o // 8) + o % 4, 8 * (o // 8) + o % 4 + 4, lambda a, b, o=o: lanes(a, b, (o % 8) >= 4))
         for o in range(16)],
        [(o % 8, o % 8 + 8, lambda a, b, o=o: lanes(a, b, o >= 8)) for o in range(16)],
    ]
    stages = []
    for plan in plans:
        stage, produced = [], []
        for first, second, make in plan:
            a, b = vectors[first], vectors[second]
            out = make(a, b)
            stage.append((first, second, [a.index(e) if e in a else 16 + b.index(e) for e in out]))
            produced.append(out)
        stages.append(stage)
        vectors = produced
    assert all(vectors[j] == [(i, j) for i in range(16)] for j in range(16))
    return stages


@intrinsic
def _transpose16(typingctx, sums, sbase, out, obase, ostride):  # type: ignore[no-untyped-def]
    """``_transpose16(sums, sbase, out, obase, ostride)``: the 16 x 16 floats at sums[sbase:] (16
    rows' sums for 16 tokens, a row's after another's) to out[obase + t * ostride:][:16] for token
    t (its 16 rows' sums), through registers. Element by element, the transposition and its
    writes took about 3 of a 256-token q4_0 product's 25 ms at Mixtral's 14336 x 4096 (two
    threads); through registers 1-3% of the product came back, the rest being the writes (256
    scattered 64-byte pieces a chunk), which ``by_row`` avoids."""
    from llvmlite import ir

    floats = ir.VectorType(ir.FloatType(), 16)
    stages = _transpose_stages()

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        sums_a, out_a = vnni._arrays(context, builder, signature, args, (0, 2))
        sbase_v, obase_v, ostride_v = vnni._indices(context, builder, signature, args, (1, 3, 4))
        load = _loader(builder)
        vectors = [load(sums_a, builder.add(sbase_v, ir.Constant(sbase_v.type, 16 * r)), floats, 4) for r in range(16)]
        for stage in stages:
            vectors = [builder.shuffle_vector(vectors[a], vectors[b], ir.Constant(ir.VectorType(ir.IntType(32), 16),
                                                                                   mask))
                       for a, b, mask in stage]
        for t in range(16):
            _store(builder, vectors[t], out_a, vnni._nth(builder, obase_v, ostride_v, t))
        return context.get_dummy_value()

    return types.void(sums, sbase, out, obase, ostride), codegen


_unpack_q8_0, _unpack_q4_0, _unpack_mxfp4, _unpack_iq4_nl = (_unpack_intrinsic(kind) for kind in range(1, 5))
_unpack4_q8_0, _unpack4_q4_0, _unpack4_mxfp4, _unpack4_iq4_nl = (_unpack4_intrinsic(kind) for kind in range(1, 5))
_codes_q4_k, _codes_q5_k, _codes_q6_k, _codes_iq4_xs = (_superblock_intrinsic(kind) for kind in range(5, 9))
_codes_int4_g32, _codes_int4_g64, _codes_int4_g128 = (_int4_codes_intrinsic(group) for group in (32, 64, 128))
_codes_int8 = _int8_codes_intrinsic()
_scales_q6_k, _scales_iq4_xs = _scales_intrinsic(_HALVES), _scales_intrinsic(8)
_scales_k4, _scales_k4_pairs = _scales_k4_intrinsic(False), _scales_k4_intrinsic(True)
_codes128_int4_g32, _codes128_int4_g64, _codes128_int4_g128 = (_int4_codes128_intrinsic(group)
                                                                for group in (32, 64, 128))
_tile_pair, _tile_one = _tile_intrinsic(TILE_GROUPS), _tile_intrinsic(1)
_tile_pair_minimums, _tile_one_minimums = _tile_intrinsic(TILE_GROUPS, minimums=True), _tile_intrinsic(1, minimums=True)
_tile_pair_halves, _tile_one_halves = _tile_intrinsic(TILE_GROUPS, halves=2), _tile_intrinsic(1, halves=2)
_tile_pair_minimums_2, _tile_one_minimums_2, _tile_pair_minimums_4, _tile_one_minimums_4 = (
    _tile_intrinsic(groups, minimums=True, span=wide) for wide in (2, 4) for groups in (TILE_GROUPS, 1))
_tile_pair_8, _tile_one_8 = _tile_intrinsic(TILE_GROUPS, span=8), _tile_intrinsic(1, span=8)
_tile_pair_minimums_k, _tile_one_minimums_k = (_tile_intrinsic(groups, minimums=True, shared=8)
                                               for groups in (TILE_GROUPS, 1))
_tile_three_minimums_k2, _tile_pair_minimums_k2, _tile_one_minimums_k2 = (
    _tile_intrinsic(groups, minimums=True, span=2, shared=4) for groups in (3, TILE_GROUPS, 1))
_tile_pair_pairs_k, _tile_one_pairs_k = (_tile_intrinsic(groups, minimums=True, shared=8, pairs=True)
                                         for groups in (TILE_GROUPS, 1))
_tile_pair_k, _tile_one_k = (_tile_intrinsic(groups, shared=8) for groups in (TILE_GROUPS, 1))
_tile_pair_halves_k, _tile_one_halves_k = (_tile_intrinsic(groups, halves=2, shared=8) for groups in (TILE_GROUPS, 1))
_tile_three, _tile_three_8, _tile_three_k, _tile_three_pairs_k, _tile_three_halves_k = (
    _tile_intrinsic(3), _tile_intrinsic(3, span=8), _tile_intrinsic(3, shared=8),
    _tile_intrinsic(3, minimums=True, shared=8, pairs=True), _tile_intrinsic(3, halves=2, shared=8))


def scratch(key: str, size: int, dtype: type) -> np.ndarray:
    """A 64-byte-aligned array of ``size`` values of ``dtype`` that this thread keeps for the
    next call asking for ``key`` (its contents: whatever the last user left). The batched products'
    working arrays (the quantized activations, gate/up's products by row) are tens of MB at a
    few hundred tokens; allocated afresh each call, between calls of other sizes glibc's malloc
    handed back fresh pages, whose first touch cost a 256-token q4_0 expert at Mixtral's shape
    2,700-2,800 page faults and 6-8 ms of its 70. Arrays over ``SCRATCH_KEEP_BYTES`` are made
    for the call and not kept (a long prompt chunk's one popular expert need not hold hundreds of
    MB for the process's life)."""
    held = _SCRATCH.__dict__.setdefault("arrays", {})
    array = held.get(key)
    if array is None or array.size < size or array.dtype != dtype:
        array = vnni.zeros64(max(size, 1), dtype)
        if array.nbytes <= SCRATCH_KEEP_BYTES:
            held[key] = array
    return array[:size]


def quantized(x: np.ndarray, scheme: str) -> tuple[np.ndarray, ...]:
    """Tokens x [n, cols] quantized for a matrix of ``scheme`` (``_activations``), in this
    thread's ``scratch`` arrays: valid until the next call."""
    n, cols = x.shape
    kind = KINDS[scheme]
    halves = 2 if kind == _HALVES else 1
    groups, blocks = (n + LANE_TOKENS - 1) // LANE_TOKENS, cols // 32
    wide, shared = span(kind, blocks), token_span(kind, blocks)
    act, scales, shift, dsum = _layout(groups, blocks, wide, halves, shared)
    spans = blocks // shared
    _activations(x.reshape(-1), n, cols, _OFFSET[kind], halves, wide, shared, _paired(kind, blocks, n),
                 scratch("xq", n * cols, np.int8),
                 scratch("dx", n * spans, np.float32), scratch("sums", n * spans, np.float32), act, scales, shift,
                 dsum)
    if shared > wide:
        _as_ratios(scales, groups, spans)
    return act.view(np.int8), scales, shift, dsum


def activation_group(scheme: str, cols: int) -> int:
    """Values that share one activation scale when tokens of ``cols`` values multiply a matrix of
    ``scheme`` here (``token_span``: 32 but for int8, int4 with groups over 32 and the
    K-quants)."""
    return 32 * token_span(KINDS[scheme], cols // 32)


def _layout(groups: int, blocks: int, wide: int, halves: int, shared: int) -> tuple[np.ndarray, ...]:
    """The scratch arrays of ``groups`` groups of 16 tokens by ``blocks`` blocks of 32 values,
    ``wide`` blocks a span, for the tiles: their codes (int32 words), the scales of ``shared``
    blocks (``token_span``), and a span's shifts (``halves`` a span) and scaled sums."""
    items, spans = groups * blocks, groups * (blocks // wide)
    return (scratch("act", items * 128, np.int32), scratch("scales", groups * (blocks // shared) * 16, np.float32),
            scratch("shift", spans * halves * 16, np.int32), scratch("dsum", spans * 16, np.float32))


@njit(cache=True, nogil=True)
def _activations(x, n, cols, offset, halves, wide, shared, pairs, xq, dx, sums, act, scales, shift,
                 dsum):  # pragma: no cover - compiled
    # The n tokens' activations x (float32, n * cols values) quantized to int8 per ``shared``
    # blocks of 32 values (``token_span``; ``vnni._quantize_groups``, as the one-token block
    # kernels for spans of one block; into xq, dx, sums) and laid out for the tile: for each
    # group of 16 tokens and each block of 32 values, 8 vectors of four values of each token
    # (act); per group and ``shared`` blocks the 16 tokens' scales (``scales``); per group and
    # span of ``wide`` blocks their scales times their sums (``dsum``), and per group, span and
    # each of its ``halves`` minus ``offset`` times the tokens' code sums (``shift``, int32).
    # Tokens past n (padding the last group) are zeros with scale 0. With ``pairs`` (q4_k, q5_k)
    # the blocks' code sums go to dsum two a 32-bit word, int16 each, in each super-block's first
    # four places (``_tile_intrinsic``'s ``pairs``).
    groups = (n + LANE_TOKENS - 1) // LANE_TOKENS
    paired = dsum.view(np.int32)
    code_sums = np.zeros(cols // 32, np.int32)
    blocks = cols // 32
    spans = blocks // wide
    scaled = blocks // shared  # scales a token
    unit = 32 * wide // halves  # values a shift sums
    vnni._quantize_groups(x, 32 * shared, 0, xq, dx, sums)
    words = xq.view(np.int32)
    for t in range(n):
        g, lane = t // LANE_TOKENS, t % LANE_TOKENS
        for b in range(blocks):
            at = (g * blocks + b) * 128 + lane
            first = (t * cols + 32 * b) // 4
            for j in range(8):
                act[at + 16 * j] = words[first + j]
        for s in range(scaled):
            scales[(g * scaled + s) * 16 + lane] = dx[t * scaled + s]
        for s in range(spans):
            if shared == wide:
                dsum[(g * spans + s) * 16 + lane] = sums[t * spans + s]
            if halves == 1 and wide == 1 and shared == 1:  # the code sum, back from the scaled one
                # (exact: at most 32 x 127)
                d = dx[t * spans + s]
                total = np.int32(np.rint(sums[t * spans + s] / d)) if d > 0 else np.int32(0)
                shift[(g * spans + s) * 16 + lane] = -offset * total
                continue
            whole = np.int32(0)
            for h in range(halves):
                total = np.int32(0)
                first = t * cols + 32 * wide * s + unit * h
                if unit == 16:  # q6_k's half blocks
                    total = _code_sum16(xq, first)
                for k in range(0, unit - 31, 32):
                    total += _code_sum32(xq, first + k)
                shift[((g * spans + s) * halves + h) * 16 + lane] = -offset * total
                whole += total
            code_sums[s] = whole
            if shared != wide:  # the span's code sum (the tile's sums are in units of the tokens' scales)
                dsum[(g * spans + s) * 16 + lane] = np.float32(whole)
        if pairs:
            for s in range(0, spans, 2):
                at = (g * spans + s // shared * shared + s % shared // 2) * 16 + lane
                paired[at] = (code_sums[s] & 0xFFFF) | (code_sums[s + 1] << 16)
    for t in range(n, groups * LANE_TOKENS):
        g, lane = t // LANE_TOKENS, t % LANE_TOKENS
        for b in range(blocks):
            _padding_codes(g * blocks + b, lane, act)
        for s in range(scaled):
            scales[(g * scaled + s) * 16 + lane] = 0
        for s in range(spans):
            _padding_sums(g * spans + s, lane, halves, shift, dsum)


@njit(cache=True, nogil=True, inline="always")
def _padding_codes(item, lane, act):  # pragma: no cover - compiled
    # Token ``lane`` of block ``item`` (16 tokens by 32 values) a padding one: zeros.
    for j in range(8):
        act[item * 128 + 16 * j + lane] = 0


@njit(cache=True, nogil=True, inline="always")
def _padding_sums(item, lane, halves, shift, dsum):  # pragma: no cover - compiled
    # Token ``lane`` of span ``item`` (16 tokens) a padding one: no sums (its scales: 0).
    dsum[item * 16 + lane] = 0
    for h in range(halves):
        shift[(item * halves + h) * 16 + lane] = 0


@njit(cache=True, nogil=True)
def _as_ratios(scales, groups, scaled):  # pragma: no cover - compiled
    """The K-quants' tokens' scales (``scaled`` super-blocks a token, 16 tokens a vector) as the
    tile reads them (``_tile_intrinsic``'s ``shared``): each super-block's but the first the
    ratio of the one before it to it, the first the last one. The tile keeps its totals in units
    of the current super-block's scales, multiplying them by the ratio as it enters each, and by
    the last scale at the end: one multiply a super-block, where a sum of each super-block's
    blocks would hold another eight vectors in registers. A padding token's scales are 0, and so
    its ratios."""
    for g in range(groups):
        base = g * scaled * 16
        for lane in range(LANE_TOKENS):
            last = scales[base + (scaled - 1) * 16 + lane]
            for s in range(scaled - 1, 0, -1):
                now, before = scales[base + s * 16 + lane], scales[base + (s - 1) * 16 + lane]
                scales[base + s * 16 + lane] = before / now if now > 0 else np.float32(0.0)
            scales[base + lane] = last


def activated(h_rows: np.ndarray, n: int, inter: int, scheme: str, clamped: bool = False, limit: float = 7.0,
              alpha: float = 1.702, bias: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """The activation of n tokens' gate/up products given by row (``matmul(..., by_row=True)``:
    [2 * inter, n rounded up to 16], ``bias`` [2 * inter] added first), SiLU(gate) * up or
    gpt-oss's clamped SwiGLU (``clamped``, ``limit``, ``alpha``), quantized for a matrix of
    ``scheme`` with rows of ``inter`` values as ``quantized`` quantizes tokens, for
    ``product``. The products arrive 16 tokens a vector, which is the tiles' own layout: the
    activation, each token's scales per span (``span``) and the codes are computed 16 tokens at a time
    where token by token they took an activation pass (numpy's, 7 of a 256-token q4_0 expert's 92
    ms at Mixtral's shape), a transposition and a quantization pass."""
    kind = KINDS[scheme]
    halves = 2 if kind == _HALVES else 1
    has_bias = bias is not None
    gu_bias = np.ascontiguousarray(bias, dtype=np.float32) if has_bias else np.zeros(1, np.float32)
    wide, shared = span(kind, inter // 32), token_span(kind, inter // 32)
    act, scales, shift, dsum = _layout(h_rows.shape[1] // LANE_TOKENS, inter // 32, wide, halves, shared)
    _activated(h_rows, n, inter, clamped, np.float32(limit), np.float32(alpha), gu_bias, has_bias, _OFFSET[kind],
               halves, wide, shared, _paired(kind, inter // 32, n), max(1, get_num_threads()), act, scales, shift,
               dsum)
    if shared > wide:
        _as_ratios(scales, h_rows.shape[1] // LANE_TOKENS, inter // 32 // shared)
    return act.view(np.int8), scales, shift, dsum


@njit(cache=True, nogil=True, parallel=True, fastmath=True, error_model="numpy")
def _activated(h, n, inter, clamped, limit, alpha, bias, has_bias, offset, halves, wide, shared, pairs, workers, act,
               scales, shift, dsum):  # pragma: no cover - compiled
    # ``activated``: each work item up to ``_ACTIVATED_GROUPS`` groups of 16 tokens by ``shared``
    # blocks of 32 values of the down rows (``token_span``: one scale a token), ``shared // wide``
    # spans. A group at a time, the loops over its 16 tokens ran a value at a time: LLVM's
    # vectorized loop (8 lanes, interleaved) wants more than 16 iterations, and took the scalar
    # remainder for all of them (0.6 ns a value of the SiLU from the caches, one thread). Items of up
    # to 4 groups read a quarter of each gate/up row's 1 KB at 256 tokens, a row at a time: up to
    # 16 groups (every token of a row at once), 14336-value rows at 256 tokens took 1.06-1.11 ms
    # against 1.96-2.14, at 128 0.55-0.57 against 0.74-0.80 (at 32-64, and Qwen3-30B-A3B's 768, the
    # same or less).
    groups = h.shape[1] // LANE_TOKENS
    blocks = inter // 32
    spans = blocks // shared
    per = shared // wide  # spans an item
    taking = min(_ACTIVATED_GROUPS, groups)  # fewer where the items would be too few to share out evenly
    while taking > 1 and (groups + taking - 1) // taking * spans < 4 * workers:
        taking //= 2
    items = (groups + taking - 1) // taking * spans
    one = np.float32(1.0)
    slope = vnni.LOG2E_NEG * (alpha if clamped else one)
    count = 32 * shared  # values an item
    unit = 32 * wide // halves  # values a shift sums
    most = taking * LANE_TOKENS  # tokens an item
    paired = dsum.view(np.int32)  # q4_k's and q5_k's code sums two a word (``_activations``)
    for worker in prange(workers):
        values = np.empty((count, most), np.float32)
        codes = np.empty((count, most), np.int32)
        amax = np.empty(most, np.float32)
        d = np.empty(most, np.float32)
        inverse = np.empty(most, np.float32)
        total = np.empty((16, most), np.int32)  # code sums a shift: at most 8 spans of 2 halves
        for item in range(worker * items // workers, (worker + 1) * items // workers):
            bunch, s = item // spans, item % spans
            g0 = bunch * taking
            taken = min(taking, groups - g0)  # groups this item
            width = taken * LANE_TOKENS
            first = count * s  # the span's first value in a row
            amax[:width] = 0
            for j in range(count):
                gate, up = h[first + j, g0 * LANE_TOKENS:], h[inter + first + j, g0 * LANE_TOKENS:]
                add_gate = bias[first + j] if has_bias else np.float32(0.0)
                add_up = bias[inter + first + j] if has_bias else np.float32(0.0)
                if width == LANE_TOKENS:  # one group: its loop compiled for 16 tokens (3 us less a call at 768 x 16)
                    _activated_lanes(gate, up, add_gate, add_up, values[j], amax, LANE_TOKENS, clamped, limit, slope)
                else:
                    _activated_lanes(gate, up, add_gate, add_up, values[j], amax, width, clamped, limit, slope)
            for lane in range(width):  # as vnni._quantize_groups: times the inverse, ties to even
                d[lane] = amax[lane] / np.float32(127) if amax[lane] > 0 else one
                inverse[lane] = one / d[lane]
            total[:, :width] = 0
            for j in range(count):
                for lane in range(width):
                    q = np.int32(np.rint(values[j, lane] * inverse[lane]))
                    codes[j, lane] = q
                    total[j // unit, lane] += q
            for k in range(taken):
                g = g0 + k
                slot = g * spans + s  # the group's and span's place in the tiles' layout
                for bb in range(shared):
                    at = (g * blocks + s * shared + bb) * 128
                    for j4 in range(8):
                        _packed16(codes, (32 * bb + 4 * j4) * most + k * LANE_TOKENS, most, act, at + 16 * j4)
                for lane in range(LANE_TOKENS):
                    t = k * LANE_TOKENS + lane
                    if g * LANE_TOKENS + lane >= n:  # padding: zeros with scale 0, as ``_activations``
                        for bb in range(shared):
                            _padding_codes(g * blocks + s * shared + bb, lane, act)
                        scales[slot * 16 + lane] = 0
                        for p in range(per):
                            _padding_sums(slot * per + p, lane, halves, shift, dsum)
                        continue
                    scales[slot * 16 + lane] = d[t]
                    for p in range(per):  # span slot * per + p
                        whole = np.int32(0)
                        for half in range(halves):
                            whole += total[p * halves + half, t]
                            code_sum = total[p * halves + half, t]
                            shift[((slot * per + p) * halves + half) * 16 + lane] = -offset * code_sum
                        dsum[(slot * per + p) * 16 + lane] = np.float32(whole) * (d[t] if per == 1 else one)
                    if pairs:  # halves 1 here: a block's code sum is total[block]
                        for pair in range(4):
                            paired[(slot * per + pair) * 16 + lane] = ((total[2 * pair, t] & 0xFFFF)
                                                                       | (total[2 * pair + 1, t] << 16))


@njit(cache=True, nogil=True, fastmath=True, error_model="numpy", inline="always")
def _activated_lanes(gate, up, add_gate, add_up, out, amax, width, clamped, limit,
                     slope):  # pragma: no cover - compiled
    # ``_activated``'s activation of one row's ``width`` tokens, each one's largest magnitude kept.
    for lane in range(width):
        x, u = gate[lane] + add_gate, up[lane] + add_up
        v = vnni.clamped_swiglu(x, u, limit, slope) if clamped else vnni.silu_times(x, u, slope)
        out[lane] = v
        amax[lane] = max(amax[lane], abs(v))


@njit(cache=True, nogil=True, inline="always")
def _unpack_row(kind, raw, row, flat, w, wat, sc, mn, p, e8m0, pairs):  # pragma: no cover - compiled
    # Row ``row`` of raw: its codes at w[wat:], its spans' scales (and minimums) from sc/mn[p];
    # with ``pairs`` q4_k's and q5_k's minimums as integers (``_scales_k4_intrinsic``).
    size, values = _SIZE[kind], _VALUES[kind]
    base = row * raw.shape[1]
    if kind == _INT8:  # the codes, their sign bits flipped, then the row's float32 scale for every span
        cols = raw.shape[1] - 4
        for b in range(cols // 32):
            _codes_int8(flat, base + 32 * b, w, wat + 32 * b)
        scale = flat[base + cols:base + cols + 4].view(np.float32)[0]
        blocks = cols // 32
        for s in range(blocks // span(kind, blocks)):
            sc[p + s] = scale
        return
    if _INT4 <= kind < _FP8:  # int4: the groups' codes, then their bf16 scales, then their bf16 minimums
        groups = raw.shape[1] * 2 // (values + 8)  # a group's bytes: values / 2 of codes, 4 of parameters
        scales_at = base + groups * size
        per = 128 // values  # groups of 128 values a call, the rest (g32: up to three) one by one
        whole = groups - groups % per
        for g in range(0, whole, per):
            if kind == _INT4:
                _codes128_int4_g32(flat, base + g * size, w, wat + g * values)
            elif kind == _INT4 + 1:
                _codes128_int4_g64(flat, base + g * size, w, wat + g * values)
            else:
                _codes128_int4_g128(flat, base + g * size, w, wat + g * values)
        for g in range(whole, groups):
            if kind == _INT4:
                _codes_int4_g32(flat, base + g * size, w, wat + g * values)
            elif kind == _INT4 + 1:
                _codes_int4_g64(flat, base + g * size, w, wat + g * values)
            else:
                _codes_int4_g128(flat, base + g * size, w, wat + g * values)
        # the row's bytes from its codes' end are bf16 values: its groups' scales, then their
        # minimums, one a span
        vectors = groups - groups % 16
        for g in range(0, vectors, 16):
            _bf16x16(flat, scales_at + 2 * g, sc, p + g)
            _bf16x16(flat, scales_at + 2 * (groups + g), mn, p + g)
        for g in range(vectors, groups):
            at = scales_at + 2 * g
            sc[p + g] = bf16_value(np.uint32(flat[at]) | (np.uint32(flat[at + 1]) << np.uint32(8)))
            at += 2 * groups
            mn[p + g] = bf16_value(np.uint32(flat[at]) | (np.uint32(flat[at + 1]) << np.uint32(8)))
        if pairs and kind == _INT4:  # (``_paired``: only where its rows are whole 256s)
            _int16_minimums(mn, p, groups)
        return
    blocks = raw.shape[1] // size
    first = 0
    if kind <= 4:  # the block kinds four blocks a call (``_unpack4_intrinsic``), the rest below
        first = blocks - blocks % 4
        for b in range(0, first, 4):
            at = base + b * size
            at_w = wat + b * values
            if kind == 1:
                _unpack4_q8_0(flat, at, w, at_w, sc, p + b, e8m0)
            elif kind == 2:
                _unpack4_q4_0(flat, at, w, at_w, sc, p + b, e8m0)
            elif kind == 3:
                _unpack4_mxfp4(flat, at, w, at_w, sc, p + b, e8m0)
            else:
                _unpack4_iq4_nl(flat, at, w, at_w, sc, p + b, e8m0)
    for b in range(first, blocks):
        at = base + b * size
        at_w = wat + b * values
        if kind == 1:
            _unpack_q8_0(flat, at, w, at_w, sc, p + b, e8m0)
        elif kind == 2:
            _unpack_q4_0(flat, at, w, at_w, sc, p + b, e8m0)
        elif kind == 3:
            _unpack_mxfp4(flat, at, w, at_w, sc, p + b, e8m0)
        elif kind == 4:
            _unpack_iq4_nl(flat, at, w, at_w, sc, p + b, e8m0)
        elif kind == 8:  # iq4_xs: 8 6-bit scales of 32 values (4 low bits, 2 high), minus 32, times d
            _codes_iq4_xs(flat, at, w, at_w)
            _scales_iq4_xs(flat, at, sc, p + 8 * b)
        elif kind == 7:  # q6_k: 16 int8 scales of 16 values, times d
            _codes_q6_k(flat, at, w, at_w)
            _scales_q6_k(flat, at, sc, p + 16 * b)
        else:  # q4_k, q5_k: 8 6-bit scales and minimums of 32 values, times d and dmin
            if kind == 5:
                _codes_q4_k(flat, at, w, at_w)
            else:
                _codes_q5_k(flat, at, w, at_w)
            if pairs:
                _scales_k4_pairs(flat, at, sc, mn, p + 8 * b)
            else:
                _scales_k4(flat, at, sc, mn, p + 8 * b)


@intrinsic
def _int16_minimums16(typingctx, mn, at):  # type: ignore[no-untyped-def]
    """``_int16_minimums`` of two super-blocks, mn[at:at + 16], in vectors (a value at a time the
    conversion took more time than the tiles saved)."""
    from llvmlite import ir

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        (mn_a,) = vnni._arrays(context, builder, signature, args, (0,))
        (at_v,) = vnni._indices(context, builder, signature, args, (1,))
        f32, i32 = ir.FloatType(), ir.IntType(32)
        floats = ir.VectorType(f32, 16)
        load = _loader(builder)
        values = load(mn_a, at_v, floats, 4)

        def call(name, *operands):  # type: ignore[no-untyped-def]
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(floats, [floats] * len(operands)),
                                                f"llvm.{name}.v16f32")
            return builder.call(fn, list(operands))

        top = call("fabs", values)
        for step in (1, 2, 4):  # each half's largest magnitude in all its lanes
            swapped = builder.shuffle_vector(top, ir.Constant(floats, ir.Undefined),
                                             ir.Constant(ir.VectorType(i32, 16), [k ^ step for k in range(16)]))
            top = call("maxnum", top, swapped)
        zero = ir.Constant(floats, [0.0] * 16)
        limit = ir.Constant(floats, [32767.0] * 16)
        some = builder.fcmp_ordered(">", top, zero)
        unit = builder.select(some, builder.fdiv(top, limit), ir.Constant(floats, [1.0] * 16))
        inverse = builder.select(some, builder.fdiv(limit, top), zero)
        codes = builder.fptosi(call("rint", builder.fmul(values, inverse)), ir.VectorType(i32, 16))
        words = builder.bitcast(builder.trunc(codes, ir.VectorType(ir.IntType(16), 16)), ir.VectorType(i32, 8))
        for half in range(2):
            first = builder.add(at_v, ir.Constant(at_v.type, 8 * half))
            four = builder.shuffle_vector(words, ir.Constant(words.type, ir.Undefined),
                                          ir.Constant(ir.VectorType(i32, 4), [4 * half + k for k in range(4)]))
            builder.store(four, builder.bitcast(builder.gep(mn_a.data, [first]), four.type.as_pointer()), align=4)
            builder.store(builder.extract_element(unit, ir.Constant(i32, 8 * half)),
                          builder.gep(mn_a.data, [builder.add(first, ir.Constant(at_v.type, 4))]))
        return context.get_dummy_value()

    return types.void(mn, at), codegen


@njit(cache=True, nogil=True, inline="always")
def _int16_minimums(mn, p, groups):  # pragma: no cover - compiled
    # int4_g32's bf16 minimums at mn[p:p + groups] as q4_k's are for the ``pairs`` tiles: each
    # super-block's 8 as int16 multiples of a unit (its largest magnitude / 32767), two a 32-bit
    # word in its first four places, and the unit in the fifth. Each minimum moves by at most half
    # a unit: 2^-16 of the super-block's largest, the rounding of a bf16 value 256 times smaller.
    # The minimum's multiply-add a block (12% of int4_g32's product) becomes one a super-block.
    # Two super-blocks at a time in vectors (``_int16_minimums16``), an odd last one here.
    whole = groups - groups % 16
    for q in range(p, p + whole, 16):
        _int16_minimums16(mn, q)
    words = mn.view(np.int32)
    for q in range(p + whole, p + groups, 8):
        top = np.float32(0.0)
        for j in range(8):
            top = max(top, abs(mn[q + j]))
        unit = top / np.float32(32767) if top > 0 else np.float32(1.0)
        inverse = np.float32(32767) / top if top > 0 else np.float32(0.0)
        for k in range(4):  # word k takes minimums 2k and 2k + 1: read before written
            low = np.int32(np.rint(mn[q + 2 * k] * inverse))
            high = np.int32(np.rint(mn[q + 2 * k + 1] * inverse))
            words[q + k] = (low & 0xFFFF) | (high << 16)
        mn[q + 4] = unit


@njit(cache=True, nogil=True)
def _unpack_rows(kind, raw, first, count, flat, w, cols, sc, mn, params, e8m0,
                 pairs):  # pragma: no cover - compiled
    # Rows first..first + count of raw unpacked (``_unpack_row``), each kind's loop compiled for
    # it: with the kind a run-time value inside the loop over a row's blocks, q4_k's rows took
    # 2.1 ns a block of 32 to unpack from L2, 0.8 with it a constant. A function of its own, called
    # once a chunk (``_matmul``): its twelve loops inlined there, and twice (the stored rows and an
    # interleaved copy's put back), made ``_matmul`` take 146 s to compile here (40 s this way,
    # and as fast: 1536 x 2048 at 16 tokens, medians of 101 calls, 210-222 us either way).
    if kind == 1:
        _rows_of(1, raw, first, count, flat, w, cols, sc, mn, params, e8m0, pairs)
    elif kind == 2:
        _rows_of(2, raw, first, count, flat, w, cols, sc, mn, params, e8m0, pairs)
    elif kind == 3:
        _rows_of(3, raw, first, count, flat, w, cols, sc, mn, params, e8m0, pairs)
    elif kind == 4:
        _rows_of(4, raw, first, count, flat, w, cols, sc, mn, params, e8m0, pairs)
    elif kind == 5:
        _rows_of(5, raw, first, count, flat, w, cols, sc, mn, params, e8m0, pairs)
    elif kind == 6:
        _rows_of(6, raw, first, count, flat, w, cols, sc, mn, params, e8m0, pairs)
    elif kind == 7:
        _rows_of(7, raw, first, count, flat, w, cols, sc, mn, params, e8m0, pairs)
    elif kind == 8:
        _rows_of(8, raw, first, count, flat, w, cols, sc, mn, params, e8m0, pairs)
    elif kind == 9:
        _rows_of(9, raw, first, count, flat, w, cols, sc, mn, params, e8m0, pairs)
    elif kind == 10:
        _rows_of(10, raw, first, count, flat, w, cols, sc, mn, params, e8m0, pairs)
    elif kind == 11:
        _rows_of(11, raw, first, count, flat, w, cols, sc, mn, params, e8m0, pairs)
    else:
        _rows_of(_INT8, raw, first, count, flat, w, cols, sc, mn, params, e8m0, pairs)


@njit(cache=True, nogil=True, inline="always")
def _rows_of(kind, raw, first, count, flat, w, cols, sc, mn, params, e8m0,
             pairs):  # pragma: no cover - compiled
    for r in range(count):
        _unpack_row(kind, raw, first + r, flat, w, r * cols, sc, mn, r * params, e8m0, pairs)


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _matmul(raw, kind, e8m0, act, scales, shift, dsum, n, cols, workers, out,
            by_row, chunk, interleaved):  # pragma: no cover - compiled
    # The tokens' quantized activations times the rows raw of KINDS' ``kind``: out [n, rows], or with
    # ``by_row`` [rows, 16 * groups] (each row's sums for every token, the tokens padded to whole
    # groups of 16: the tiles' own layout, stored as they are computed). Each worker takes a
    # ``chunk``-row chunk at a time (a multiple of 16: ``chunk_rows``), with its own buffers for the
    # chunk's codes, scales and (without ``by_row``) its tiles' sums, which go to out 16 x 16 at a
    # time (``_transpose16``).
    # With ``interleaved``, raw is an interleaved q4_k copy (``interleave.repack``): each chunk's
    # rows (whole groups) are put back in the stored layout in the worker's buffer first
    # (``_deinterleaved``) and unpacked from there.
    # Chunks go to whichever worker is free (a counter, ``vnni.fetch_add``): dealt in turn
    # beforehand, both threads had the same chunks whatever their speed, and an expert at
    # Mixtral's shape took 2-9% longer at 256 tokens (per-pair medians of 7 interleaved rounds:
    # q4_0 0.91-0.93, q8_0 0.91, mxfp4 0.98, q4_k 0.97; at 64 tokens 0.92-1.02).
    rows, row_bytes = raw.shape
    flat = raw.reshape(-1)
    flat_out = out.reshape(-1)
    blocks = cols // 32
    halves = 2 if kind == _HALVES else 1
    wide = span(kind, blocks)
    spans = blocks // wide
    params = spans * halves  # scales a row
    per_scale = token_span(kind, blocks)  # blocks a token's scale covers
    scaled = blocks // per_scale  # the tokens' scales a token
    # the K-quants', iq4_xs's and int4_g32's tiles (``_tile_intrinsic``'s ``shared``)
    shared = per_scale > wide
    pairs = _paired(kind, blocks, n)  # integer minimums
    # longer rows go in slices of at most TRIPLE_COLS values, whole 256s, one after another over
    # a chunk (the tiles' sums carried from one to the next), so that a slice's codes and three
    # groups' activations share L2; from three groups of tokens on (``SLICE_MIN_TOKENS``)
    slices = (cols + TRIPLE_COLS - 1) // TRIPLE_COLS if blocks % 8 == 0 and n >= SLICE_MIN_TOKENS else 1
    # tiles of three groups for rows (slices) of up to TRIPLE_COLS values, in the kinds compiled for them
    triples = (cols <= TRIPLE_COLS or slices > 1) and ((shared and (pairs or not has_minimums(kind) or wide == 2))
                                                       or kind <= 4
                                                       or (kind == _INT8 and wide == 8))
    groups = (n + LANE_TOKENS - 1) // LANE_TOKENS
    padded = groups * LANE_TOKENS
    taken = np.zeros(8, np.int64)  # chunks handed out so far (``vnni.fetch_add``)
    for worker in prange(workers):
        w = np.zeros(chunk * cols, np.uint8)
        sc = np.zeros(chunk * params, np.float32)
        mn = np.zeros(chunk * params, np.float32)
        sums = vnni.zeros64(groups * chunk * 16, np.float32)
        plain = np.empty((chunk if interleaved else 0, row_bytes), np.uint8)
        while True:
            first, count = vnni.next_chunk(taken, chunk, rows)
            if count <= 0:
                break
            source, at = raw, first  # one call of _unpack_rows, of one type (read-only): compiled once
            if interleaved:
                _deinterleaved(flat, first, count, row_bytes, plain.reshape(-1))
                source, at = plain, 0
            _unpack_rows(kind, source, at, count, source.reshape(-1), w, cols, sc, mn, params, e8m0, pairs)
            sc[count * params:] = 0  # rows past the matrix's last (their codes are stale)
            mn[count * params:] = 0
            # likely the worker's next chunk (taken in turn while both run at one speed), prefetched by the tiles,
            # each from where the last stopped and from its start again past its end: the tiles' two lines a
            # block cover several chunks' bytes at many tokens (11 at 256 for q4_k), which took L2 from this
            # chunk's codes and the activations (28672 x 4096 at 256 tokens, alternate processes, three rounds:
            # q4_k 40.8-41.5 ms against 41.8-42.5; at 64 10.7-11.1 against 11.0-11.4)
            ahead = (first + workers * chunk) * row_bytes
            if ahead >= flat.shape[0]:
                ahead = 0
            ahead_first, ahead_end = ahead, ahead + chunk * row_bytes
            direct = by_row and count == chunk  # else the sums buffer: rows past the last go nowhere
            for k in range(slices):
                b0 = blocks // 8 * k // slices * 8
                cut = blocks // 8 * (k + 1) // slices * 8 if k + 1 < slices else blocks
                last_slice = k + 1 == slices
                g = 0
                while g < groups:
                    left = groups - g  # three groups a tile where they fit, the rest by two (four: 2 + 2), then one
                    width = 3 if triples and (left == 3 or left >= 5) else 2 if left >= 2 else 1
                    pair = width == 2
                    for r in range(0, chunk, TILE_ROWS):
                        if direct:
                            target, obase, ostride, rstride = flat_out, (first + r) * padded + g * 16, 16, padded
                        else:
                            target, obase, ostride, rstride = sums, (g * chunk + r) * 16, chunk * 16, 16
                        args = (w, r * cols + b0 * 32, cols, sc, mn, r * params + b0 // wide * halves, cut - b0, act,
                                (g * blocks + b0) * 512, blocks * 512, scales, shift, dsum,
                                (g * scaled + b0 // per_scale) * 16, scaled * 16, target, obase, ostride, rstride,
                                flat, ahead, k, g * scaled * 16 if last_slice else -1)
                        ahead += (cut - b0) * 128
                        if ahead >= ahead_end:
                            ahead = ahead_first
                        if shared and kind == _HALVES:
                            if width == 3:
                                _tile_three_halves_k(*args)
                            elif pair:
                                _tile_pair_halves_k(*args)
                            else:
                                _tile_one_halves_k(*args)
                        elif shared and not has_minimums(kind):  # iq4_xs; q8_0, q4_0, mxfp4, iq4_nl in whole 256s
                            if width == 3:
                                _tile_three_k(*args)
                            elif pair:
                                _tile_pair_k(*args)
                            else:
                                _tile_one_k(*args)
                        elif pairs:  # q4_k, q5_k, int4_g32 from PAIRED_INT4_TOKENS on: integer minimums
                            if width == 3:
                                _tile_three_pairs_k(*args)
                            elif pair:
                                _tile_pair_pairs_k(*args)
                            else:
                                _tile_one_pairs_k(*args)
                        elif shared and wide == 2:  # int4_g64: spans of two blocks, four a token scale
                            if width == 3:
                                _tile_three_minimums_k2(*args)
                            elif pair:
                                _tile_pair_minimums_k2(*args)
                            else:
                                _tile_one_minimums_k2(*args)
                        elif shared:  # int4_g32, fewer tokens
                            if pair:
                                _tile_pair_minimums_k(*args)
                            else:
                                _tile_one_minimums_k(*args)
                        elif kind == _HALVES:
                            if pair:
                                _tile_pair_halves(*args)
                            else:
                                _tile_one_halves(*args)
                        elif has_minimums(kind):  # int4 in rows not whole 256s (g32, g64: spans of 2), g128 (4)
                            if wide == 4:
                                if pair:
                                    _tile_pair_minimums_4(*args)
                                else:
                                    _tile_one_minimums_4(*args)
                            elif wide == 2:
                                if pair:
                                    _tile_pair_minimums_2(*args)
                                else:
                                    _tile_one_minimums_2(*args)
                            elif pair:
                                _tile_pair_minimums(*args)
                            else:
                                _tile_one_minimums(*args)
                        elif wide == 8:  # int8
                            if width == 3:
                                _tile_three_8(*args)
                            elif pair:
                                _tile_pair_8(*args)
                            else:
                                _tile_one_8(*args)
                        elif width == 3:
                            _tile_three(*args)
                        elif pair:
                            _tile_pair(*args)
                        else:
                            _tile_one(*args)
                    g += width
            if direct:
                continue
            if by_row:
                for g in range(groups):
                    for r in range(count):
                        flat_out[(first + r) * padded + g * 16:(first + r) * padded + g * 16 + 16] = \
                            sums[(g * chunk + r) * 16:(g * chunk + r) * 16 + 16]
                continue
            whole = n // LANE_TOKENS if count == chunk else 0  # groups of 16 tokens by 16 rows
            for g in range(whole):
                for r in range(0, chunk, LANE_TOKENS):
                    _transpose16(sums, (g * chunk + r) * 16, flat_out, g * LANE_TOKENS * rows + first + r, rows)
            for t in range(whole * LANE_TOKENS, n):
                g, lane = t // LANE_TOKENS, t % LANE_TOKENS
                for r in range(count):
                    out[t, first + r] = sums[(g * chunk + r) * 16 + lane]


@njit(cache=True, nogil=True)
def _deinterleaved(flat, first, count, row_bytes, plain):  # pragma: no cover - compiled
    # Rows first..first + count (whole groups) of an interleaved q4_k copy at flat, into plain
    # in the stored layout: each group's super-block is 36 lines of its 16 rows' four-byte words,
    # the first 32 put back 16 x 16 at a time through registers (``_transpose16``, the bits
    # moved as float32 lanes), the last 4 one by one.
    src, dst = flat.view(np.float32), plain.view(np.float32)
    src_words, dst_words = flat.view(np.uint32), plain.view(np.uint32)
    words = row_bytes // 4
    block_words = interleave.K_BLOCK // 4
    unit = interleave.GROUP * block_words  # a group's super-block, in words
    for g in range(count // interleave.GROUP):
        for i in range(words // block_words):
            s = (first + interleave.GROUP * g) * words + i * unit
            o = interleave.GROUP * g * words + i * block_words
            _transpose16(src, s, dst, o, words)
            _transpose16(src, s + 256, dst, o + 16, words)
            for k in range(32, block_words):
                for r in range(interleave.GROUP):
                    dst_words[o + r * words + k] = src_words[s + interleave.GROUP * k + r]


def chunk_rows(n: int, rows: int, cols: int, workers: int) -> int:
    """Rows a worker of ``matmul`` unpacks and multiplies at a time for n tokens times rows of
    ``cols`` values: WIDE_CHUNK_ROWS where the matrix still makes 8 chunks a worker, from 48 tokens
    on or for rows of up to 4096 values, else CHUNK_ROWS. Every token's activations pass through the
    cache once a chunk: at 256 tokens 48 rows took 40.2-41.5 ms for q4_0's 28672 x 4096 against
    44.8-46.9 with 16, 21.6-21.9 against 22.8 for 4096 x 14336, 0.66 against 0.89-1.41 for 2048 x
    768, and a whole expert of Qwen3-30B-A3B's shape 5-19% less at 40-96 tokens, 1-3% at 16-32; at
    16-32 tokens the 14336-value rows took 6% longer with 48 (2.17-2.20 ms against 2.02 at 16)."""
    wide = n > 2 * LANE_TOKENS or cols <= 4096
    return WIDE_CHUNK_ROWS if wide and rows >= 8 * workers * WIDE_CHUNK_ROWS else CHUNK_ROWS


def fits(scheme: str, cols: int) -> bool:
    """Whether ``matmul`` takes matrices of ``scheme`` with rows of ``cols`` values."""
    kind = KINDS.get(scheme)
    return vnni.HAVE_VNNI and vnni._COMPILED and kind is not None and cols % _VALUES[kind] == 0


def matmul(x: np.ndarray, raw: np.ndarray, scheme: str, by_row: bool = False, out: np.ndarray | None = None,
           interleaved: bool = False) -> np.ndarray:
    """``x @ W.T`` (float32 [n, rows]) for tokens x [n, cols] and one matrix of ``KINDS`` stored
    as C-contiguous uint8 rows ``raw`` (``fits``), without decoding it: each token's activations
    quantized to int8 per 256 values where the rows are whole 256s, else per 32 (or per int4
    group: ``token_span``). With ``by_row`` its
    transpose instead, [rows, n rounded up to a multiple of 16] (the tokens past n: zeros).
    Into ``out`` where given (C-contiguous float32 of that shape). With ``interleaved``, raw
    is a q4_k matrix's interleaved copy (``interleave.repack``)."""
    x = writable(np.ascontiguousarray(x, dtype=np.float32))
    return product(quantized(x, scheme), x.shape[0], x.shape[1], raw, scheme, by_row, out, interleaved)


def product(activations: tuple[np.ndarray, ...], n: int, cols: int, raw: np.ndarray, scheme: str,
            by_row: bool = False, out: np.ndarray | None = None, interleaved: bool = False) -> np.ndarray:
    """``matmul`` of n tokens of cols values already quantized for ``scheme`` (``quantized``,
    ``activated``)."""
    if interleaved and scheme not in interleave.K_SCHEMES:
        raise ValueError(f"only {', '.join(interleave.K_SCHEMES)} copies are read here, not {scheme}'s")
    raw = read_only(raw)
    rows = raw.shape[0]
    padded = (n + LANE_TOKENS - 1) // LANE_TOKENS * LANE_TOKENS
    if out is None:
        out = np.empty((rows, padded) if by_row else (n, rows), dtype=np.float32)
    threads = get_num_threads()
    chunk = chunk_rows(n, rows, cols, threads)
    chunks = (rows + chunk - 1) // chunk
    _matmul(raw, KINDS[scheme], vnni._tables()[1], *activations, n, cols, max(1, min(threads, chunks)), out,
            by_row, chunk, interleaved)
    return out

