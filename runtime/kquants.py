"""Kernels for ggml's K-quants and IQ4 types (q2_k, q3_k, q4_k, q5_k, q6_k, iq4_nl, iq4_xs), kept
at the bytes a GGUF stores (layouts in ``ktc.formats.codec_kquants``): the CPU's one-token and
decode kernels (Numba) and the device decoder (torch), which ``kernels`` and ``device`` register
under the scheme's name.

One token on the CPU: the K-quants and iq4_xs through AVX-512 VNNI where the CPU has it, a row
in one LLVM loop (codes assembled from their bit planes in vector registers, activations
quantized to int8 as llama.cpp does), also for every selected expert of a layer at once
(``rows.rows_many``); iq4_nl through vnni's block kernels (its blocks are q4_0's with a level
table); every type without VNNI decodes each block into a float32 buffer that stays in L1 and
multiplies it by the activations there (the float path). Decoding is bit for bit the ``gguf`` package's (float32 products in its order, no fused multiply-add), which the
tests check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ktc.formats.float_bits import F16_TO_F32 as _F16_TO_F32
from ktc.formats.float_bits import put_decoded
from ktc.formats.kernel_args import read_only, writable
from ktc.formats.schemes import get_scheme

from . import vnni

KINDS = {"q2_k": 0, "q3_k": 1, "q4_k": 2, "q5_k": 3, "q6_k": 4, "iq4_nl": 5, "iq4_xs": 6}
# the kinds that read the activations per 256: q4_k and q5_k in one layout, q6_k in order
PER_256 = ("q4_k", "q5_k", "q6_k")
# iq4_nl's and iq4_xs's 16 levels (ggml's kvalues_iq4nl).
IQ4_LEVELS_INT = vnni.IQ4_LEVELS_INT
IQ4_LEVELS = np.array(IQ4_LEVELS_INT, dtype=np.float32)


@njit(cache=True, nogil=True, inline="always")
def _f16(raw, r, at, table):  # pragma: no cover - compiled
    return table[np.uint16(raw[r, at]) | (np.uint16(raw[r, at + 1]) << np.uint16(8))]


@njit(cache=True, nogil=True, inline="always")
def _scale_min_k4(raw, r, base, j):  # pragma: no cover - compiled
    # q4_k/q5_k: the 6-bit scale and minimum of sub-block j from the 12 bytes at base
    if j < 4:
        return np.int32(raw[r, base + j] & 63), np.int32(raw[r, base + 4 + j] & 63)
    sc = (np.int32(raw[r, base + 4 + j]) & 15) | ((np.int32(raw[r, base + j - 4]) >> 6) << 4)
    mn = (np.int32(raw[r, base + 4 + j]) >> 4) | ((np.int32(raw[r, base + j]) >> 6) << 4)
    return sc, mn


@njit(cache=True, nogil=True, inline="always")
def _block(kind, raw, r, base, table, levels, buf):  # pragma: no cover - compiled
    # The values of the block of type ``kind`` at byte ``base`` of row r, into buf.
    if kind == 0:  # q2_k: scales[16] qs[64] d dmin
        d = _f16(raw, r, base + 80, table)
        dmin = _f16(raw, r, base + 82, table)
        for i in range(16):
            s = np.int32(raw[r, base + i])
            dl = d * np.float32(s & 15)
            ml = dmin * np.float32(s >> 4)
            n = i // 8
            shift = 2 * ((i // 2) % 4)
            lo = (i % 2) * 16
            for k in range(16):
                q = (np.int32(raw[r, base + 16 + n * 32 + lo + k]) >> shift) & 3
                buf[i * 16 + k] = dl * np.float32(q) - ml
    elif kind == 1:  # q3_k: hmask[32] qs[64] scales[12] d
        d = _f16(raw, r, base + 108, table)
        for i in range(16):
            low = (np.int32(raw[r, base + 96 + i % 8]) >> (4 * (i // 8))) & 15
            high = (np.int32(raw[r, base + 104 + i % 4]) >> (2 * (i // 4))) & 3
            dl = d * np.float32((low | (high << 4)) - 32)
            for k in range(16):
                v = i * 16 + k
                n = v // 128
                s = (v // 32) % 4
                l = v % 32
                q = (np.int32(raw[r, base + 32 + n * 32 + l]) >> (2 * s)) & 3
                h = (np.int32(raw[r, base + l]) >> (v // 32)) & 1
                buf[v] = dl * np.float32(q - 4 * (1 - h))
    elif kind == 2 or kind == 3:  # q4_k: d dmin scales[12] qs[128]; q5_k: qh[32] before qs
        d = _f16(raw, r, base, table)
        dmin = _f16(raw, r, base + 2, table)
        codes = base + 16 if kind == 2 else base + 48
        for j in range(8):
            sc, mn = _scale_min_k4(raw, r, base + 4, j)
            dl = d * np.float32(sc)
            ml = dmin * np.float32(mn)
            shift = 4 * (j % 2)
            for l in range(32):
                q = (np.int32(raw[r, codes + (j // 2) * 32 + l]) >> shift) & 15
                if kind == 3:
                    q |= ((np.int32(raw[r, base + 16 + l]) >> j) & 1) << 4
                buf[j * 32 + l] = dl * np.float32(q) - ml
    elif kind == 4:  # q6_k: ql[128] qh[64] scales[16] (int8) d
        d = _f16(raw, r, base + 208, table)
        for i in range(16):
            dl = d * np.float32(np.int8(raw[r, base + 192 + i]))
            for k in range(16):
                v = i * 16 + k
                n = v // 128
                w = v % 128
                lq = (np.int32(raw[r, base + n * 64 + w % 64]) >> (4 * (w // 64))) & 15
                hq = (np.int32(raw[r, base + 128 + n * 32 + w % 32]) >> (2 * (w // 32))) & 3
                buf[v] = dl * np.float32((lq | (hq << 4)) - 32)
    elif kind == 5:  # iq4_nl: d qs[16]
        d = _f16(raw, r, base, table)
        for j in range(16):
            c = np.int32(raw[r, base + 2 + j])
            buf[j] = d * levels[c & 15]
            buf[j + 16] = d * levels[c >> 4]
    else:  # iq4_xs: d scales_h(u16) scales_l[4] qs[128]
        d = _f16(raw, r, base, table)
        high = np.int32(raw[r, base + 2]) | (np.int32(raw[r, base + 3]) << 8)
        for ib in range(8):
            low = (np.int32(raw[r, base + 4 + ib // 2]) >> (4 * (ib % 2))) & 15
            dl = d * np.float32((low | (((high >> (2 * ib)) & 3) << 4)) - 32)
            for j in range(16):
                c = np.int32(raw[r, base + 8 + ib * 16 + j])
                buf[ib * 32 + j] = dl * levels[c & 15]
                buf[ib * 32 + 16 + j] = dl * levels[c >> 4]


_ROWS_PER_ITEM = 8  # rows per parallel work item: one buffer allocation serves them all


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _matvec(raw, kind, elems, block_bytes, x, table, levels, out):  # pragma: no cover - compiled
    rows = raw.shape[0]
    blocks = x.shape[0] // elems
    for item in prange((rows + _ROWS_PER_ITEM - 1) // _ROWS_PER_ITEM):
        buf = np.empty(elems, dtype=np.float32)
        acc = np.empty(16, dtype=np.float32)
        for r in range(item * _ROWS_PER_ITEM, min(rows, (item + 1) * _ROWS_PER_ITEM)):
            acc[:] = 0.0
            for b in range(blocks):
                _block(kind, raw, r, b * block_bytes, table, levels, buf)
                xb = b * elems
                for j in range(0, elems, 16):
                    for lane in range(16):
                        acc[lane] += buf[j + lane] * x[xb + j + lane]
            out[r] = acc.sum()


@njit(cache=True, nogil=True, parallel=True)
def _decode(raw, cols, kind, elems, block_bytes, table, levels, bf16, out32, out16):  # pragma: no cover - compiled
    # No fastmath: the values are the gguf package's bit for bit (no fused multiply-add).
    for r in prange(raw.shape[0]):
        buf = np.empty(elems, dtype=np.float32)
        for b in range(cols // elems):
            _block(kind, raw, r, b * block_bytes, table, levels, buf)
            for j in range(elems):
                put_decoded(bf16, out32, out16, r, b * elems + j, buf[j])


# ------------------------------------------------------------------------------------------------
# One token through the K-quants and iq4_xs on a VNNI CPU: q4_k, q5_k and q6_k against the
# activations quantized to int8 per 256 (``_q45_k_intrinsic``, ``_q6_k_whole_row``), the others
# per 32 (``_superblock_intrinsic``); each super-block's codes assembled from their bit planes
# into unsigned bytes in vector registers.


@njit(cache=True, nogil=True, parallel=True)
def _decode_q45_k(raw, cols, five, table, bf16, out32, out16):  # pragma: no cover - compiled
    # q4_k / q5_k decoded a sub-block of 32 at a time (the batched path's decoder: the generic
    # one goes value by value). The same float32 arithmetic as the gguf package.
    block_bytes = 176 if five else 144
    codes_at = 48 if five else 16
    for r in prange(raw.shape[0]):
        row = raw[r]
        for b in range(cols // 256):
            at = b * block_bytes
            d = _f16(raw, r, at, table)
            dmin = _f16(raw, r, at + 2, table)
            for j in range(8):
                sc, m = _scale_min_k4(raw, r, at + 4, j)
                dl = d * np.float32(sc)
                ml = dmin * np.float32(m)
                codes = row[at + codes_at + (j // 2) * 32: at + codes_at + (j // 2) * 32 + 32]
                high = row[at + 16: at + 48]
                shift = np.uint8(4 * (j % 2))
                for l in range(32):
                    q = (codes[l] >> shift) & np.uint8(15)
                    if five:
                        q |= ((high[l] >> np.uint8(j)) & np.uint8(1)) << np.uint8(4)
                    put_decoded(bf16, out32, out16, r, b * 256 + j * 32 + l, dl * np.float32(q) - ml)


@njit(cache=True, nogil=True, parallel=True)
def _decode_q6_k(raw, cols, table, bf16, out32, out16):  # pragma: no cover - compiled
    for r in prange(raw.shape[0]):
        row = raw[r]
        for b in range(cols // 256):
            at = b * 210
            d = _f16(raw, r, at + 208, table)
            for n in range(2):
                ql = row[at + 64 * n: at + 64 * n + 64]
                qh = row[at + 128 + 32 * n: at + 160 + 32 * n]
                for s in range(4):
                    shift_l = np.uint8(4 * (s // 2))
                    shift_h = np.uint8(2 * s)
                    for half in range(2):
                        dl = d * np.float32(np.int8(row[at + 192 + 8 * n + 2 * s + half]))
                        for k in range(16):
                            l = 16 * half + k
                            u = ((ql[32 * (s % 2) + l] >> shift_l) & np.uint8(15)) | \
                                (((qh[l] >> shift_h) & np.uint8(3)) << np.uint8(4))
                            put_decoded(bf16, out32, out16, r, b * 256 + n * 128 + s * 32 + l,
                                 dl * np.float32(np.int32(u) - 32))


def _superblock_intrinsic(kind: str):  # type: ignore[no-untyped-def]
    """``row(flat, at, blocks, xq, dx, sums) -> float32``: the dot product of the ``blocks``
    super-blocks of ``kind`` (q2_k, q3_k, iq4_xs; q4_k, q5_k and q6_k have their own, against
    activations per 256) from byte ``at`` of ``flat`` times the int8 activations ``xq`` (``dx``:
    their scale per 32 values; ``sums``: for iq4_xs the dequantized activations' sum per 32, for
    q3_k the int8 sums per 16, for q2_k the dequantized sums per 16), each super-block with its
    own float scales d and dmin (fp16, converted by the CPU). Everything in vector registers: the
    sub-block scales unpacked with shuffles, the codes assembled from their bit planes 64
    values at a time (four sub-blocks of q2_k/q3_k, which vpdpbusd's 16 lanes keep apart: lane k
    holds values 4k to 4k + 3), each lane scaled by its sub-block's scale, the minimum (q2_k) or
    the offset (q3_k) taken off through the sums; the lanes added once a row."""
    from llvmlite import ir

    i8, i32, f32 = ir.IntType(8), ir.IntType(32), ir.FloatType()
    v8, v16, v32, v64 = (ir.VectorType(i8, n) for n in (8, 16, 32, 64))
    words, floats, floats8 = ir.VectorType(i32, 16), ir.VectorType(f32, 16), ir.VectorType(f32, 8)

    @intrinsic
    def row(typingctx, flat, at, blocks, xq, dx, sums):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            at0_v, blocks_v = (context.cast(builder, args[k], signature.args[k], types.intp) for k in (1, 2))
            arrays = [context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 3, 4, 5)]
            flat_a, xq_a, dx_a, sums_a = arrays

            def load(array, index, vector, offset=0):  # type: ignore[no-untyped-def]
                at_index = builder.add(index, ir.Constant(index.type, offset))
                pointer = builder.bitcast(builder.gep(array.data, [at_index]), vector.as_pointer())
                return builder.load(pointer, align=1)

            def const(vector, values):  # type: ignore[no-untyped-def]
                values = values if isinstance(values, list) else [values] * vector.count
                return ir.Constant(vector, values)

            def shuffle(a, b, mask):  # type: ignore[no-untyped-def]
                return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(i32, len(mask)), mask))

            def splat(value, vector):  # type: ignore[no-untyped-def]
                one = builder.insert_element(ir.Constant(vector, ir.Undefined), value, ir.Constant(i32, 0))
                return shuffle(one, one, [0] * vector.count)

            def to_float(bytes_, signed):  # type: ignore[no-untyped-def]
                n = bytes_.type.count
                wide = (builder.sext if signed else builder.zext)(bytes_, ir.VectorType(i32, n))
                return builder.sitofp(wide, ir.VectorType(f32, n))

            block_bytes = {"q2_k": 84, "q3_k": 110, "iq4_xs": 136}[kind]
            d_at = {"q2_k": 80, "q3_k": 108, "q6_k": 208}.get(kind, 0)
            dmin_at = 82 if kind == "q2_k" else 2
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(floats, [floats] * 3),
                                                 "llvm.fma.v16f32")
            total_p = cgutils.alloca_once_value(builder, ir.Constant(floats, [0.0] * 16))

            def half(index, offset):  # type: ignore[no-untyped-def]
                bits = load(flat_a, index, ir.IntType(16), offset)
                return builder.fpext(builder.bitcast(bits, ir.HalfType()), f32)

            # The super-blocks in LLVM's own loop, the accumulator a register: one load and store
            # of ``acc`` a row (a call a super-block, with acc stored and loaded between them and
            # d and dmin looked up in Numba, read q6_k rows at 21-23 GB/s on two cores at most).
            with cgutils.for_range(builder, blocks_v) as loop:
                at_v = builder.add(at0_v, builder.mul(loop.index, ir.Constant(loop.index.type, block_bytes)))
                xbase_v = builder.mul(loop.index, ir.Constant(loop.index.type, 256))
                d_v, dmin_v = half(at_v, d_at), half(at_v, dmin_at)
                group = builder.sdiv(xbase_v, ir.Constant(xbase_v.type, 32))  # activation group of 32
                # Ask for the weights 4 KB ahead, every cache line of a super-block (as the other block
                # kinds' rows do: long rows read a third faster with it here).
                vnni._prefetch_ahead(builder, flat_a, at_v, block_bytes)
                dot_fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(words, [words] * 3),
                                                        "llvm.x86.avx512.vpdpbusd.512")
                total = builder.load(total_p)

                def add(codes, x_offset, lane_scale):  # type: ignore[no-untyped-def]
                    nonlocal total
                    dot = builder.call(dot_fn, [const(words, 0), builder.bitcast(codes, words),
                                                builder.bitcast(load(xq_a, xbase_v, v64, x_offset), words)])
                    total = builder.call(fma, [builder.sitofp(dot, floats), lane_scale, total])

                if kind == "iq4_xs":  # d, scales_h (u16), scales_l[4], qs[128]; the sums per 32
                    # eight 6-bit scales: low 4 bits from scales_l's nibbles, high 2 bits from scales_h
                    low4 = load(flat_a, at_v, ir.VectorType(i8, 4), 4)
                    nibbles = builder.lshr(shuffle(low4, low4, [k // 2 for k in range(8)]), const(v8, [0, 4] * 4))
                    high = load(flat_a, at_v, ir.VectorType(ir.IntType(16), 1), 2)
                    high8 = builder.trunc(builder.lshr(shuffle(high, high, [0] * 8),
                                                       const(ir.VectorType(ir.IntType(16), 8), [2 * k for k in range(8)])), v8)
                    ls = builder.or_(builder.and_(nibbles, const(v8, 15)), builder.shl(builder.and_(high8, const(v8, 3)),
                                                                                        const(v8, 4)))
                    signed = builder.sub(ls, const(v8, 32))
                    weights = builder.fmul(to_float(signed, True), splat(d_v, floats8))  # d x scale per 32
                    scales = builder.fmul(weights, load(dx_a, group, floats8))
                    # levels + 128 are unsigned bytes for vpdpbusd; 128 x the activations' dequantized sum
                    # (dx x their codes' sum) times the weights' scale is taken off
                    offset = builder.fmul(builder.fmul(weights, load(sums_a, group, floats8)), const(floats8, 128.0))
                    total = builder.fsub(total, shuffle(offset, const(floats8, 0.0), list(range(8)) + [8] * 8))
                    lut_fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v64, [v64, v64]),
                                                            "llvm.x86.avx512.pshuf.b.512")
                    lut = const(v64, list(vnni.IQ4_PLUS_128) * 4)
                    for pair in range(4):
                        parts = []
                        for ib in (2 * pair, 2 * pair + 1):
                            packed = load(flat_a, at_v, v16, 8 + 16 * ib)
                            parts.append(shuffle(builder.and_(packed, const(v16, 15)), builder.lshr(packed, const(v16, 4)),
                                                 list(range(32))))
                        codes = builder.call(lut_fn, [lut, shuffle(parts[0], parts[1], list(range(64)))])
                        add(codes, 64 * pair, shuffle(scales, scales, [2 * pair] * 8 + [2 * pair + 1] * 8))
                elif kind in ("q2_k", "q3_k"):
                    # sums: q2_k the dequantized activations' sums per 16 (for its minimums), q3_k the
                    # int8 sums per 16 (for its offset of 4)
                    dx16 = shuffle(load(dx_a, group, floats8), const(floats8, 0.0), [k // 2 for k in range(16)])
                    sums16 = load(sums_a, builder.mul(group, ir.Constant(group.type, 2)), floats)
                    if kind == "q2_k":  # scales[16] (scale low nibble, minimum high) qs[64] d dmin
                        sb = load(flat_a, at_v, v16, 0)
                        scales = builder.fmul(builder.fmul(to_float(builder.and_(sb, const(v16, 15)), False),
                                                           splat(d_v, floats)), dx16)
                        minimum = builder.fmul(to_float(builder.lshr(sb, const(v16, 4)), False), splat(dmin_v, floats))
                        total = builder.fsub(total, builder.fmul(minimum, sums16))
                        qs_at, hmask = 16, None
                    else:  # q3_k: hmask[32] qs[64] scales[12] (6-bit, offset 32) d
                        low8 = load(flat_a, at_v, v8, 96)
                        high4 = load(flat_a, at_v, ir.VectorType(i8, 4), 104)
                        low = builder.and_(builder.lshr(shuffle(low8, low8, [k % 8 for k in range(16)]),
                                                        const(v16, [0] * 8 + [4] * 8)), const(v16, 15))
                        high = builder.and_(builder.lshr(shuffle(high4, high4, [k % 4 for k in range(16)]),
                                                         const(v16, [2 * (k // 4) for k in range(16)])), const(v16, 3))
                        signed = builder.sub(builder.or_(low, builder.shl(high, const(v16, 4))), const(v16, 32))
                        scales = builder.fmul(builder.fmul(to_float(signed, True), splat(d_v, floats)), dx16)
                        total = builder.fsub(total, builder.fmul(builder.fmul(scales, sums16), const(floats, 4.0)))
                        qs_at, hmask = 32, load(flat_a, at_v, v32, 0)
                    for n in range(2):
                        q = load(flat_a, at_v, v32, qs_at + 32 * n)
                        for t in range(2):
                            halves = []
                            for s in (2 * t, 2 * t + 1):
                                u = builder.and_(builder.lshr(q, const(v32, 2 * s)), const(v32, 3))
                                if hmask is not None:  # the third bit: bit 4n + s of hmask's byte l
                                    h = builder.and_(builder.lshr(hmask, const(v32, 4 * n + s)), const(v32, 1))
                                    u = builder.or_(u, builder.shl(h, const(v32, 2)))
                                halves.append(u)
                            add(shuffle(halves[0], halves[1], list(range(64))), 128 * n + 64 * t,
                                shuffle(scales, scales, [8 * n + 4 * t + k // 4 for k in range(16)]))
                builder.store(total, total_p)
            return vnni._reduce_lanes(builder, builder.load(total_p), builder.fadd)

        return types.float32(flat, at, blocks, xq, dx, sums), codegen

    return row


def _superblock_ops(builder, fn, vec):  # type: ignore[no-untyped-def]
    """The LLVM functions of the per-256 products (q4_k, q5_k, q6_k): vpmaddubsw, vpdpwssd, a
    16-lane fused multiply-add and vpmaddwd (256-bit)."""
    from llvmlite import ir

    i8, i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
    v64, w32, d16, f16v = vec(i8, 64), vec(i16, 32), vec(i32, 16), vec(f32, 16)
    return (fn("llvm.x86.avx512.pmaddubs.w.512", w32, [v64, v64]), fn("llvm.x86.avx512.vpdpwssd.512", d16, [d16] * 3),
            fn("llvm.fma.v16f32", f16v, [f16v] * 3), fn("llvm.x86.avx2.pmadd.wd", vec(i32, 8), [vec(i16, 16)] * 2))


def _k_intrinsic(emit, tokens: int, rows: int):  # type: ignore[no-untyped-def]
    """The intrinsic around a per-256 K-quant loop ``emit(builder, flat, yk, dk, bsum, at_list,
    blocks, y_bases, d_bases, b_bases) -> sums[row][token]`` (q4_k, q5_k, q6_k). Without
    ``tokens``: ``row(flat, at, blocks, yk, ybase, dk, bsum) -> float32``, one row times the
    activations at yk[ybase] (q6_k reads them in order after q4_k's layout; q4_k and q5_k from 0).
    With ``tokens``, the batched path's tile: ``tile(flat, at, rstride, blocks, yk, ybase, ystride,
    dk, dstride, bsum, bstride, out, obase, ostride)``, ``rows`` rows (row r at byte at + r *
    rstride) times ``tokens`` tokens (token t's activations at yk[ybase + t * ystride], dk[t *
    dstride], bsum[t * bstride]), products stored at out[obase + t * ostride + r]: each
    super-block unpacked once for all the tokens."""
    from llvmlite import ir

    if not tokens:
        @intrinsic
        def row(typingctx, flat, at, blocks, yk, ybase, dk, bsum):  # type: ignore[no-untyped-def]
            def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
                flat_a, yk_a, dk_a, bsum_a = vnni._arrays(context, builder, signature, args, (0, 3, 5, 6))
                at0, nblocks, ybase0 = vnni._indices(context, builder, signature, args, (1, 2, 4))
                zero = ir.Constant(at0.type, 0)
                return emit(builder, flat_a, yk_a, dk_a, bsum_a, [at0], nblocks, [ybase0], [zero], [zero])[0][0]

            return types.float32(flat, at, blocks, yk, ybase, dk, bsum), codegen

        return row

    @intrinsic
    def tile(typingctx, flat, at, rstride, blocks, yk, ybase, ystride, dk, dstride, bsum, bstride, out, obase,
             ostride):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            flat_a, yk_a, dk_a, bsum_a, out_a = vnni._arrays(context, builder, signature, args, (0, 4, 7, 9, 11))
            at0, rstride_v, nblocks, ybase0, ystride_v, dstride_v, bstride_v, obase_v, ostride_v = vnni._indices(
                context, builder, signature, args, (1, 2, 3, 5, 6, 8, 10, 12, 13))
            zero = ir.Constant(at0.type, 0)
            at_list = [vnni._nth(builder, at0, rstride_v, r) for r in range(rows)]
            bases = ([vnni._nth(builder, base, stride, t) for t in range(tokens)]
                     for base, stride in ((ybase0, ystride_v), (zero, dstride_v), (zero, bstride_v)))
            sums = emit(builder, flat_a, yk_a, dk_a, bsum_a, at_list, nblocks, *bases)
            vnni._store_tile(builder, out_a, sums, obase_v, ostride_v)
            return context.get_dummy_value()

        return (types.void(flat, at, rstride, blocks, yk, ybase, ystride, dk, dstride, bsum, bstride, out, obase,
                           ostride), codegen)

    return tile


def _q45_k_intrinsic(five: bool, tokens: int = 0, rows: int = 1):  # type: ignore[no-untyped-def]
    """``row(flat, at, blocks, yk, ybase, dk, bsum) -> float32`` (``_k_intrinsic``; ybase 0): the
    dot product of the ``blocks``
    q4_k super-blocks (with ``five``, q5_k: the same scales, minimums and nibbles, and a fifth
    bit per code from its 32 ``qh`` bytes, 16 where set) at byte ``at`` of ``flat`` times
    activations quantized per 256 values (``vnni.quantize_superblocks``: int8 ``yk`` in its layout,
    scale ``dk`` per 256, int16 sums per 16 ``bsum``), as llama.cpp's q4_K x q8_K product does:
    a super-block's products summed in integers (vpmaddubsw pairs codes and activations,
    vpdpwssd scales the pairs by their sub-block's 6-bit scale), one float multiply-add a
    super-block, the minimums through the sums. Each 64-byte load of codes holds two 32-byte
    chunks: its low nibbles are sub-blocks 4h and 4h + 2, its high nibbles 4h + 1 and 4h + 3,
    which is how the activations are laid out. The 6-bit scales and minimums are unpacked in
    64-bit integer registers. Against per-32 activations (a float scale and multiply-add per 64
    values) 1.4x the rows a second from the cache on one core (q4_k), 1.1x (q5_k). With
    ``tokens``, the batched path's tile of ``rows`` x ``tokens`` (``_k_intrinsic``)."""
    from llvmlite import ir

    i8, i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
    i64 = ir.IntType(64)
    size, codes_at = (176, 48) if five else (144, 16)  # bytes a super-block; where its nibbles start

    def emit(builder, flat_a, yk_a, dk_a, bsum_a, at_list, nblocks, y_bases, d_bases,  # type: ignore[no-untyped-def]
             b_bases):
        # the loop over the super-blocks of the rows at bytes ``at_list``; the rows' products
        # with each token's activations (bases of yk, dk, bsum), [row][token]
        c, vec, load, const, shuffle, splat, fn = vnni.emitters(builder, at_list[0].type)
        maddubs, dpwssd, fma16, maddwd = _superblock_ops(builder, fn, vec)
        v64, d16, f16v, f8v = vec(i8, 64), vec(i32, 16), vec(f32, 16), vec(f32, 8)
        fma8 = fn("llvm.fma.v8f32", f8v, [f8v] * 3)
        v16 = vec(i8, 16)

        def c64(v):  # type: ignore[no-untyped-def]
            return ir.Constant(i64, v)

        def bytes64(value):  # type: ignore[no-untyped-def]
            return ir.Constant(i64, int.from_bytes(bytes([value] * 8), "little"))

        def unpack(at):  # type: ignore[no-untyped-def]
            # a super-block's d and dmin (float), its scales and minimums (sc 0-7, mn 8-15 as
            # int16 lanes) and its codes: (codes, activations' offset, the two sub-blocks)
            vnni._prefetch_ahead(builder, flat_a, at, size, vnni._AGAIN if tokens else vnni._ONCE)
            d = builder.fpext(builder.bitcast(load(flat_a, at, i16, 0), ir.HalfType()), f32)
            dmin = builder.fpext(builder.bitcast(load(flat_a, at, i16, 2), ir.HalfType()), f32)
            # The 12 bytes of 6-bit scales and minimums unpacked in 64-bit integer registers (as
            # llama.cpp does in 32-bit ones): the integer units are idle beside the vector work,
            # where byte-wise shifts and shuffles took a fifth of the row's time. lo holds bytes
            # 0-7, hi bytes 8-11 (the low nibbles for the scales 4-7 in its low half, the high
            # nibbles for the minimums 4-7 in its high half); sc 0-7 and mn 0-7 come out as bytes.
            lo = load(flat_a, at, i64, 4)
            h32 = builder.zext(load(flat_a, at, i32, 12), i64)
            hi = builder.and_(builder.or_(h32, builder.shl(builder.lshr(h32, c64(4)), c64(32))), bytes64(15))
            upper = builder.or_(hi, builder.shl(builder.and_(builder.lshr(lo, c64(6)), bytes64(3)), c64(4)))
            lower = builder.and_(lo, bytes64(63))
            low32 = ir.Constant(i64, 0xFFFFFFFF)
            sc = builder.or_(builder.and_(lower, low32), builder.shl(upper, c64(32)))
            mn = builder.or_(builder.lshr(lower, c64(32)), builder.and_(upper, ir.Constant(i64, 0xFFFFFFFF << 32)))
            pair = builder.insert_element(builder.insert_element(ir.Constant(vec(i64, 2), ir.Undefined), sc,
                                                                 ir.Constant(i32, 0)), mn, ir.Constant(i32, 1))
            scmn = builder.zext(builder.bitcast(pair, v16), vec(i16, 16))
            if five:  # the 32 bytes of fifth bits, twice: the first 32 codes of a load, then the next
                qh32 = load(flat_a, at, vec(i8, 32), 16)
                qh = shuffle(qh32, qh32, list(range(32)) * 2)
            codes = []
            for half in range(2):
                packed = load(flat_a, at, v64, codes_at + 64 * half)
                low = builder.and_(packed, const(v64, 15))
                high = builder.lshr(packed, const(v64, 4))
                for nibbles, k, subs in ((low, 0, (4 * half, 4 * half + 2)),
                                         (high, 64, (4 * half + 1, 4 * half + 3))):
                    if five:  # bit s of qh[l]: the fifth bit of value l of sub-block s
                        bits = const(v64, [1 << (subs[0])] * 32 + [1 << (subs[1])] * 32)
                        set_ = builder.icmp_unsigned("!=", builder.and_(qh, bits), const(v64, 0))
                        nibbles = builder.or_(nibbles, builder.select(set_, const(v64, 16), const(v64, 0)))
                    lanes = builder.bitcast(shuffle(scmn, scmn, [subs[0]] * 16 + [subs[1]] * 16), d16)
                    codes.append((nibbles, 128 * half + k, lanes))
            # minimums: each minimum (twice) beside the activations' sums of its two halves
            return d, dmin, shuffle(scmn, scmn, [8 + j // 2 for j in range(16)]), codes

        totals = [[cgutils.alloca_once_value(builder, const(f16v, 0.0)) for _ in y_bases] for _ in at_list]
        mins = [[cgutils.alloca_once_value(builder, const(f8v, 0.0)) for _ in y_bases] for _ in at_list]
        with cgutils.for_range(builder, nblocks) as loop:
            i = loop.index
            blocks = [unpack(builder.add(at, builder.mul(i, c(size)))) for at in at_list]
            for (d, dmin, mn2, codes), row_totals, row_mins in zip(blocks, totals, mins):
                for total_p, mins_p, y_base, d_base, b_base in zip(row_totals, row_mins, y_bases, d_bases, b_bases):
                    dkb = load(dk_a, builder.add(d_base, i), f32, 0, 4)
                    halves = load(bsum_a, builder.add(b_base, builder.mul(i, c(16))), vec(i16, 16), 0, 2)
                    builder.store(builder.call(fma8, [builder.sitofp(builder.call(maddwd, [mn2, halves]), f8v),
                                                      splat(builder.fmul(dmin, dkb), f8v), builder.load(mins_p)]),
                                  mins_p)
                    ybase = builder.add(y_base, builder.mul(i, c(256)))
                    acc_i = const(d16, 0)
                    for nibbles, offset, lanes in codes:
                        p = builder.call(maddubs, [nibbles, load(yk_a, ybase, v64, offset)])
                        acc_i = builder.call(dpwssd, [acc_i, builder.bitcast(p, d16), lanes])
                    scale = splat(builder.fmul(d, dkb), f16v)
                    builder.store(builder.call(fma16, [builder.sitofp(acc_i, f16v), scale, builder.load(total_p)]),
                                  total_p)
        return [[builder.fsub(vnni._reduce_lanes(builder, builder.load(total_p), builder.fadd),
                              vnni._reduce_lanes(builder, builder.load(mins_p), builder.fadd))
                 for total_p, mins_p in zip(row_totals, row_mins)] for row_totals, row_mins in zip(totals, mins)]

    return _k_intrinsic(emit, tokens, rows)


_q4_k_whole_row, _q5_k_whole_row = _q45_k_intrinsic(False), _q45_k_intrinsic(True)


# One token's q6_k rows of this many super-blocks or more (8192 values) ask for their weights
# into L2 (prefetcht2) Q6_LONG_ROW_AHEAD bytes ahead, not non-temporally vnni._ONCE_PREFETCH_BYTES
# ahead as shorter rows do: the row's activations (a byte a value, and the sums) share L1 with
# the lines a non-temporal hint brings there, and 8 KB ahead of a long row some of those are
# gone before the row reaches them, while nearer (2 KB) too few lines are in flight to keep the
# memory busy. Two threads, from memory, the hints compiled side by side in one process (medians
# of 11-21 alternating calls, a 64 MB read before each, the memory in its slow and its fast
# phase): Mixtral-8x7B's down projection (4096 x 14336, its Q4_K_M files' q6_k experts) into L2
# 6 KB ahead 1.05-1.14x as fast as non-temporally 2 KB ahead in the slow phase (8 KB ahead
# 0.96-1.07x), 1.32-1.33x in the fast one (8 KB 1.34-1.43x), where the non-temporal rows had read
# 28-38 GB/s against a plain read's 33-56; 4096 x 8192 1.00-1.03x and 1.12x. Rows of 4096 values
# (Mixtral's output matrix) and 2048 (Qwen3-30B-A3B's) read as fast as a plain read
# non-temporally 8 KB ahead and no faster into L2 (0.91-1.07x), so they keep it. Whole decodes
# of the two-layer Mixtral-shaped Q4_K_M model: as fast in the slow phase (53.0 against 52.9
# tok/s), 1.06x in the fast one (docs/runtime.md).
Q6_LONG_ROW_BLOCKS = 32
Q6_LONG_ROW_AHEAD = 6144


def _q6_k_intrinsic(tokens: int = 0, rows: int = 1):  # type: ignore[no-untyped-def]
    """``row(flat, at, blocks, yk, ybase, dk, bsum16) -> float32``: ``_q4_k_whole_row`` for q6_k, the
    activations in their natural order from yk[ybase]: the codes assembled from their bit planes
    64 at a time (as ``_superblock_intrinsic`` does), vpmaddubsw pairs them with the
    activations, vpdpwssd scales the pairs by their sub-block's int8 scale, the -32 offset taken
    off through the sums per 16 in the same integer accumulator; one float multiply-add a
    super-block. From the cache on one core 1.5-1.75x the rows a second of the per-32 loop
    (14 against 21-25 GB/s). With ``tokens``, the batched path's tile of ``rows`` x ``tokens``
    (``_k_intrinsic``)."""
    from llvmlite import ir

    i8, i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()

    def emit(builder, flat_a, yk_a, dk_a, bsum_a, at_list, nblocks, y_bases, d_bases,  # type: ignore[no-untyped-def]
             b_bases):
        c, vec, load, const, shuffle, splat, fn = vnni.emitters(builder, at_list[0].type)
        maddubs, dpwssd, fma16, maddwd = _superblock_ops(builder, fn, vec)
        v64, v32, d16, f16v, w32 = vec(i8, 64), vec(i8, 32), vec(i32, 16), vec(f32, 16), vec(i16, 32)
        matrices = bool(tokens) and vnni.HAVE_GFNI  # the tile's top bits through bit matrices (below)
        if matrices:
            affine = fn("llvm.x86.vgf2p8affineqb.512", v64, [v64, v64, i8])
            zero8 = ir.Constant(i8, 0)
            # vgf2p8affineqb's matrices: output bit 7 - k of a byte is the parity of the byte and
            # the matrix's byte k (in its 64-bit lane), so byte 3 picks what goes to bit 4, byte 2 bit 5
            tops = [const(v64, [b for low, high in halves for b in [0, 0, high, low, 0, 0, 0, 0]])
                    for halves in ([(1, 2)] * 4 + [(4, 8)] * 4, [(16, 32)] * 4 + [(64, 128)] * 4)]

        def unpack(at, ask):  # type: ignore[no-untyped-def]
            # a super-block's d, its 16 int8 scales (as int16) and its codes: (codes, activations'
            # offset, the scales of their lanes); ``ask(at)`` asks for the lines ahead
            ask(at)
            d = builder.fpext(builder.bitcast(load(flat_a, at, i16, 208), ir.HalfType()), f32)
            sc = builder.sext(load(flat_a, at, vec(i8, 16), 192), vec(i16, 16))
            codes = []
            for n in range(2):
                ql = load(flat_a, at, v64, 64 * n)
                qh = load(flat_a, at, v32, 128 + 32 * n)
                if matrices:
                    # the 32 bytes of top bits twice (one broadcast load); each code's two top bits
                    # moved to bits 4-5 by one vgf2p8affineqb, whose bit matrix is per 64-bit lane:
                    # for the first 64 codes bits 0-1 in the low half and 2-3 in the high half, for
                    # the next 64 bits 4-5 and 6-7. Four vector operations a super-block fewer than
                    # below: the tile on one core from L2 1.10-1.28x as fast; one token's rows from
                    # L2 1.04-1.09x, but from memory, where they spend their time, 0.95-0.99x, so
                    # they keep the shifts and masks below (docs/runtime.md).
                    twice = shuffle(qh, qh, list(range(32)) * 2)
                    first = builder.or_(builder.and_(ql, const(v64, 15)), builder.call(affine, [twice, tops[0], zero8]))
                    low = builder.bitcast(builder.lshr(builder.bitcast(ql, w32), const(w32, 4)), v64)
                    second = builder.or_(builder.and_(low, const(v64, 15)), builder.call(affine, [twice, tops[1], zero8]))
                else:
                    # qh and qh >> 2 side by side: bits 0-1 of each byte are the first 64 values' top
                    # bits, bits 4-5 the next 64's, already where they go (a plane of two bits
                    # shifted and masked at a time took half again the instructions)
                    both = shuffle(qh, builder.lshr(qh, const(v32, 2)), list(range(64)))
                    first = builder.or_(builder.and_(ql, const(v64, 15)),
                                        builder.shl(builder.and_(both, const(v64, 3)), const(v64, 4)))
                    second = builder.or_(builder.lshr(ql, const(v64, 4)), builder.and_(both, const(v64, 0x30)))
                for six, k, sub0 in ((first, 0, 8 * n), (second, 64, 8 * n + 4)):
                    codes.append((six, 128 * n + k, builder.bitcast(shuffle(sc, sc, [sub0 + p // 8 for p in range(32)]),
                                                                   d16)))
            return d, sc, codes

        totals = [[cgutils.alloca_once_value(builder, const(f16v, 0.0)) for _ in y_bases] for _ in at_list]

        def loop(ask):  # type: ignore[no-untyped-def]
            # the loop over the super-blocks, ``ask(at)`` asking for their lines ahead
            with cgutils.for_range(builder, nblocks) as step:
                i = step.index
                blocks = [unpack(builder.add(at, builder.mul(i, c(210))), ask) for at in at_list]
                for (d, sc, codes), row_totals in zip(blocks, totals):
                    for total_p, y_base, d_base, b_base in zip(row_totals, y_bases, d_bases, b_bases):
                        scale = builder.fmul(d, load(dk_a, builder.add(d_base, i), f32, 0, 4))
                        # -32 * sum_j sc_j * bsum16_j, in the integer accumulator (vpmaddwd: pairs of them)
                        sums = load(bsum_a, builder.add(b_base, builder.mul(i, c(16))), vec(i16, 16), 0, 2)
                        offs = builder.call(maddwd, [sc, sums])
                        acc_i = shuffle(builder.sub(const(vec(i32, 8), 0), builder.shl(offs, const(vec(i32, 8), 5))),
                                        const(vec(i32, 8), 0), list(range(16)))
                        ybase = builder.add(y_base, builder.mul(i, c(256)))
                        for six, offset, lanes in codes:
                            p = builder.call(maddubs, [six, load(yk_a, ybase, v64, offset)])
                            acc_i = builder.call(dpwssd, [acc_i, builder.bitcast(p, d16), lanes])
                        builder.store(builder.call(fma16, [builder.sitofp(acc_i, f16v), splat(scale, f16v),
                                                           builder.load(total_p)]), total_p)

        if tokens:
            loop(lambda at: vnni._prefetch_ahead(builder, flat_a, at, 210, vnni._AGAIN))
        else:  # one token's long rows ask into L2 (Q6_LONG_ROW_BLOCKS): the loop twice, one for each
            with builder.if_else(builder.icmp_signed(">=", nblocks, c(Q6_LONG_ROW_BLOCKS))) as (long_row, short):
                with long_row:
                    loop(lambda at: vnni._prefetch_ahead(builder, flat_a, at, 210, vnni._AGAIN, Q6_LONG_ROW_AHEAD))
                with short:
                    loop(lambda at: vnni._prefetch_ahead(builder, flat_a, at, 210, vnni._ONCE))
        return [[vnni._reduce_lanes(builder, builder.load(total_p), builder.fadd) for total_p in row_totals]
                for row_totals in totals]

    return _k_intrinsic(emit, tokens, rows)


_q6_k_whole_row = _q6_k_intrinsic()


# The batched path's tile for q4_k, q5_k and q6_k (rows x tokens a call), as vnni.TILE_ROWS is
# for the block kinds. q4_k at Mixtral's 14336 x 4096, 64 tokens, the variants compiled side by
# side and timed in 11 interleaved rounds (medians, two threads): 4 x 2 410 GOP/s, 8 x 2 400,
# 2 x 2 390, 2 x 4 365, 4 x 1 (one run, a noisier one) 175 against 4 x 2's 215.
K_TILE_ROWS, K_TILE_TOKENS = 4, 2
_q4_k_tile, _q5_k_tile = (_q45_k_intrinsic(five, K_TILE_TOKENS, K_TILE_ROWS) for five in (False, True))
_q6_k_tile = _q6_k_intrinsic(K_TILE_TOKENS, K_TILE_ROWS)


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def k_batched_groups(flat, kind, offsets, row_bytes, cols, yk, ybase, dk, bsum, groups,
                     out):  # pragma: no cover - compiled
    # Matrices of KINDS ``kind`` (q4_k, q5_k or q6_k) times their tokens' activations per 256
    # (k_activations: yk [n, ...] from ybase, in q4_k's layout for q4_k and q5_k, in order for
    # q6_k; dk, bsum): group g is the matrix at byte offsets[g] of flat (row_bytes a row,
    # out.shape[1] rows) times tokens groups[g]..groups[g + 1], into those rows of out.
    # K_TILE_ROWS x K_TILE_TOKENS a call, the rows and tokens past the last whole tile one by
    # one; work items of BATCH_ROWS rows of a group (vnni.work_item), as
    # vnni._blocks_batched_groups.
    rows = out.shape[1]
    blocks = cols // 256
    yf, df, bf, of = yk.reshape(-1), dk.reshape(-1), bsum.reshape(-1), out.reshape(-1)
    ys, ds, bs = yk.shape[1], dk.shape[1], bsum.shape[1]
    chunks = (rows + vnni.BATCH_ROWS - 1) // vnni.BATCH_ROWS
    total = (groups.shape[0] - 1) * chunks
    threads = vnni.thread_count()
    counters = vnni.work_counters(threads)
    for th in prange(threads):
        while True:
            item = vnni.work_item(counters, th, threads, total)
            if item < 0:
                break
            g = item // chunks
            first = (item - g * chunks) * vnni.BATCH_ROWS
            last = min(rows, first + vnni.BATCH_ROWS)
            base, t0, t1 = offsets[g], groups[g], groups[g + 1]
            whole = t0 + (t1 - t0) // K_TILE_TOKENS * K_TILE_TOKENS
            tiled = first + (last - first) // K_TILE_ROWS * K_TILE_ROWS
            for t in range(t0, whole, K_TILE_TOKENS):
                for r in range(first, tiled, K_TILE_ROWS):
                    args = (flat, base + r * row_bytes, row_bytes, blocks, yf[t * ys:], ybase, ys, df[t * ds:], ds,
                            bf[t * bs:], bs, of, t * rows + r, rows)
                    if kind == 4:
                        _q6_k_tile(*args)
                    elif kind == 3:
                        _q5_k_tile(*args)
                    else:
                        _q4_k_tile(*args)
            for t in range(t0, t1):
                for r in range(tiled if t < whole else first, last):
                    args1 = (flat, base + r * row_bytes, blocks, yk[t], ybase, dk[t], bsum[t])
                    if kind == 4:
                        out[t, r] = _q6_k_whole_row(*args1)
                    elif kind == 3:
                        out[t, r] = _q5_k_whole_row(*args1)
                    else:
                        out[t, r] = _q4_k_whole_row(*args1)


@njit(cache=True, nogil=True)
def k_activations(x, kind):  # pragma: no cover - compiled
    """(yk, ybase, dk, bsum) of the batched K-quant kernels for tokens x [n, cols] and matrices
    of KINDS ``kind`` (q4_k, q5_k, q6_k): the activations per 256 as the one-token kernels
    quantize them, each token's one cache line past a multiple of 4 KB from the last (as
    vnni.padded_activations lays its tokens)."""
    n, cols = x.shape
    natural = kind == 4  # q6_k reads the activations in order, after the layout's cols
    yk = np.empty((n, (2 if natural else 1) * cols + 64), np.int8)
    dk = np.empty(n * cols // 256, np.float32)
    bsum = np.empty(n * cols // 16, np.int16)
    vnni.quantize_superblocks(x.reshape(-1), cols, yk, dk, bsum, not natural, natural)
    return yk, cols if natural else 0, dk.reshape(n, cols // 256), bsum.reshape(n, cols // 16)


@njit(cache=True, nogil=True)
def _k_batched_tokens(raw, kind, x, out):  # pragma: no cover - compiled
    yk, ybase, dk, bsum = k_activations(x, kind)
    k_batched_groups(raw.reshape(-1), kind, np.zeros(1, np.int64), raw.shape[1], x.shape[1], yk, ybase, dk, bsum,
                     np.array([0, x.shape[0]], np.int64), out)


def matmul_k(x: np.ndarray, raw: np.ndarray, scheme: str) -> np.ndarray:
    """``x @ W.T`` (float32 [n, rows]) for tokens x [n, cols] and one q4_k, q5_k or q6_k matrix
    stored as C-contiguous uint8 rows, in place: the activations quantized per 256 as the
    one-token kernel quantizes them (llama.cpp's q8_K), tiles of ``K_TILE_ROWS`` rows by
    ``K_TILE_TOKENS`` tokens."""
    x, raw = writable(np.ascontiguousarray(x, dtype=np.float32)), read_only(raw)
    out = np.empty((x.shape[0], raw.shape[0]), dtype=np.float32)
    _k_batched_tokens(raw, KINDS[scheme], x, out)
    return out


def batched_fits(scheme: str, cols: int) -> bool:
    """Whether ``matmul_k`` takes matrices of ``scheme`` with rows of ``cols`` values."""
    return vnni.HAVE_VNNI and vnni._COMPILED and scheme in PER_256 and cols % 256 == 0


_q2_k_row, _q3_k_row, _iq4_xs_row = (_superblock_intrinsic(k) for k in ("q2_k", "q3_k", "iq4_xs"))


@njit(cache=True, nogil=True, inline="always")
def _k_row(flat, kind, start, blocks, xq, dx, sums32, isum16, dsum16, yk, dk, bsum):  # pragma: no cover - compiled
    # The row of ``blocks`` super-blocks of KINDS ``kind`` (not iq4_nl) at byte ``start`` times
    # the int8 activations, in one compiled loop (``_superblock_intrinsic``, whose minimums or
    # offsets take q2_k the dequantized sums per 16, q3_k the int8 sums per 16, iq4_xs the sums
    # per 32; q4_k, q5_k and q6_k: ``_q4_k_whole_row``, ``_q5_k_whole_row`` and
    # ``_q6_k_whole_row`` against the activations quantized per 256, yk, dk, bsum of
    # ``vnni.quantize_superblocks``).
    if kind == 2:
        return _q4_k_whole_row(flat, start, blocks, yk, 0, dk, bsum)
    if kind == 4:
        return _q6_k_whole_row(flat, start, blocks, yk, blocks * 256, dk, bsum)
    if kind == 0:
        return _q2_k_row(flat, start, blocks, xq, dx, dsum16)
    if kind == 1:
        return _q3_k_row(flat, start, blocks, xq, dx, isum16)
    if kind == 3:
        return _q5_k_whole_row(flat, start, blocks, yk, 0, dk, bsum)
    return _iq4_xs_row(flat, start, blocks, xq, dx, sums32)


@njit(cache=True, nogil=True, inline="always")
def k_rows(flat, kind, base, row_bytes, first, end, blocks, xq, dx, sums32, isum16, dsum16, yk, dk, bsum,
           out):  # pragma: no cover - compiled
    """out[r] = ``_k_row`` of row r (at byte base + r * row_bytes) for r in first..end, the kind
    chosen once for all of them: a loop over one intrinsic. With the choice made per row (all six
    intrinsics in one loop body), Qwen3-30B-A3B's q4_k gate/up rows of 8 experts (2048 values,
    cold, medians of 21) took 387 us against 337 on one core, 204 against 177 on two, as loops of
    their own in one process; through ``rows.rows_many`` (alternating processes) the gain is
    smaller: 1-3% on one core, 3% on two, 768-value q4_k rows 5% on two, q6_k 1%."""
    if kind == 2:
        for r in range(first, end):
            out[r] = _q4_k_whole_row(flat, base + r * row_bytes, blocks, yk, 0, dk, bsum)
    elif kind == 4:
        for r in range(first, end):
            out[r] = _q6_k_whole_row(flat, base + r * row_bytes, blocks, yk, blocks * 256, dk, bsum)
    elif kind == 3:
        for r in range(first, end):
            out[r] = _q5_k_whole_row(flat, base + r * row_bytes, blocks, yk, 0, dk, bsum)
    else:
        for r in range(first, end):
            out[r] = _k_row(flat, kind, base + r * row_bytes, blocks, xq, dx, sums32, isum16, dsum16, yk, dk, bsum)


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _k_vnni(flat, kind, row_bytes, rows, cols, table, xq, dx, sums32, isum16, dsum16, yk, dk, bsum,
            out):  # pragma: no cover - compiled
    # Rows of a K-quant or iq4_xs times the int8 activations, in ``vnni.row_items``' work items.
    threads, size, items, counters = vnni.row_items(row_bytes, rows)
    for t in prange(threads):
        while True:
            first, end = vnni.next_rows(counters, t, threads, items, size, rows)
            if first < 0:
                break
            k_rows(flat, kind, 0, row_bytes, first, end, cols // 256, xq, dx, sums32, isum16, dsum16, yk, dk, bsum,
                   out)


@njit(cache=True, nogil=True)
def _sums16(xq, dx, isum16, dsum16):  # pragma: no cover - compiled
    for g in range(isum16.shape[0]):
        total = 0
        for j in range(16 * g, 16 * g + 16):
            total += np.int32(xq[j])
        isum16[g] = np.float32(total)
        dsum16[g] = np.float32(total) * dx[g // 2]


def _activations(x: np.ndarray, schemes: tuple[str, ...] | str) -> tuple[np.ndarray, ...]:
    """x [n, cols] quantized for the kernels of ``schemes``: int8 values, scales per 32,
    dequantized sums per 32, int8 sums per 16 (q3_k's offsets), dequantized sums per 16 (q2_k's
    minimums); and for q4_k, q5_k and q6_k quantized per 256 (``yk``, ``dk``, ``bsum`` of
    ``vnni.quantize_superblocks``, in the layouts they read; else empty). Compiled, one thread: a
    decode step calls this twice a layer."""
    n, cols = x.shape
    names = (schemes,) if isinstance(schemes, str) else schemes
    return _quantized(np.ascontiguousarray(x, dtype=np.float32).reshape(-1), n, cols,
                      any(name not in PER_256 for name in names), "q4_k" in names or "q5_k" in names,
                      "q6_k" in names)


@njit(cache=True, nogil=True)
def _quantized(x, n, cols, per32, layout, natural):  # pragma: no cover - compiled
    # n vectors of cols values quantized (what ``_activations`` returns): [n, ...] arrays; per 32
    # for the kinds but q4_k and q6_k (``per32``; else those arrays are empty), per 256 for q4_k
    # (``layout``) and q6_k (``natural``)
    groups = n * cols // 32 if per32 else 0
    width = cols if per32 else 0
    xq = np.empty(n * width, np.int8)
    dx = np.empty(groups, np.float32)
    sums32 = np.empty(groups, np.float32)
    isum16 = np.empty(2 * groups, np.float32)
    dsum16 = np.empty(2 * groups, np.float32)
    if per32:
        vnni._quantize_groups(x, 32, 0, xq, dx, sums32)
        _sums16(xq, dx, isum16, dsum16)
    return (xq.reshape(n, width), dx.reshape(n, width // 32), sums32.reshape(n, width // 32),
            isum16.reshape(n, width // 16), dsum16.reshape(n, width // 16),
            *superblock_activations(x, n, cols, layout, natural))


# (the one-token rows' and projections' name for it)
superblock_activations = vnni.superblock_activations


def vnni_matvec(name: str):  # type: ignore[no-untyped-def]
    """The one-token kernel of a K-quant or iq4_xs through VNNI (C-contiguous rows)."""
    kind = KINDS[name]

    def run(raw, x, out, scales):  # type: ignore[no-untyped-def]
        rows, row_bytes = raw.shape
        _k_vnni(raw.reshape(-1), kind, row_bytes, rows, x.shape[0], _F16_TO_F32,
                *(a[0] for a in _activations(x.reshape(1, -1), name)), out)
        return out

    return run


class CpuParts(NamedTuple):
    """What ``kernels`` registers for a type of ``KINDS``: the one-token ``matvec``, the
    ``decoder`` kernel with its ``tables`` (``kernels.block_decoder``), and ``tiles``, the
    (fits, multiply) of its kernels for a few tokens (``kernels.in_place``), multiply None where a
    few tokens go one at a time, or None without them."""

    matvec: Callable[..., np.ndarray]
    decoder: Callable[..., None]
    tables: tuple[Any, ...]
    tiles: tuple[Callable[[str, int], bool], Callable[..., np.ndarray] | None] | None


def cpu_parts(name: str) -> CpuParts:
    """The CPU kernels of ``name``, one of ``KINDS``."""
    scheme = get_scheme(name)
    kind, elems, block_bytes = KINDS[name], scheme.block_elems, scheme.block_bytes
    if not vnni.HAVE_VNNI:
        fast = None
    elif name == "iq4_nl":  # blocks of 32 as q4_0's, through vnni's block kernels
        def fast(raw, x, out, scales):  # type: ignore[no-untyped-def]
            return vnni.matvec_blocks(raw, name, x, out)
    else:
        fast = vnni_matvec(name)

    def matvec(raw, x, out, scales):  # type: ignore[no-untyped-def]
        if fast is not None and raw.dtype == np.uint8 and raw.flags.c_contiguous:
            return fast(raw, x, out, scales)
        _matvec(np.ascontiguousarray(raw, dtype=np.uint8), kind, elems, block_bytes, x, _F16_TO_F32,
                IQ4_LEVELS, out)
        return out

    if name in ("q4_k", "q5_k"):
        decoder, tables = _decode_q45_k, (name == "q5_k", _F16_TO_F32)
    elif name == "q6_k":
        decoder, tables = _decode_q6_k, (_F16_TO_F32,)
    else:
        decoder, tables = _decode, (kind, elems, block_bytes, _F16_TO_F32, IQ4_LEVELS)
    tiles: tuple[Callable[[str, int], bool], Callable[..., np.ndarray] | None] | None = None
    if name == "iq4_nl":  # q4_0's layout, multiplied in place as q4_0 is
        tiles = (vnni.batched_fits, vnni.matmul_blocks)
    elif name in PER_256:
        tiles = (batched_fits, matmul_k)
    elif name == "iq4_xs":  # no row tiles: the one-token kernel for a few tokens, then 16 a vector
        tiles = (lambda scheme, cols: vnni.HAVE_VNNI, None)
    return CpuParts(matvec, decoder, tables, tiles)


# ------------------------------------------------------------------------------------------------
# Device decoders (torch, any device): the same values, computed as the gguf package computes them.


def _bits(t: Any, shifts: list[int]) -> Any:
    """[..., n] uint8 -> [..., len(shifts), n]: each byte shifted right by each shift."""
    import torch

    return t.unsqueeze(-2) >> torch.tensor(shifts, dtype=torch.uint8, device=t.device).reshape(-1, 1)


def _half(t: Any) -> Any:
    import torch

    return t.contiguous().view(torch.float16).float()


def _scale_min(scales: Any) -> tuple[Any, Any]:
    import torch

    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return sc.float(), mn.float()


def device_decoder(name: str) -> Any:
    """The device decoder of ``name``, one of ``KINDS`` (``device.register_device``)."""
    scheme = get_scheme(name)

    def decode(raw: Any, cols: int) -> Any:
        import torch

        rows = raw.shape[0]
        b = raw.reshape(-1, scheme.block_bytes)
        n = b.shape[0]
        if name == "q2_k":
            d, dmin = _half(b[:, 80:82]), _half(b[:, 82:84])
            s = b[:, :16]
            q = (_bits(b[:, 16:80].reshape(n, 2, 32), [0, 2, 4, 6]) & 3).reshape(n, 16, 16).float()
            values = (d * (s & 15).float()).reshape(n, 16, 1) * q - (dmin * (s >> 4).float()).reshape(n, 16, 1)
        elif name == "q3_k":
            d = _half(b[:, 108:110])
            sb = b[:, 96:108]
            low = _bits(sb[:, :8], [0, 4]).reshape(n, 16) & 15
            high = _bits(sb[:, 8:12], [0, 2, 4, 6]).reshape(n, 16) & 3
            dl = (d * ((low | (high << 4)).to(torch.int8) - 32).float()).reshape(n, 16, 1)
            ql = (_bits(b[:, 32:96].reshape(n, 2, 32), [0, 2, 4, 6]) & 3).reshape(n, 16, 16)
            qh = (_bits(b[:, :32].reshape(n, 1, 32), list(range(8))) & 1).reshape(n, 16, 16) ^ 1
            values = dl * (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()
        elif name in ("q4_k", "q5_k"):
            d, dmin = _half(b[:, 0:2]), _half(b[:, 2:4])
            sc, mn = _scale_min(b[:, 4:16])
            codes = b[:, 16:] if name == "q4_k" else b[:, 48:]
            q = (_bits(codes.reshape(n, 4, 32), [0, 4]) & 15).reshape(n, 8, 32)
            if name == "q5_k":
                q = q | ((_bits(b[:, 16:48].reshape(n, 1, 32), list(range(8))) & 1).reshape(n, 8, 32) << 4)
            values = (d * sc).reshape(n, 8, 1) * q.float() - (dmin * mn).reshape(n, 8, 1)
        elif name == "q6_k":
            d = _half(b[:, 208:210])
            dl = (d * b[:, 192:208].contiguous().view(torch.int8).float()).reshape(n, 16, 1)
            ql = (_bits(b[:, :128].reshape(n, 2, 64), [0, 4]) & 15).reshape(n, 8, 32)
            qh = (_bits(b[:, 128:192].reshape(n, 2, 32), [0, 2, 4, 6]) & 3).reshape(n, 8, 32)
            q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
            values = dl * q
        else:
            levels = torch.tensor(IQ4_LEVELS, device=raw.device)
            if name == "iq4_nl":
                dl = _half(b[:, 0:2]).reshape(n, 1, 1)
                codes = b[:, 2:].reshape(n, 1, 16)
            else:
                d = _half(b[:, 0:2])
                high = b[:, 2:4].contiguous().view(torch.int16).int()
                low = _bits(b[:, 4:8], [0, 4]).transpose(-1, -2).reshape(n, 8).int() & 15
                shifts = torch.arange(0, 16, 2, device=raw.device, dtype=torch.int32)
                ls = (low | (((high >> shifts) & 3) << 4)) - 32
                dl = (d * ls.float()).reshape(n, 8, 1)
                codes = b[:, 8:].reshape(n, 8, 16)
            values = dl * levels[torch.cat([codes & 15, codes >> 4], dim=-1).long()]
        return values.reshape(rows, cols)

    return decode
