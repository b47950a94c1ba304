"""Expert products through the CPU's integer dot-product instruction (AVX-512 VNNI ``vpdpbusd``).

Numba has no vector types and no way to ask for one instruction, and its integer arithmetic is
widened to int64, so the float kernels spend most of their time unpacking nibbles. Here LLVM
code, built with ``numba.extending.intrinsic``, multiplies codes by the activations quantized to
int8; the rest of each kernel is ordinary Numba. Activations are quantized per group of the
weights (32 for ggml's blocks), with one float32 scale each, as llama.cpp does for its q8
activations (about 0.5% relative error, far below 4-bit weights' own). Kernels: a whole row of
int8, q8_0, q4_0, mxfp4 or iq4_nl as one LLVM loop (``_row_intrinsic``: two or four blocks a
512-bit step, mxfp4's e2m1 codes and iq4_nl's levels made unsigned integers with one
``pshufb``); int4 (codes, then bf16 scales and minimums) as one LLVM loop too
(``_int4_row_intrinsic``); each for one matrix, for
the same matrix of all the selected experts of a layer at once (``rows.experts_rows``, schemes mixed),
for one token through a layer's experts in one call (``rows.experts_token``, with the
K-quants), and for several tokens at once in tiles of rows x tokens (``matmul_blocks``). Used
when the CPU has AVX-512 VNNI and the JIT is on; otherwise ``kernels.py``'s float kernels run.
``KTC_NO_VNNI=1`` forces those.
"""
from __future__ import annotations

import os

import numpy as np
from numba import config, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ktc.formats.dequant import FP8_E4M3_VALUES
from ktc.formats.float_bits import E8M0_TO_F32, F16_TO_F32
from ktc.formats.kernel_args import read_only, writable


def _host_has(wanted: tuple[str, ...]) -> bool:
    """Whether the code Numba compiles may use the CPU features ``wanted`` (LLVM's names)."""
    if config.DISABLE_JIT or os.environ.get("KTC_NO_VNNI") == "1":
        return False
    try:
        import llvmlite.binding as llvm

        features = llvm.get_host_cpu_features()
    except Exception:  # pragma: no cover - no feature query on this platform
        return False
    if not all(features.get(f, False) for f in wanted):
        return False
    # Numba compiles for this CPU unless NUMBA_CPU_NAME / NUMBA_CPU_FEATURES name another
    # target (portable caches do): then the features must be named explicitly.
    if (config.CPU_NAME or "host") != "host" or config.CPU_FEATURES:
        return all(f"+{f}" in (config.CPU_FEATURES or "") for f in wanted)
    return True


HAVE_VNNI = _host_has(("avx512vnni", "avx512vl", "avx512bw", "avx512f"))
# vgf2p8affineqb (kquants' q6_k tile): Ice Lake and Zen 4 on, not Cascade Lake's VNNI
HAVE_GFNI = HAVE_VNNI and _host_has(("gfni",))


def _target_cpu() -> str:
    """The CPU Numba compiles for (``NUMBA_CPU_NAME``, else this machine's, as LLVM names it)."""
    if (config.CPU_NAME or "host") != "host":
        return str(config.CPU_NAME)
    try:
        import llvmlite.binding as llvm

        return str(llvm.get_host_cpu_name())
    except Exception:  # pragma: no cover - no CPU query on this platform
        return "generic"


_HOST_CPU = _target_cpu()
# LLVM intrinsics of any x86 CPU (_amax32, _codes32) are not callable in pure Python.
_COMPILED = not config.DISABLE_JIT


def _dot_intrinsic(nbytes: int, operands):  # type: ignore[no-untyped-def]
    """An intrinsic ``f(acc, codes, cbase, xq, xbase, s)``: acc += s * the int32 sums vpdpbusd
    makes of the (unsigned bytes, signed bytes) pairs that ``operands(builder, ir, load, codes,
    cbase, xq, xbase)`` returns (``load(array, index)`` loads ``nbytes`` bytes). ``acc`` is a
    float32 array of at least nbytes / 4 lanes, summed once a row is done: no horizontal sum per
    group or block."""
    from llvmlite import ir

    lanes = nbytes // 4
    i8, i32, f32 = ir.IntType(8), ir.IntType(32), ir.FloatType()
    bytes_t, words_t, floats_t = ir.VectorType(i8, nbytes), ir.VectorType(i32, lanes), ir.VectorType(f32, lanes)
    name = {16: "llvm.x86.avx512.vpdpbusd.128", 32: "llvm.x86.avx512.vpdpbusd.256",
            64: "llvm.x86.avx512.vpdpbusd.512"}[nbytes]

    @intrinsic
    def dot_into(typingctx, acc, codes, cbase, xq, xbase, s):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            acc_v, codes_v, cbase_v, xq_v, xbase_v, s_v = args
            acc_a = context.make_array(signature.args[0])(context, builder, acc_v)
            codes_a = context.make_array(signature.args[1])(context, builder, codes_v)
            xq_a = context.make_array(signature.args[3])(context, builder, xq_v)

            def load(array, index):  # type: ignore[no-untyped-def]
                pointer = builder.bitcast(builder.gep(array.data, [index]), bytes_t.as_pointer())
                return builder.load(pointer, align=1)

            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(words_t, [words_t] * 3), name)
            dot = ir.Constant(words_t, [0] * lanes)
            for unsigned, signed in operands(builder, ir, load, codes_a, cbase_v, xq_a, xbase_v):
                dot = builder.call(fn, [dot, builder.bitcast(unsigned, words_t), builder.bitcast(signed, words_t)])
            scale = builder.insert_element(ir.Constant(floats_t, ir.Undefined), s_v, ir.Constant(i32, 0))
            scale = builder.shuffle_vector(scale, scale, ir.Constant(words_t, [0] * lanes))
            acc_p = builder.bitcast(acc_a.data, floats_t.as_pointer())
            total = builder.fadd(builder.load(acc_p, align=4), builder.fmul(builder.sitofp(dot, floats_t), scale))
            builder.store(total, acc_p, align=4)
            return context.get_dummy_value()

        return types.void(acc, codes, cbase, xq, xbase, s), codegen

    return dot_into


def _group_intrinsic(nbytes: int, table: tuple[int, ...] | None = None):  # type: ignore[no-untyped-def]
    """``group(acc, codes, cbase, xq, xbase, s)``: with k < nbytes, lane by lane, acc += s * sum
    of (codes[cbase + k] & 15) * xq[xbase + k] + (codes[cbase + k] >> 4) * xq[xbase + nbytes + k]
    (four k per int32 lane, as vpdpbusd adds them). With ``table`` (16 unsigned bytes, nbytes 16
    only) each 4-bit code c counts as table[c] (one pshufb), which is how e2m1 codes become
    integers."""

    def nibbles(builder, ir, load, codes, cbase, xq, xbase):  # type: ignore[no-untyped-def]
        bytes_t = ir.VectorType(ir.IntType(8), nbytes)
        packed = load(codes, cbase)
        low = builder.and_(packed, ir.Constant(bytes_t, [15] * nbytes))
        high = builder.lshr(packed, ir.Constant(bytes_t, [4] * nbytes))
        if table is not None:
            shuffle = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(bytes_t, [bytes_t, bytes_t]), "llvm.x86.ssse3.pshuf.b.128")
            lut = ir.Constant(bytes_t, list(table))
            low, high = builder.call(shuffle, [lut, low]), builder.call(shuffle, [lut, high])
        return ((low, load(xq, xbase)), (high, load(xq, builder.add(xbase, ir.Constant(xbase.type, nbytes)))))

    return _dot_intrinsic(nbytes, nibbles)


_group16 = _group_intrinsic(16)  # q4_0's blocks past a row's whole steps


def _int4_row_operands(context, builder, signature, args):  # type: ignore[no-untyped-def]
    """The int4 row intrinsics' ``(flat, base, groups, xq, dx, xsum, words, params)``: the arrays
    flat, xq, dx, xsum and words, then the indices base, groups and params."""
    return (*_arrays(context, builder, signature, args, (0, 3, 4, 5, 6)),
            *_indices(context, builder, signature, args, (1, 2, 7)))


def _int4_row_intrinsic(nbytes: int):  # type: ignore[no-untyped-def]
    """``row(flat, base, groups, xq, dx, xsum, words, params) -> float32``: a whole row of int4
    in groups of 2 * nbytes values (codes at byte ``base`` of flat, nbytes a group, value k in
    byte k's low nibble and value nbytes + k in its high one; bf16 scales at words[params + g],
    minimums at words[params + groups + g]) times x quantized per group (xq, dx, xsum): the sum
    over groups of scale * dx * (codes . xq) + minimum * xsum. The sums stay in registers over
    the row, two of each (every other group's), so that a group's additions do not wait on the
    last one's (the group intrinsics kept them in memory between calls: a chain of a load, an
    add and a store for every 16 to 64 bytes of codes), and the row is asked for
    ``_PREFETCH_BYTES`` ahead. For g64 sixteen groups' scales and minimums are read and
    multiplied as vectors (one token through a Mixtral-8x7B-shaped expert, three interleaved
    pairs of runs: g64 67-69% of the read bandwidth against 52-53% a group at a time, g32 53-54%
    against 46-48%; g128 the same either way, so a group at a time). g32 rows now take
    ``_int4_g32_row_intrinsic``, four groups a 512-bit step."""
    from llvmlite import ir

    lanes = nbytes // 4
    i8, i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
    bytes_t, words_t, floats_t = ir.VectorType(i8, nbytes), ir.VectorType(i32, lanes), ir.VectorType(f32, lanes)
    name = {16: "llvm.x86.avx512.vpdpbusd.128", 32: "llvm.x86.avx512.vpdpbusd.256",
            64: "llvm.x86.avx512.vpdpbusd.512"}[nbytes]

    @intrinsic
    def row(typingctx, flat, base, groups, xq, dx, xsum, words, params):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            flat_a, xq_a, dx_a, xsum_a, words_a, base_v, groups_v, params_v = _int4_row_operands(
                context, builder, signature, args)
            index_t = base_v.type
            dot_fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(words_t, [words_t] * 3), name)
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(floats_t, [floats_t] * 3),
                                                 f"llvm.fma.v{lanes}f32")

            def const(k):  # type: ignore[no-untyped-def]
                return ir.Constant(index_t, k)

            def load(array, index, t, align=1):  # type: ignore[no-untyped-def]
                return builder.load(builder.bitcast(builder.gep(array.data, [index]), t.as_pointer()), align=align)

            def bf16(index):  # type: ignore[no-untyped-def]
                wide = builder.shl(builder.zext(load(words_a, index, i16, 2), i32), ir.Constant(i32, 16))
                return builder.bitcast(wide, f32)

            accs = [cgutils.alloca_once_value(builder, ir.Constant(floats_t, [0.0] * lanes)) for _ in range(2)]
            minimum = cgutils.alloca_once_value(builder, ir.Constant(f32, 0.0))  # the groups past the sixteens'

            def group(g, acc_p, s=None):  # type: ignore[no-untyped-def]
                at = builder.add(base_v, builder.mul(g, const(nbytes)))
                _prefetch_ahead(builder, flat_a, at, nbytes)
                packed = load(flat_a, at, bytes_t)
                low = builder.and_(packed, ir.Constant(bytes_t, [15] * nbytes))
                high = builder.lshr(packed, ir.Constant(bytes_t, [4] * nbytes))
                xat = builder.mul(g, const(2 * nbytes))
                dot = ir.Constant(words_t, [0] * lanes)
                for codes, xbase in ((low, xat), (high, builder.add(xat, const(nbytes)))):
                    dot = builder.call(dot_fn, [dot, builder.bitcast(codes, words_t),
                                                builder.bitcast(load(xq_a, xbase, bytes_t), words_t)])
                if s is None:  # a group past the row's whole sixteens: its scale and minimum alone
                    s = builder.fmul(bf16(builder.add(params_v, g)), load(dx_a, g, f32, 4))
                    m = builder.fmul(bf16(builder.add(builder.add(params_v, groups_v), g)), load(xsum_a, g, f32, 4))
                    builder.store(builder.fadd(builder.load(minimum), m), minimum)
                one = builder.insert_element(ir.Constant(floats_t, ir.Undefined), s, ir.Constant(i32, 0))
                scale = builder.shuffle_vector(one, one, ir.Constant(words_t, [0] * lanes))
                builder.store(builder.call(fma, [builder.sitofp(dot, floats_t), scale, builder.load(acc_p)]), acc_p)

            sixteen_f, sixteen_w = ir.VectorType(f32, 16), ir.VectorType(i32, 16)

            def bf16_16(index):  # type: ignore[no-untyped-def]
                wide = builder.zext(load(words_a, index, ir.VectorType(i16, 16), 2), sixteen_w)
                return builder.bitcast(builder.shl(wide, ir.Constant(sixteen_w, [16] * 16)), sixteen_f)

            # g32 and g64: sixteen groups at a time, their scales times dx and their minimums times
            # xsum in vectors (a group at a time, its scalar steps were as many as its vector ones
            # at g32). g128 a group at a time: the sixteens read no faster there.
            mins16 = cgutils.alloca_once_value(builder, ir.Constant(sixteen_f, [0.0] * 16))
            whole = builder.udiv(groups_v, const(16 if nbytes < 64 else 1 << 30))  # g128: a group at a time
            with cgutils.for_range(builder, whole) as loop:
                g0 = builder.mul(loop.index, const(16))
                scales = builder.fmul(bf16_16(builder.add(params_v, g0)), load(dx_a, g0, sixteen_f, 4))
                mins = builder.fmul(bf16_16(builder.add(builder.add(params_v, groups_v), g0)),
                                    load(xsum_a, g0, sixteen_f, 4))
                builder.store(builder.fadd(builder.load(mins16), mins), mins16)
                for j in range(16):
                    group(builder.add(g0, const(j)), accs[j % 2], builder.extract_element(scales, ir.Constant(i32, j)))
            with cgutils.for_range(builder, builder.sub(groups_v, builder.mul(whole, const(16)))) as loop:
                group(builder.add(builder.mul(whole, const(16)), loop.index), accs[0])
            total = builder.fadd(builder.load(accs[0]), builder.load(accs[1]))
            rest = builder.fadd(_reduce_lanes(builder, builder.load(mins16), builder.fadd), builder.load(minimum))
            return builder.fadd(_reduce_lanes(builder, total, builder.fadd), rest)

        return types.float32(flat, base, groups, xq, dx, xsum, words, params), codegen

    return row


def _int4_g32_row_intrinsic():  # type: ignore[no-untyped-def]
    """``row(flat, base, groups, xq, dx, xsum, words, params) -> float32``: a whole int4_g32 row
    (as ``_int4_row_intrinsic``'s, 16 bytes a group) times x quantized per 32 in ``quad_layout``
    (q4_0's activations: a group's codes are laid out as a q4_0 block's): four groups a 512-bit
    step, their low nibbles one ``vpdpbusd`` against the first 64 bytes of the four groups'
    activations and their high nibbles one against the next 64, each group's sums in four lanes,
    then one multiply-add by the four groups' scales times dx spread over their lanes. The groups
    past the row's whole fours (in order in ``quad_layout`` too) a group at a time. One token
    through a Mixtral-8x7B-shaped expert (gate/up and down, medians of 15 calls with a 256 MB read
    between, three interleaved pairs of processes): 4.60-5.40 ms against 5.54-5.81 a group at a
    time in 128-bit vectors (``_int4_row_intrinsic(16)``, 53-54% of the read bandwidth before)."""
    from llvmlite import ir

    i8, i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
    w16, f16x, w4, f4 = ir.VectorType(i32, 16), ir.VectorType(f32, 16), ir.VectorType(i32, 4), ir.VectorType(f32, 4)

    @intrinsic
    def row(typingctx, flat, base, groups, xq, dx, xsum, words, params):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            flat_a, xq_a, dx_a, xsum_a, words_a, base_v, groups_v, params_v = _int4_row_operands(
                context, builder, signature, args)
            index_t = base_v.type
            dot16 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(w16, [w16] * 3),
                                                   "llvm.x86.avx512.vpdpbusd.512")
            dot4 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(w4, [w4] * 3),
                                                  "llvm.x86.avx512.vpdpbusd.128")
            fma16 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f16x, [f16x] * 3), "llvm.fma.v16f32")
            fma4 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f4, [f4] * 3), "llvm.fma.v4f32")

            def const(k):  # type: ignore[no-untyped-def]
                return ir.Constant(index_t, k)

            def load(array, index, t, align=1):  # type: ignore[no-untyped-def]
                return builder.load(builder.bitcast(builder.gep(array.data, [index]), t.as_pointer()), align=align)

            def bf16_4(index):  # type: ignore[no-untyped-def]
                wide = builder.zext(load(words_a, index, ir.VectorType(i16, 4), 2), w4)
                return builder.bitcast(builder.shl(wide, ir.Constant(w4, [16] * 4)), f4)

            accs = [cgutils.alloca_once_value(builder, ir.Constant(f16x, [0.0] * 16)) for _ in range(2)]
            mins = cgutils.alloca_once_value(builder, ir.Constant(f4, [0.0] * 4))
            acc4 = cgutils.alloca_once_value(builder, ir.Constant(f4, [0.0] * 4))
            fours = builder.udiv(groups_v, const(4))

            def nibble_dots(at, xat, count, fn):  # type: ignore[no-untyped-def]
                # ``count`` bytes of codes at flat[at]: their low nibbles times xq[xat:], their high
                # ones times the next ``count`` activations, summed four products a 32-bit lane
                b_t, w_t = ir.VectorType(i8, count), ir.VectorType(i32, count // 4)
                packed = load(flat_a, at, b_t)
                dot = ir.Constant(w_t, [0] * (count // 4))
                for part, x_at in ((builder.and_(packed, ir.Constant(b_t, [15] * count)), xat),
                                   (builder.lshr(packed, ir.Constant(b_t, [4] * count)), builder.add(xat, const(count)))):
                    dot = builder.call(fn, [dot, builder.bitcast(part, w_t), builder.bitcast(load(xq_a, x_at, b_t), w_t)])
                return dot

            def four(c, acc_p):  # type: ignore[no-untyped-def]
                g0 = builder.mul(c, const(4))
                at = builder.add(base_v, builder.mul(c, const(64)))
                _prefetch_ahead(builder, flat_a, at, 64)
                dot = nibble_dots(at, builder.mul(c, const(128)), 64, dot16)
                scales = builder.fmul(bf16_4(builder.add(params_v, g0)), load(dx_a, g0, f4, 4))
                lowest = builder.fmul(bf16_4(builder.add(builder.add(params_v, groups_v), g0)), load(xsum_a, g0, f4, 4))
                builder.store(builder.fadd(builder.load(mins), lowest), mins)
                spread = builder.shuffle_vector(scales, scales, ir.Constant(w16, [j // 4 for j in range(16)]))
                builder.store(builder.call(fma16, [builder.sitofp(dot, f16x), spread, builder.load(acc_p)]), acc_p)

            pairs = builder.udiv(fours, const(2))
            with cgutils.for_range(builder, pairs) as loop:  # two fours a pass, each into its own sums
                c = builder.mul(loop.index, const(2))
                four(c, accs[0])
                four(builder.add(c, const(1)), accs[1])
            with cgutils.if_unlikely(builder, builder.icmp_unsigned("!=", builder.mul(pairs, const(2)), fours)):
                four(builder.sub(fours, const(1)), accs[0])
            with cgutils.for_range(builder, builder.sub(groups_v, builder.mul(fours, const(4)))) as loop:
                g = builder.add(builder.mul(fours, const(4)), loop.index)  # in order: 16 codes, 32 values
                dot = nibble_dots(builder.add(base_v, builder.mul(g, const(16))), builder.mul(g, const(32)), 16, dot4)
                s = builder.fmul(builder.bitcast(builder.shl(builder.zext(load(words_a, builder.add(params_v, g), i16, 2),
                                                                           i32), ir.Constant(i32, 16)), f32),
                                 load(dx_a, g, f32, 4))
                m = builder.fmul(builder.bitcast(builder.shl(builder.zext(load(words_a, builder.add(
                    builder.add(params_v, groups_v), g), i16, 2), i32), ir.Constant(i32, 16)), f32), load(xsum_a, g, f32, 4))
                one = builder.insert_element(ir.Constant(f4, ir.Undefined), s, ir.Constant(i32, 0))
                spread = builder.shuffle_vector(one, one, ir.Constant(w4, [0] * 4))
                builder.store(builder.call(fma4, [builder.sitofp(dot, f4), spread, builder.load(acc4)]), acc4)
                mone = builder.insert_element(ir.Constant(f4, [0.0] * 4), m, ir.Constant(i32, 0))
                builder.store(builder.fadd(builder.load(mins), mone), mins)
            total = _reduce_lanes(builder, builder.fadd(builder.load(accs[0]), builder.load(accs[1])), builder.fadd)
            rest = builder.fadd(_reduce_lanes(builder, builder.load(acc4), builder.fadd),
                                _reduce_lanes(builder, builder.load(mins), builder.fadd))
            return builder.fadd(total, rest)

        return types.float32(flat, base, groups, xq, dx, xsum, words, params), codegen

    return row


_int4_row16, _int4_row32, _int4_row64 = _int4_g32_row_intrinsic(), _int4_row_intrinsic(32), _int4_row_intrinsic(64)


@njit(cache=True, nogil=True, inline="always")
def _int4_row(half, flat, base, groups, xq, dx, xsum, words, params):  # pragma: no cover - compiled
    if half == 64:
        return _int4_row64(flat, base, groups, xq, dx, xsum, words, params)
    if half == 32:
        return _int4_row32(flat, base, groups, xq, dx, xsum, words, params)
    return _int4_row16(flat, base, groups, xq, dx, xsum, words, params)


def _signed_bytes_intrinsic(nbytes: int):  # type: ignore[no-untyped-def]
    """``bytes_dot(acc, codes, cbase, xq, xbase, s)``: lane by lane, acc += s * sum of
    (codes[cbase + k] + 128) * xq[xbase + k] for k < nbytes, where the codes are int8 weights:
    flipping their sign bit makes them the unsigned bytes vpdpbusd wants, and the 128 * sum(xq)
    this adds is taken back through the activations' sums."""

    def flipped(builder, ir, load, codes, cbase, xq, xbase):  # type: ignore[no-untyped-def]
        sign = ir.Constant(ir.VectorType(ir.IntType(8), nbytes), [0x80] * nbytes)
        return ((builder.xor(load(codes, cbase), sign), load(xq, xbase)),)

    return _dot_intrinsic(nbytes, flipped)


_signed_bytes32 = _signed_bytes_intrinsic(32)
# e2m1 code -> twice its value, plus 12 so that it is unsigned (vpdpbusd multiplies unsigned
# bytes by signed ones); the 12 is taken back through the activations' sums.
E2M1_TWICE_PLUS_12 = (12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0)
_e2m1_group16 = _group_intrinsic(16, E2M1_TWICE_PLUS_12)
# ggml's iq4_nl/iq4_xs levels; plus 128 they are unsigned bytes for vpdpbusd (1 to 241)
IQ4_LEVELS_INT = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
IQ4_PLUS_128 = tuple(level + 128 for level in IQ4_LEVELS_INT)
_iq4_group16 = _group_intrinsic(16, IQ4_PLUS_128)



# Per kind of BLOCK_KINDS: bytes of a block, of its scale (before its codes), and blocks a step
# of the row loop; and the offset that makes the codes unsigned for vpdpbusd (taken back through
# the activations' sums: in the row loop's lanes, ``_lanes``, and in the blocks past its steps).
_ROW_STEP = {0: (32, 0, 2), 1: (34, 2, 2), 2: (18, 2, 4), 3: (17, 1, 4), 4: (18, 2, 4)}
_CODE_OFFSET = (128.0, 128.0, 8.0, 12.0, 128.0)
# Each step asks for the weights this many bytes ahead. Rows of 14336 columns read 14-20 GB/s
# without, 29-35 with (q8_0 and q4_0; 4096 columns 24-33 either way; medians of 11 interleaved
# rounds); 2048 and 8192 bytes ahead, or into L1, did less (and 2048 less again with the
# non-temporal hint below, 8192 the same, on two threads before the one-token products took
# balanced work items). The batched tiles ask this far ahead; the one-token rows, below.
_PREFETCH_BYTES = 4096
# One-token rows (``_ONCE``) ask twice as far ahead: a row of the 4-bit kinds takes a few
# nanoseconds, so 4 KB ahead was less time ahead than the memory's latency where one core reads.
# Qwen3-30B-A3B's experts (one token, 8 of 128, rows_many, cold, medians of 15), one core: Q4_0
# gate/up 382-392 against 460-469 us, Q8_0 down 333-338 against 365-388, Q4_K 768-value rows
# 219-224 against 230-238; two cores the same within the noise. Whole two-layer decodes,
# alternating processes, pairs in the same bandwidth phase: one core, Qwen3-shaped Q4_K_M 1.10-
# 1.12x the tokens/s, Mixtral-shaped Q4_0 1.06-1.21x, Qwen3-shaped Q4_0 0.95-1.08x; two cores,
# Qwen3-shaped Q4_0 0.94-1.15x (median of 7 pairs 1.02x), Mixtral-shaped Q4_0 0.96-1.15x (1.07x).
# The batched tiles (``_AGAIN``) keep 4 KB.
_ONCE_PREFETCH_BYTES = 8192
# How (llvm.prefetch's locality): a row read once for one token asks non-temporally
# (prefetchnta), so that a decode step's stream of weights no longer evicts what the step reads
# again: the router's rows, the activations and their scratch, the code. Inside whole-model
# decodes on the Zen 5 machine (two-layer models, 8 alternating pairs of processes): Mixtral-8x7B-
# shaped Q4_0 1.02-1.13x the tokens/s (median 1.06x), Qwen3-30B-A3B-shaped 0.93-1.06x (its step
# mostly the output matrix's stream), and the MoE block's steps beside its kernels shorter (the
# router's product 11-12 -> 6 us, the activation's quantization 3-6 -> 2, the activation 2-3 ->
# 1.3), the kernels themselves not slower. Measured once before with a layer called alone (200
# interleaved calls, a 256 MB read between): 17% slower. The batched tiles' rows keep the
# temporal hint (into L2): each work item's rows are read again for every pair of tokens.
_ONCE, _AGAIN = 0, 1
# Except the block kinds' one-token rows (int8, q8_0, q4_0, mxfp4, iq4_nl: ``_row_intrinsic``)
# on CPUs other than Zen 5, which ask into L2 (``_AGAIN``) 4 KB ahead, as every row did before
# the non-temporal hint. On a Zen 4 (EPYC, family 25; two threads, one Mixtral-8x7B-shaped expert
# at a time, alternating processes, three of five rounds each): non-temporally 8 KB ahead q4_0
# read 69-74% of the bandwidth, q8_0 77-79%, mxfp4 73-76%; into L2 4 KB ahead 79-81%, 83-87% and
# 78-85% (8 KB ahead the same, 2 KB ahead and no prefetch less); whole two-layer decodes (three
# alternating pairs, the two in the same bandwidth phase): Mixtral-shaped Q4_0 76-87% of the
# bandwidth against 70-77%, MXFP4_MOE 89-94% against 74-77%. That CPU's K-quant rows read more
# with the non-temporal hint (q4_k 90-92% against 84-88%): theirs stays. Told apart by the CPU
# LLVM compiles for (``llvmlite``'s host name), which Numba's cache keys its code by.
_NON_TEMPORAL_BLOCKS = _HOST_CPU in ("znver5",)


def e4m3_scaled_floats(builder, codes):  # type: ignore[no-untyped-def]
    """16 e4m3 codes (a vector of 16 bytes) as the float32s of their values times 2^-120, from
    their bits: sign-extended and moved up 20 bits, the magnitude lands at bits 20-26 and copies
    of the sign from bit 27 up, of which the mask keeps bit 31's (subnormal codes become float32
    denormals, exact; NaN codes read as 480 times 2^-120)."""
    from llvmlite import ir

    words = ir.VectorType(ir.IntType(32), 16)
    bits = builder.and_(builder.shl(builder.sext(codes, words), ir.Constant(words, [20] * 16)),
                        ir.Constant(words, [-(1 << 31) | (0x7F << 20)] * 16))
    return builder.bitcast(bits, ir.VectorType(ir.FloatType(), 16))


def _reduce_lanes(builder, value, op):  # type: ignore[no-untyped-def]
    """A vector's lanes combined by ``op`` (an add, a max), halves at a time until one is left:
    a row's sum in the row intrinsics, a group's largest magnitude or code sum."""
    from llvmlite import ir

    i32 = ir.IntType(32)
    width = value.type.count // 2
    while width:
        halves = [builder.shuffle_vector(value, value, ir.Constant(ir.VectorType(i32, width),
                                                                   list(range(k, k + width)))) for k in (0, width)]
        value = op(*halves)
        width //= 2
    return builder.extract_element(value, ir.Constant(i32, 0))


def _ahead(locality):  # type: ignore[no-untyped-def]
    """Bytes ahead that rows read with ``locality`` ask for their weights."""
    return _ONCE_PREFETCH_BYTES if locality == _ONCE else _PREFETCH_BYTES


def _block_locality(tokens):  # type: ignore[no-untyped-def]
    """How the block kinds' rows ask for their weights: one-token rows (``tokens`` 0)
    non-temporally where ``_NON_TEMPORAL_BLOCKS``, else, as the batched tiles, into L2."""
    return _ONCE if not tokens and _NON_TEMPORAL_BLOCKS else _AGAIN


def _prefetch_ahead(builder, flat_a, at, nbytes, locality=_ONCE, ahead=None, step=64):  # type: ignore[no-untyped-def]
    """Ask for every cache line of the ``nbytes`` at ``at`` of flat_a ``_ahead(locality)``
    bytes ahead, as the row loops do (``locality``: ``_ONCE``, or ``_AGAIN`` for rows read
    again), or ``ahead`` bytes where given; with ``step`` 128, every other line."""
    from llvmlite import ir

    i8, i32 = ir.IntType(8), ir.IntType(32)
    prefetch = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [i8.as_pointer(), i32, i32, i32]), "llvm.prefetch.p0i8")
    for line in range(0, nbytes, step):
        offset = ir.Constant(at.type, (_ahead(locality) if ahead is None else ahead) + line)
        builder.call(prefetch, [builder.gep(flat_a.data, [builder.add(at, offset)]), ir.Constant(i32, 0),
                                ir.Constant(i32, locality), ir.Constant(i32, 1)])


def emitters(builder, index_t):  # type: ignore[no-untyped-def]
    """The intrinsics' small LLVM helpers (kquants' whole rows, interleave's tiles): an index
    constant, a vector type, an unaligned vector load at ``index + offset`` of an array, a vector
    constant, a shuffle, a splat and an LLVM function by name."""
    from llvmlite import ir

    i32 = ir.IntType(32)

    def c(v):  # type: ignore[no-untyped-def]
        return ir.Constant(index_t, v)

    def vec(t, n):  # type: ignore[no-untyped-def]
        return ir.VectorType(t, n)

    def load(array, index, t, offset=0, align=1):  # type: ignore[no-untyped-def]
        pointer = builder.bitcast(builder.gep(array.data, [builder.add(index, c(offset))]), t.as_pointer())
        return builder.load(pointer, align=align)

    def const(t, values):  # type: ignore[no-untyped-def]
        return ir.Constant(t, values if isinstance(values, list) else [values] * t.count)

    def shuffle(a, b, mask):  # type: ignore[no-untyped-def]
        return builder.shuffle_vector(a, b, ir.Constant(vec(i32, len(mask)), mask))

    def splat(value, t):  # type: ignore[no-untyped-def]
        one = builder.insert_element(ir.Constant(t, ir.Undefined), value, ir.Constant(i32, 0))
        return shuffle(one, one, [0] * t.count)

    def fn(name, ret, argtypes):  # type: ignore[no-untyped-def]
        return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, argtypes), name)

    return c, vec, load, const, shuffle, splat, fn


def _arrays(context, builder, signature, args, which):  # type: ignore[no-untyped-def]
    """An intrinsic's array arguments at positions ``which``, as LLVM array structures."""
    return [context.make_array(signature.args[k])(context, builder, args[k]) for k in which]


def _indices(context, builder, signature, args, which):  # type: ignore[no-untyped-def]
    """An intrinsic's integer arguments at positions ``which``, as intp values."""
    return [context.cast(builder, args[k], signature.args[k], types.intp) for k in which]


def _nth(builder, base, stride, t):  # type: ignore[no-untyped-def]
    """base + t * stride (LLVM integers; t a Python int)."""
    from llvmlite import ir

    return builder.add(base, builder.mul(stride, ir.Constant(base.type, t)))


def _store_tile(builder, out_a, sums, obase, ostride):  # type: ignore[no-untyped-def]
    """A tile's products sums[r][t] (row r, token t) into out[obase + t * ostride + r]."""
    from llvmlite import ir

    for r, row_sums in enumerate(sums):
        for t, total in enumerate(row_sums):
            at = builder.add(_nth(builder, obase, ostride, t), ir.Constant(obase.type, r))
            builder.store(total, builder.gep(out_a.data, [at]))


def _q4_blocks_by_permute() -> bool:
    """Whether the one-token and few-token kernels read q4_0's (and iq4_nl's) four blocks a step
    in two 64-byte loads, their nibbles and scales picked by permutes, rather than in four 16-byte
    loads as mxfp4's. By the CPU LLVM compiles for, as measured (q4_0 rows, medians of 15
    interleaved rounds; per-pair ratios of alternating processes): the permutes 3-10% faster on
    the Zen 4 machine; on Zen 5 (znver5) the four loads 1.07x (lm_head's 151936 x 2048), 1.25x
    (14336 x 4096) and 1.2x (2048-value expert rows) of them, the permute's two-source byte
    shuffle the slower there. Read when the kernels compile: Numba's cache keeps code per CPU
    name, so a cached kernel is always this choice's."""
    return _HOST_CPU != "znver5"


_Q4_PERMUTE = _q4_blocks_by_permute()


def _row_intrinsic(kind: int, tokens: int = 0, rows: int = 1):  # type: ignore[no-untyped-def]
    """``row(flat, at, steps, xq, lanes, lbase, lspan, e8m0) -> float32``: the dot product of the ``steps`` * n
    blocks of BLOCK_KINDS ``kind`` at byte ``at`` of ``flat`` with the int8 activations xq (block
    j's scale dx[j], sum xsum[j]; e8m0: E8M0_TO_F32), n blocks a step in one
    512-bit product: int8 and q8_0 two blocks of 32 codes (their sign bits flipped), q4_0 and
    mxfp4 four blocks of 32 4-bit codes (activations in ``quad_layout``: the four blocks' first
    16 values, then their last 16, as their low and high nibbles lie). Each lane l adds
    scale_j * (dx[j] * dot_l - offset * xsum[j] / lanes) for its block j, so the codes'
    offset is taken back in the lanes; int8's row scale is the caller's.

    With ``tokens`` (the batched path): ``tile(flat, at, rstride, steps, xq, xbase, xstride, lanes,
    lbase, lspan, lstride, e8m0, out, obase, ostride)`` multiplies ``rows`` rows (row r at byte
    at + r * rstride) by ``tokens`` tokens' activations (token t's at xq[xbase + t * xstride], its
    lanes at lanes[lbase + t * lstride]) and stores their products at out[obase + t * ostride + r]:
    each step's codes and scales are unpacked once for all the tokens, each token's activations
    loaded once for all the rows, rows * tokens accumulators in registers.

    The loop is LLVM's own, its accumulator a register: as Numba loops over an intrinsic that
    adds to an array, each step waited for the last one's store (at 14336 columns 18 GB/s where
    4096 columns read 27-29), and the per-block version (128-bit products, a scalar scale and
    offset, fp16 scales from a float table) read q4_0 at 23 GB/s. fp16 scales are converted by
    the CPU (F16C)."""
    from llvmlite import ir

    i8, i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
    size, scale_bytes, per_step = _ROW_STEP[kind]
    per_block = 16 // per_step  # lanes of one block

    def vector(t, n):  # type: ignore[no-untyped-def]
        return ir.VectorType(t, n)

    def mask(indices):  # type: ignore[no-untyped-def]
        return ir.Constant(vector(i32, len(indices)), list(indices))

    def emit(context, builder, flat_a, xq_a, lanes_a, e8m0_a, at_list, steps_v, x_bases,  # type: ignore[no-untyped-def]
             l_bases, lspan_v):
        # the loop over the rows at bytes ``at_list``; the sums of its lanes, [row][token] (one
        # token per (activations, lanes) base)
        index_t = at_list[0].type

        def load(array, index, t, align=1):  # type: ignore[no-untyped-def]
            return builder.load(builder.bitcast(builder.gep(array.data, [index]), t.as_pointer()), align=align)

        def plus(value, k):  # type: ignore[no-untyped-def]
            return builder.add(value, ir.Constant(index_t, k))

        def step_of(value, i, k):  # type: ignore[no-untyped-def]
            return builder.add(value, builder.mul(i, ir.Constant(index_t, k)))

        def per_lane(values):  # type: ignore[no-untyped-def]
            return builder.shuffle_vector(values, values, mask([lane // per_block for lane in range(16)]))

        bytes64, words, lanes = vector(i8, 64), vector(i32, 16), vector(f32, 16)
        dpbusd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(words, [words] * 3),
                                                "llvm.x86.avx512.vpdpbusd.512")
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(lanes, [lanes] * 3),
                                             "llvm.fma.v16f32")
        prefetch = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8.as_pointer(), i32, i32, i32]), "llvm.prefetch.p0i8")

        def unpack(at_i):  # type: ignore[no-untyped-def]
            # a step's codes, as (unsigned bytes, offset of their activations) pairs, and its
            # scales per lane (None for int8, whose row scale is the caller's)
            if per_step == 2:  # 32 signed codes a block, made unsigned
                if kind == 0:
                    codes = load(flat_a, at_i, bytes64)
                else:
                    codes = builder.shuffle_vector(load(flat_a, plus(at_i, scale_bytes), vector(i8, 32)),
                                                   load(flat_a, plus(at_i, size + scale_bytes), vector(i8, 32)),
                                                   mask(range(64)))
                pairs = [(builder.xor(codes, ir.Constant(bytes64, [0x80] * 64)), 0)]
            elif (kind == 2 or kind == 4) and _Q4_PERMUTE:
                # q4_0 (and iq4_nl, the same layout): the four blocks' 72 bytes in two 64-byte loads, their 16 bytes of
                # nibbles each picked by one permute (where ``_q4_blocks_by_permute``; slower
                # for mxfp4's 17-byte blocks, 22-26 against 26-28 GB/s)
                head = load(flat_a, at_i, bytes64)
                tail_from = 4 * size - 64
                tail = load(flat_a, plus(at_i, tail_from), bytes64)
                picks = [j * size + scale_bytes + t for j in range(4) for t in range(16)]
                packed = builder.shuffle_vector(head, tail, mask([p if p < 64 else 64 + p - tail_from
                                                                  for p in picks]))
            else:  # mxfp4 (and elsewhere q4_0, iq4_nl): 16 bytes of nibbles a block
                parts = [load(flat_a, plus(at_i, j * size + scale_bytes), vector(i8, 16)) for j in range(4)]
                packed = builder.shuffle_vector(builder.shuffle_vector(parts[0], parts[1], mask(range(32))),
                                                builder.shuffle_vector(parts[2], parts[3], mask(range(32))),
                                                mask(range(64)))
            if per_step == 4:
                low = builder.and_(packed, ir.Constant(bytes64, [15] * 64))
                high = builder.lshr(packed, ir.Constant(bytes64, [4] * 64))
                if kind >= 3:  # e2m1 codes or iq4 levels -> unsigned integers, one table look-up a byte
                    shuffle = cgutils.get_or_insert_function(
                        builder.module, ir.FunctionType(bytes64, [bytes64] * 2), "llvm.x86.avx512.pshuf.b.512")
                    table = ir.Constant(bytes64, list(E2M1_TWICE_PLUS_12 if kind == 3 else IQ4_PLUS_128) * 4)
                    low, high = builder.call(shuffle, [table, low]), builder.call(shuffle, [table, high])
                pairs = [(low, 0), (high, 64)]
            locality = _block_locality(tokens)
            for line in range(0, size * per_step, 64):  # see _PREFETCH_BYTES
                builder.call(prefetch, [builder.gep(flat_a.data, [plus(at_i, _ahead(locality) + line)]),
                                        ir.Constant(i32, 0), ir.Constant(i32, locality), ir.Constant(i32, 1)])
            scales = None
            if kind == 3:  # e8m0: a power of two, from the table; the e2m1 integers are twice the value
                scales = ir.Constant(vector(f32, 4), ir.Undefined)
                for j in range(4):
                    exponent = builder.zext(load(flat_a, plus(at_i, j * size), i8), i32)
                    value = builder.fmul(load(e8m0_a, exponent, f32, 4), ir.Constant(f32, 0.5))
                    scales = builder.insert_element(scales, value, ir.Constant(i32, j))
                scales = per_lane(scales)
            elif kind != 0:  # fp16 scales, each repeated over its block's lanes before one conversion
                if (kind == 2 or kind == 4) and _Q4_PERMUTE:  # from the first load
                    halves = builder.shuffle_vector(builder.bitcast(head, vector(i16, 32)),
                                                    ir.Constant(vector(i16, 32), ir.Undefined),
                                                    mask([(lane // per_block) * size // 2 for lane in range(16)]))
                else:
                    halves = ir.Constant(vector(i16, per_step), ir.Undefined)
                    for j in range(per_step):
                        halves = builder.insert_element(halves, load(flat_a, plus(at_i, j * size), i16),
                                                        ir.Constant(i32, j))
                    halves = builder.shuffle_vector(halves, halves,
                                                    mask([lane // per_block for lane in range(16)]))
                scales = builder.fpext(builder.bitcast(halves, vector(ir.HalfType(), 16)), lanes)
            return pairs, scales

        accs = [[cgutils.alloca_once_value(builder, ir.Constant(lanes, [0.0] * 16)) for _ in x_bases] for _ in at_list]
        with cgutils.for_range(builder, steps_v) as loop:
            x_i = builder.mul(loop.index, ir.Constant(index_t, 32 * per_step))
            weights = [unpack(step_of(at_v, loop.index, size * per_step)) for at_v in at_list]
            for row_accs, (pairs, scales) in zip(accs, weights):
                for acc_p, x_base, l_base in zip(row_accs, x_bases, l_bases):
                    x_t = builder.add(x_base, x_i)
                    dot = ir.Constant(words, [0] * 16)
                    for codes, shift in pairs:
                        dot = builder.call(dpbusd, [dot, builder.bitcast(codes, words),
                                                    builder.bitcast(load(xq_a, plus(x_t, shift), bytes64), words)])
                    # the activations' side of the step, laid out lane by lane once per vector
                    # (``lanes``): the scale of each lane's block, and minus its sum times the
                    # codes' offset over the block's lanes
                    l_i = builder.add(l_base, builder.mul(loop.index, ir.Constant(index_t, 16)))
                    term = builder.call(fma, [builder.sitofp(dot, lanes), load(lanes_a, l_i, lanes, 4),
                                              load(lanes_a, builder.add(l_i, lspan_v), lanes, 4)])
                    if scales is None:  # int8: the row scale is the caller's
                        builder.store(builder.fadd(builder.load(acc_p), term), acc_p)
                    else:
                        builder.store(builder.call(fma, [scales, term, builder.load(acc_p)]), acc_p)
        return [[_reduce_lanes(builder, builder.load(acc_p), builder.fadd) for acc_p in row_accs] for row_accs in accs]

    if not tokens:
        @intrinsic
        def row(typingctx, flat, at, steps, xq, lanes, lbase, lspan, e8m0):  # type: ignore[no-untyped-def]
            def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
                flat_a, xq_a, lanes_a, e8m0_a = _arrays(context, builder, signature, args, (0, 3, 4, 7))
                at_v, steps_v, lbase_v, lspan_v = _indices(context, builder, signature, args, (1, 2, 5, 6))
                zero = ir.Constant(at_v.type, 0)
                return emit(context, builder, flat_a, xq_a, lanes_a, e8m0_a, [at_v], steps_v, [zero], [lbase_v],
                            lspan_v)[0][0]

            return types.float32(flat, at, steps, xq, lanes, lbase, lspan, e8m0), codegen

        return row

    @intrinsic
    def rows_tokens(typingctx, flat, at, rstride, steps, xq, xbase, xstride, lanes, lbase, lspan, lstride, e8m0, out,
                    obase, ostride):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            flat_a, xq_a, lanes_a, e8m0_a, out_a = _arrays(context, builder, signature, args, (0, 4, 7, 11, 12))
            at_v, rstride_v, steps_v, xbase_v, xstride_v, lbase_v, lspan_v, lstride_v, obase_v, ostride_v = _indices(
                context, builder, signature, args, (1, 2, 3, 5, 6, 8, 9, 10, 13, 14))
            sums = emit(context, builder, flat_a, xq_a, lanes_a, e8m0_a,
                        [_nth(builder, at_v, rstride_v, r) for r in range(rows)], steps_v,
                        [_nth(builder, xbase_v, xstride_v, t) for t in range(tokens)],
                        [_nth(builder, lbase_v, lstride_v, t) for t in range(tokens)], lspan_v)
            _store_tile(builder, out_a, sums, obase_v, ostride_v)
            return context.get_dummy_value()

        return (types.void(flat, at, rstride, steps, xq, xbase, xstride, lanes, lbase, lspan, lstride, e8m0, out, obase,
                           ostride), codegen)

    return rows_tokens


_int8_row, _q8_0_row, _q4_0_row, _mxfp4_row, _iq4_nl_row = (_row_intrinsic(kind) for kind in range(5))
# Rows x tokens a call of the batched kernel's row intrinsics, per kind (q8_0, q4_0, mxfp4,
# iq4_nl). Measured at Mixtral's 14336 x 4096 with 64 tokens, the variants compiled side by side
# and timed in 15 interleaved rounds (medians, two threads): q4_0 1 x 4 270 GOP/s, 1 x 8 200,
# 2 x 4 440, 4 x 2 430-530, 8 x 2 440-480, 4 x 4 400-450; q8_0 (two blocks a step, half the
# products per unpacked step) 4 x 2 320, 8 x 2 375-385, 4 x 4 310; mxfp4 4 x 2 410, 8 x 2 315.
# One row with several tokens reloads every token's activations for each row from L2; several
# rows share them. More accumulators than these spill registers.
TILE_TOKENS = 2
TILE_ROWS = (0, 8, 4, 4, 4)
_q8_0_tile, _q4_0_tile, _mxfp4_tile, _iq4_nl_tile = (_row_intrinsic(kind, TILE_TOKENS, TILE_ROWS[kind])
                                                     for kind in range(1, 5))


@intrinsic
def bf16_dot(typingctx, w, at, steps, x):  # type: ignore[no-untyped-def]
    """``sum(w[at:at + 16 * steps] * x[:16 * steps])`` for bf16 bit patterns w (uint16) and
    float32 x, 16 lanes a step, each bf16 widened to float32 exactly (its bits moved up 16), the
    row asked for ``_PREFETCH_BYTES`` ahead. A router's rows (Qwen3-30B-A3B's 128 x 2048), two
    threads: Numba's loop, widening each row into a new array first, took 33 us from the caches
    (26 this way), and the routing inside a decode step 78-85 us (45-55)."""
    from llvmlite import ir

    i16, i32, f32 = ir.IntType(16), ir.IntType(32), ir.FloatType()
    floats = ir.VectorType(f32, 16)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        w_a, x_a = _arrays(context, builder, signature, args, (0, 3))
        at_v, steps_v = _indices(context, builder, signature, args, (1, 2))
        index_t = at_v.type
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(floats, [floats] * 3), "llvm.fma.v16f32")
        prefetch = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), i32, i32, i32]),
            "llvm.prefetch.p0i8")
        accs = [cgutils.alloca_once_value(builder, ir.Constant(floats, [0.0] * 16)) for _ in range(4)]

        def step(i, acc_p):  # type: ignore[no-untyped-def]
            at_i = builder.add(at_v, builder.mul(i, ir.Constant(index_t, 16)))
            bits = builder.load(builder.bitcast(builder.gep(w_a.data, [at_i]), ir.VectorType(i16, 16).as_pointer()),
                                align=2)
            wide = builder.shl(builder.zext(bits, ir.VectorType(i32, 16)), ir.Constant(ir.VectorType(i32, 16), [16] * 16))
            xs = builder.load(builder.bitcast(builder.gep(x_a.data, [builder.mul(i, ir.Constant(index_t, 16))]),
                                              floats.as_pointer()), align=4)
            builder.store(builder.call(fma, [builder.bitcast(wide, floats), xs, builder.load(acc_p)]), acc_p)
            return at_i

        # four accumulators, 64 values a turn: one would wait on its own fma's latency each step
        quads = builder.udiv(steps_v, ir.Constant(index_t, 4))
        with cgutils.for_range(builder, quads) as loop:
            first = builder.mul(loop.index, ir.Constant(index_t, 4))
            at_i = step(first, accs[0])
            for line in (0, 32):  # the turn's two 64-byte lines, _PREFETCH_BYTES ahead
                ahead = builder.gep(w_a.data, [builder.add(at_i, ir.Constant(index_t, _PREFETCH_BYTES // 2 + line))])
                builder.call(prefetch, [builder.bitcast(ahead, ir.IntType(8).as_pointer()), ir.Constant(i32, 0),
                                        ir.Constant(i32, 1), ir.Constant(i32, 1)])
            for k in (1, 2, 3):
                step(builder.add(first, ir.Constant(index_t, k)), accs[k])
        with cgutils.for_range(builder, builder.sub(steps_v, builder.mul(quads, ir.Constant(index_t, 4)))) as loop:
            step(builder.add(builder.mul(quads, ir.Constant(index_t, 4)), loop.index), accs[0])
        total = builder.fadd(builder.fadd(builder.load(accs[0]), builder.load(accs[1])),
                             builder.fadd(builder.load(accs[2]), builder.load(accs[3])))
        return _reduce_lanes(builder, total, builder.fadd)

    return types.float32(w, at, steps, x), codegen


def _fp8_rows_intrinsic(count: int):  # type: ignore[no-untyped-def]
    """``rows(flat, at, stride, blocks, x, out, oat)``: ``count`` rows of ``blocks`` fp8_e4m3
    blocks (each a float32 scale, then 128 e4m3 codes: ``ktc.formats.codec_fp8``), the first at
    byte ``at`` of flat and each ``stride`` bytes after the last, times float32 x, into
    out[oat:oat + count]; 16 codes a step, each step's 16 values of x loaded once for every row
    (x is four times a row's bytes; one token through a Mixtral-8x7B-shaped expert: four rows at
    a time 60-61% of the read bandwidth, one at a time 55-59%).

    A code becomes its float32 exactly without a table: its 7 magnitude bits moved into a
    float32's exponent and mantissa (bits 20-26) name 2^-120 times its value, subnormals
    included (float32 denormals: exact where the CPU does not treat denormal inputs as zero, as
    it does not unless asked), and its sign moved to the float's (the code sign-extended,
    shifted and masked: three instructions for 16 codes). The 2^120 is made up by multiplying
    x by 2^64 and each block's scale by 2^56 (powers of two: the same products, exactly), not
    each code. NaN codes (0x7F, 0xFF; ktc's import refuses or replaces them) read as 480. Each
    row's block products are summed in two accumulators (four for one row), so that a step's
    multiply-adds do not wait on the last step's, then scaled into the row's sum. The rows
    asked for ``_PREFETCH_BYTES`` ahead."""
    from llvmlite import ir

    i8, i32, f32 = ir.IntType(8), ir.IntType(32), ir.FloatType()
    floats, words = ir.VectorType(f32, 16), ir.VectorType(i32, 16)
    chains = 2 if count > 1 else 4

    @intrinsic
    def rows(typingctx, flat, at, stride, blocks, x, out, oat):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            flat_a, x_a, out_a = _arrays(context, builder, signature, args, (0, 4, 5))
            at_v, stride_v, blocks_v, oat_v = _indices(context, builder, signature, args, (1, 2, 3, 6))
            index_t = at_v.type
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(floats, [floats] * 3),
                                                 "llvm.fma.v16f32")

            def const(k):  # type: ignore[no-untyped-def]
                return ir.Constant(index_t, k)

            def splat(value, t):  # type: ignore[no-untyped-def]
                return ir.Constant(t, [value] * 16)

            sums = [cgutils.alloca_once_value(builder, ir.Constant(floats, [0.0] * 16)) for _ in range(count)]
            with cgutils.for_range(builder, blocks_v) as loop:
                bases = [builder.add(builder.add(at_v, builder.mul(stride_v, const(r))), builder.mul(loop.index, const(132)))
                         for r in range(count)]
                for base in bases:
                    _prefetch_ahead(builder, flat_a, base, 132)  # the block's lines
                accs: list[list] = [[None] * chains for _ in range(count)]  # type: ignore[type-arg]
                for step in range(8):
                    xat = builder.add(builder.mul(loop.index, const(128)), const(16 * step))
                    xs = builder.fmul(builder.load(builder.bitcast(builder.gep(x_a.data, [xat]), floats.as_pointer()),
                                                   align=4), splat(2.0 ** 64, floats))
                    for r, base in enumerate(bases):
                        codes = builder.load(builder.bitcast(builder.gep(flat_a.data, [builder.add(base, const(4 + 16 * step))]),
                                                             ir.VectorType(i8, 16).as_pointer()), align=1)
                        value = e4m3_scaled_floats(builder, codes)
                        c = step % chains
                        held = accs[r][c]
                        accs[r][c] = builder.fmul(value, xs) if held is None else builder.call(fma, [value, xs, held])
                for r, base in enumerate(bases):
                    block = accs[r][0]
                    for more in accs[r][1:]:
                        block = builder.fadd(block, more)
                    scale = builder.fmul(builder.load(builder.bitcast(builder.gep(flat_a.data, [base]), f32.as_pointer()),
                                                      align=1), ir.Constant(f32, 2.0 ** 56))
                    one = builder.insert_element(ir.Constant(floats, ir.Undefined), scale, ir.Constant(i32, 0))
                    scales = builder.shuffle_vector(one, ir.Constant(floats, ir.Undefined), ir.Constant(words, [0] * 16))
                    builder.store(builder.call(fma, [block, scales, builder.load(sums[r])]), sums[r])
            for r in range(count):
                total = _reduce_lanes(builder, builder.load(sums[r]), builder.fadd)
                builder.store(total, builder.gep(out_a.data, [builder.add(oat_v, const(r))]))
            return context.get_dummy_value()

        return types.void(flat, at, stride, blocks, x, out, oat), codegen

    return rows


_fp8_one, _fp8_four = _fp8_rows_intrinsic(1), _fp8_rows_intrinsic(4)
_FP8_VALUES = FP8_E4M3_VALUES.astype(np.float32)


@njit(cache=True, nogil=True, inline="always")
def fp8_rows(flat, at, stride, count, blocks, x, out, oat):  # pragma: no cover - compiled
    """``count`` fp8_e4m3 rows (``_fp8_rows_intrinsic``: the first at byte ``at`` of flat, each
    ``stride`` bytes on) times x into out[oat:oat + count], four rows at a time where compiled;
    without JIT the same sums through the codes' table."""
    if _COMPILED:
        four = count // 4 * 4
        for r in range(0, four, 4):
            _fp8_four(flat, at + r * stride, stride, blocks, x, out, oat + r)
        for r in range(four, count):
            _fp8_one(flat, at + r * stride, stride, blocks, x, out, oat + r)
        return
    for r in range(count):
        total = np.float32(0.0)
        for b in range(blocks):
            base = at + r * stride + 132 * b
            acc = np.float32(0.0)
            for j in range(128):
                acc += _FP8_VALUES[flat[base + 4 + j]] * x[128 * b + j]
            total += flat[base:base + 4].copy().view(np.float32)[0] * acc
        out[oat + r] = total


@njit(cache=True, nogil=True)
def zeros64(n, dtype):  # pragma: no cover - compiled
    """``np.zeros(n, dtype)`` starting on a 64-byte boundary (a cache line). Numba's and numpy's
    arrays are only sure to start on 16 or 32 bytes (Numba's of a few KB started 32 bytes past a
    line here), and off a line every 64-byte load of the batched tiles' activations spans two:
    on the Zen 5 machine (one thread, 4-row x 32-token q4_0 tiles over 4096 values, activations
    in L2) 6.1-6.2 ``vpdpbusd`` a nanosecond aligned, 3.5-3.7 at 4 or 16 bytes past a line."""
    whole = np.zeros(n + 64, dtype)  # 64 spare values: at least a line's bytes for any itemsize
    first = ((-whole.ctypes.data) % 64) // whole.itemsize
    return whole[first:first + n]


@intrinsic
def _cycles(typingctx):  # type: ignore[no-untyped-def]
    """The CPU's cycle counter (``rdtsc``): stamps inside compiled code, read by the MoE layer
    benchmark (``STAMPS``)."""
    from llvmlite import ir

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                            "llvm.readcyclecounter")
        return builder.call(fn, [])

    return types.int64(), codegen


@intrinsic
def _fetch_add(typingctx, counters, at, amount):  # type: ignore[no-untyped-def]
    """counters[at] += amount atomically (int64 array), returning the value before."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        (arr,) = _arrays(context, builder, signature, args, (0,))
        at_v, amount_v = _indices(context, builder, signature, args, (1, 2))
        return builder.atomic_rmw("add", builder.gep(arr.data, [at_v]), amount_v, "monotonic")

    return types.int64(counters, at, amount), codegen


@njit(cache=True, nogil=True, inline="always")
def next_chunk(taken, size, rows):  # pragma: no cover - compiled
    """The first row and the row count of the next chunk of ``size`` rows of ``rows`` that a
    worker of a parallel region takes (``taken[0]`` counts the chunks handed out); a count of 0
    or less when none is left."""
    first = fetch_add(taken, 0, 1) * size
    return first, min(size, rows - first)


@njit(cache=True, nogil=True, inline="always")
def fetch_add(counters, at, amount):  # pragma: no cover - compiled
    """counters[at] += amount (atomically where compiled), returning the value before: how the
    threads of a parallel region take work items (``work_item``)."""
    if _COMPILED:
        return _fetch_add(counters, at, amount)
    taken = counters[at]
    counters[at] = taken + amount
    return taken


@intrinsic
def _threads(typingctx):  # type: ignore[no-untyped-def]
    """The threads of the parallel regions (the threading layer's ``get_num_threads``, the
    symbol Numba's parallel loops call). ``numba.get_num_threads`` reads it through a ctypes
    pointer, which keeps a function from being cached."""
    from llvmlite import ir

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []), "get_num_threads")
        return builder.call(fn, [])

    return types.int64(), codegen


@njit(cache=True, nogil=True, inline="always")
def thread_count():  # pragma: no cover - compiled
    """The parallel regions' threads (1 without JIT); called inside parallel functions only,
    whose loading starts the threading layer that provides it."""
    if _COMPILED:
        return _threads()
    return 1


# Bytes of weights a work item of a one-token matrix-vector product (``item_rows``): rows in
# items of this size, taken through ``work_item``, read a 151936 x 2048 q4_0 matrix (Qwen3-30B-
# A3B's output matrix) 3-4% faster than Numba's equal halves of 64-row chunks (51.0 against 49.1
# GB/s from memory, medians of 9 rounds; 64-row items through ``work_item`` 50.0, or 50.8 with
# their scratch allocated once a thread; 2048-row items as 512).
ITEM_BYTES = 512 * 1024


@njit(cache=True, nogil=True)
def item_rows(row_bytes, rows, threads):  # pragma: no cover - compiled
    """Rows a work item of a one-token product over ``rows`` rows of ``row_bytes`` bytes on
    ``threads`` threads: about ``ITEM_BYTES``, but at least 8 items a thread where the matrix is
    smaller (so a thread slowed down still has items to give away), and at least 16 rows."""
    return max(16, min(ITEM_BYTES // row_bytes, rows // (8 * threads)))


@njit(cache=True, nogil=True, inline="always")
def row_items(row_bytes, rows):  # pragma: no cover - compiled
    """(threads, rows an item, items, counters) of a one-token product's balanced region over
    ``rows`` rows of ``row_bytes`` bytes (``item_rows``, ``work_item``); called inside the
    parallel function, before its ``prange(threads)``."""
    threads = thread_count()
    size = item_rows(row_bytes, rows, threads)
    return threads, size, (rows + size - 1) // size, work_counters(threads)


@njit(cache=True, nogil=True, inline="always")
def next_rows(counters, t, threads, items, size, rows):  # pragma: no cover - compiled
    """The first row and the end of thread t's next item of ``row_items``' region, or (-1, -1)
    when none is left."""
    item = work_item(counters, t, threads, items)
    if item < 0:
        return -1, -1
    return item * size, min(rows, item * size + size)


@njit(cache=True, nogil=True)
def work_counters(threads):  # pragma: no cover - compiled
    """The counters ``work_item`` claims items with, for a region of ``threads`` threads: one per
    thread's part, each on a cache line of its own."""
    return np.zeros(8 * threads, np.int64)


_BACK = 1 << 32  # a part's counter: items taken from its front (low 32 bits) and its back


@njit(cache=True, nogil=True, inline="always")
def work_item(counters, t, threads, total):  # pragma: no cover - compiled
    """The next of ``total`` work items for the thread of iteration t of ``prange(threads)``, or
    -1 when none is left. The items are split into ``threads`` contiguous parts; a thread takes
    its own part's from the front, then the other parts' from their back (one atomic counter a
    part, front and back in one word, so the two never take the same item), and so reads its
    weights in one forward stream until it helps another. Numba's prange gives each thread an
    equal part and no more: at Qwen3-30B-A3B's shape the two threads of a decode step's gate/up
    region finished a median 117 us apart (of 830), a faster thread's weights partly in the
    caches or its requests served first. The one-token experts' call took 1-5% less this way
    (per-pair medians of 200 calls interleaved with equal parts, cold weights: Qwen3-30B-A3B's
    shape Q4_0 0.96-0.99, Q8_0 0.97, MXFP4 0.98, Q4_K_M 0.95; Mixtral-8x7B's Q4_0 0.98). Taken
    from both ends of one part, the back thread's prefetches ran past each item into rows read
    already (the down region 5% slower); handed out in turn, no faster than equal parts."""
    for k in range(threads):
        part = t + k if t + k < threads else t + k - threads
        start, end = part * total // threads, (part + 1) * total // threads
        both = fetch_add(counters, 8 * part, 1 if k == 0 else _BACK)
        front, back = both & (_BACK - 1), both >> 32
        if front + back < end - start:
            return start + front if k == 0 else end - 1 - back
    return -1


@njit(cache=True, nogil=True)
def cycles():  # pragma: no cover - compiled
    """The cycle counter, from Python (to scale ``STAMPS`` to seconds)."""
    return _cycles()


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _matvec_int4_vnni(flat, words, row_bytes, rows, cols, group, xq, dx, xsum, out):  # pragma: no cover - compiled
    # flat: the matrix's bytes (rows of codes, bf16 scales, bf16 minimums), words: the same bytes
    # as uint16; xq: x in int8 per group, dx: their scales, xsum: dx times the sum of xq per group;
    # row r = sum_g d_g dx_g (codes . xq)_g + m_g xsum_g. One row at a time, ``item_rows`` rows a
    # work item: faster here than four rows side by side (19 against 26 GB/s from memory).
    groups = cols // group
    half = group // 2
    threads, size, items, counters = row_items(row_bytes, rows)
    for t in prange(threads):
        while True:
            first, end = next_rows(counters, t, threads, items, size, rows)
            if first < 0:
                break
            for r in range(first, end):
                base = r * row_bytes
                out[r] = _int4_row(half, flat, base, groups, xq, dx, xsum, words, (base + cols // 2) // 2)


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _matvec_blocks_vnni(raw, kind, f32, f16, e8m0, xq, dx, xsum, out):  # pragma: no cover - compiled
    # W @ x for one matrix of BLOCK_KINDS[kind] stored as C-contiguous rows raw, the
    # activations quantized per 32 values (xq, dx, xsum).
    rows, row_bytes = raw.shape
    flat = raw.reshape(-1)
    lanes = _lanes(dx.reshape(1, -1), xsum.reshape(1, -1))[0]
    threads, size, items, counters = row_items(row_bytes, rows)
    for t in prange(threads):
        acc = np.zeros(16, np.float32)
        while True:
            first, end = next_rows(counters, t, threads, items, size, rows)
            if first < 0:
                break
            _block_rows(kind, flat, f32, f16, e8m0, 0, row_bytes, first, end, xq, dx, xsum, lanes, out, acc)


@njit(cache=True, nogil=True, inline="always")  # inlined into the parallel kernels that call it
def _lanes(dx, xsum):  # pragma: no cover - compiled
    """The activations' side of ``_row_intrinsic``'s steps, lane by lane, for n vectors quantized
    per 32 values (dx, xsum [n, blocks]): [n, 8 * span], span = blocks * 8, holding for the
    steps of two blocks (int8, q8_0), of four q4_0 blocks, of four mxfp4 blocks and of four
    iq4_nl blocks each lane's
    block scale (span values), then minus its block sum times the codes' offset over the block's
    lanes (span values). Built once a vector instead of per step of every row: the per-lane
    shuffles and products took a third of a 4-bit row's instructions, which bound the kernels
    at about 32 GB/s on two cores."""
    n, blocks = dx.shape
    out = np.zeros((n, 64 * blocks), np.float32)
    for v in range(n):
        lanes_into(dx[v], xsum[v], out[v], _ALL_PARTS)
    return out


_ALL_PARTS = np.ones(4, dtype=np.bool_)


@njit(cache=True, nogil=True)
def lanes_into(dx, xsum, out, parts):  # pragma: no cover - compiled
    """``_lanes`` of one vector (dx, xsum [blocks]) into out [64 * blocks], the parts ``parts``
    says (int8 and q8_0, q4_0, mxfp4, iq4_nl) only: a kind's rows read their own part's lanes
    and no others."""
    blocks = dx.shape[0]
    span = blocks * 8
    for part in range(4):  # int8/q8_0, q4_0, mxfp4, iq4_nl
        if not parts[part]:
            continue
        per_step = 2 if part == 0 else 4
        per_block = 16 // per_step
        offset = np.float32(_CODE_OFFSET[part + 1] / per_block)
        base = 2 * part * span
        # block b's lanes: per_block of them in its step's 16 (a block at a time: a lane at a
        # time, with two integer divisions each, this took 10 us for a layer's 8 x 768 values)
        for b in range(blocks // per_step * per_step):
            at = base + (b // per_step) * 16 + (b % per_step) * per_block
            scale, term = dx[b], -offset * xsum[b]
            for t in range(per_block):
                out[at + t] = scale
                out[at + span + t] = term


@njit(cache=True, nogil=True, inline="always")
def _block_row(kind, flat, f16, e8m0, base, blocks, xq, dx, xsum, lanes, acc):  # pragma: no cover - compiled
    # The row of ``blocks`` blocks of BLOCK_KINDS[kind] at byte ``base`` times the activations
    # (int8 xq, quantized per 32 values: dx[b], xsum[b]; ``lanes``: _lanes of them). kind 0:
    # int8 (the row's codes, then a float32 row scale: not applied here), 1: q8_0, 2: q4_0,
    # 3: mxfp4, 4: iq4_nl (ggml blocks).
    # Whole steps of the row in LLVM's loop (_row_intrinsic), then the blocks past the last
    # whole step one by one (their activations in order): at most three, in rows that are not
    # whole steps (gpt-oss's 2880 values), so one loop serves every kind.
    span = lanes.shape[0] // 8
    if kind == 0:
        total, step = _int8_row(flat, base, blocks // 2, xq, lanes, 0, span, e8m0), 2
    elif kind == 1:
        total, step = _q8_0_row(flat, base, blocks // 2, xq, lanes, 0, span, e8m0), 2
    elif kind == 2:
        total, step = _q4_0_row(flat, base, blocks // 4, xq, lanes, 2 * span, span, e8m0), 4
    elif kind == 3:
        total, step = _mxfp4_row(flat, base, blocks // 4, xq, lanes, 4 * span, span, e8m0), 4
    else:
        total, step = _iq4_nl_row(flat, base, blocks // 4, xq, lanes, 6 * span, span, e8m0), 4
    if blocks % step == 0:
        return total
    acc[:] = 0
    shift = np.float32(0.0)
    size = (32, 34, 18, 17, 18)[kind]
    for b in range(blocks // step * step, blocks):
        at = base + b * size
        if kind == 0:  # the row scale is the caller's
            _signed_bytes32(acc, flat, at, xq, b * 32, dx[b])
            shift += xsum[b]
            continue
        if kind == 3:
            d = np.float32(0.5) * e8m0[flat[at]]
        else:
            d = f16[np.uint16(flat[at]) | (np.uint16(flat[at + 1]) << np.uint16(8))]
        if kind == 1:
            _signed_bytes32(acc, flat, at + 2, xq, b * 32, d * dx[b])
        elif kind == 2:
            _group16(acc, flat, at + 2, xq, b * 32, d * dx[b])
        elif kind == 3:
            _e2m1_group16(acc, flat, at + 1, xq, b * 32, d * dx[b])
        else:
            _iq4_group16(acc, flat, at + 2, xq, b * 32, d * dx[b])
        shift += d * xsum[b]
    return total + acc.sum() - np.float32(_CODE_OFFSET[kind]) * shift


@njit(cache=True, nogil=True, inline="always")
def _block_rows(kind, flat, f32, f16, e8m0, base, row_bytes, r0, r1, xq, dx, xsum, lanes, out,
                acc):  # pragma: no cover - compiled
    # out[r] for rows r0..r1 of the matrix of BLOCK_KINDS[kind] at byte ``base`` of flat; acc:
    # 16 float32s of scratch, the caller's (a thread's, allocated once per parallel region: one
    # allocated per work item of 64 rows cost 1.6% of a 151936 x 2048 q4_0 matrix's time).
    cols = xq.shape[0]
    for r in range(r0, r1):
        out[r] = _block_row(kind, flat, f16, e8m0, base + r * row_bytes, cols // 32, xq, dx, xsum, lanes, acc)
        if kind == 0:
            out[r] *= f32[(base + r * row_bytes + cols) // 4]


BATCH_ROWS = 16  # rows a work item of the batched kernel: every token goes over them while they stay in L1/L2


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _blocks_batched_groups(flat, kind, offsets, row_bytes, f16, e8m0, xq, dx, xsum, cols, lanes, width, groups,
                           out):  # pragma: no cover - compiled
    # Matrices of BLOCK_KINDS[kind] (1-4) times their tokens' activations (xq [n, >= cols],
    # quantized per 32 in the kind's layout, dx and xsum their scales and sums; lanes [n, >=
    # width]: their _lanes): group g is the matrix at byte offsets[g] of flat (row_bytes a row,
    # out.shape[1] rows, whole steps of the row loop: cols a multiple of 64, or of 128 for the
    # 4-bit kinds) times tokens groups[g]..groups[g + 1], into those rows of out. TILE_ROWS[kind]
    # x TILE_TOKENS a call of the row intrinsic, the rows and tokens past the last whole tile one
    # by one; work items of BATCH_ROWS rows of a group (work_item), so one matrix's tokens, or
    # the few tokens of many experts (a prompt chunk's experts of 2-11 tokens), share one
    # parallel region.
    rows = out.shape[1]
    xstride = xq.shape[1]
    lstride = lanes.shape[1]
    steps = cols // (64 if kind < 2 else 128)
    span = width // 8
    lbase = 2 * (kind - 1) * span if kind >= 2 else 0
    tile = TILE_ROWS[kind]
    xf, lf, of = xq.reshape(-1), lanes.reshape(-1), out.reshape(-1)
    chunks = (rows + BATCH_ROWS - 1) // BATCH_ROWS
    total = (groups.shape[0] - 1) * chunks
    threads = thread_count()
    counters = work_counters(threads)
    for th in prange(threads):
        acc = np.zeros(16, np.float32)
        while True:
            item = work_item(counters, th, threads, total)
            if item < 0:
                break
            g = item // chunks
            first = (item - g * chunks) * BATCH_ROWS
            last = min(rows, first + BATCH_ROWS)
            base, t0, t1 = offsets[g], groups[g], groups[g + 1]
            whole = t0 + (t1 - t0) // TILE_TOKENS * TILE_TOKENS
            tiled = first + (last - first) // tile * tile
            for t in range(t0, whole, TILE_TOKENS):
                for r in range(first, tiled, tile):
                    args = (flat, base + r * row_bytes, row_bytes, steps, xf, t * xstride, xstride, lf,
                            lbase + t * lstride, span, lstride, e8m0, of, t * rows + r, rows)
                    if kind == 1:
                        _q8_0_tile(*args)
                    elif kind == 2:
                        _q4_0_tile(*args)
                    elif kind == 3:
                        _mxfp4_tile(*args)
                    else:
                        _iq4_nl_tile(*args)
            for t in range(t0, t1):
                for r in range(tiled if t < whole else first, last):
                    out[t, r] = _block_row(kind, flat, f16, e8m0, base + r * row_bytes, cols // 32, xq[t, :cols],
                                           dx[t], xsum[t], lanes[t, :width], acc)


@njit(cache=True, nogil=True)
def padded_activations(x, kind):  # pragma: no cover - compiled
    """(xq, dx, sums, lanes, width) of the batched block kernels for tokens x [n, cols] and
    matrices of BLOCK_KINDS ``kind``: each token's activations quantized per 32 in the kind's
    layout and its lanes (width of them), each row one cache line further than a multiple of 4
    KB from the last: a tile reads the same step of each of its tokens, which at strides of
    whole pages would fall into one set of the L1 cache."""
    n, cols = x.shape
    xq, quads, dx, sums = _quantized_both(x.reshape(-1), n, cols, kind < 2, kind >= 2)
    lanes = _lanes(dx, sums)
    padded_x = np.empty((n, cols + 64), np.int8)
    padded_x[:, :cols] = quads if kind >= 2 else xq
    width = lanes.shape[1]
    padded_lanes = np.empty((n, width + 16), np.float32)
    padded_lanes[:, :width] = lanes
    return padded_x, dx, sums, padded_lanes, width


@njit(cache=True, nogil=True)
def _batched_token_blocks(raw, kind, f16, e8m0, x, out):  # pragma: no cover - compiled
    xq, dx, sums, lanes, width = padded_activations(x, kind)
    _blocks_batched_groups(raw.reshape(-1), kind, np.zeros(1, np.int64), raw.shape[1], f16, e8m0, xq, dx, sums,
                           x.shape[1], lanes, width, np.array([0, x.shape[0]], np.int64), out)


def batched_fits(scheme: str, cols: int) -> bool:
    """Whether ``matmul_blocks`` takes matrices of ``scheme`` with rows of ``cols`` values (int8
    has torch's int8 GEMM, its scales being per row)."""
    kind = BLOCK_KINDS.get(scheme, 0)
    return HAVE_VNNI and _COMPILED and kind > 0 and cols % (64 if kind < 2 else 128) == 0


def matmul_blocks(x: np.ndarray, raw: np.ndarray, scheme: str) -> np.ndarray:
    """``x @ W.T`` (float32 [n, rows]) for tokens x [n, cols] and one matrix of ``BLOCK_KINDS``
    stored as C-contiguous uint8 rows ``raw``, without decoding it: each token's activations
    quantized to int8 per block of 32 (as the one-token kernels and llama.cpp's q8 activations),
    the weights read in their stored layout, tiles of ``TILE_ROWS`` rows by ``TILE_TOKENS``
    tokens a step (``batched_fits``: the rows are whole steps of the row loop)."""
    x, raw = writable(np.ascontiguousarray(x, dtype=np.float32)), read_only(raw)
    out = np.empty((x.shape[0], raw.shape[0]), dtype=np.float32)
    f16, e8m0 = _tables()
    _batched_token_blocks(raw, BLOCK_KINDS[scheme], f16, e8m0, x, out)
    return out


# Schemes with a multi-expert kernel (``rows``' kinds).
BLOCK_KINDS = {"int8": 0, "q8_0": 1, "q4_0": 2, "mxfp4": 3, "iq4_nl": 4}
# ggml's K-quants and iq4_xs: rows_many runs them with the block kinds (``rows.rows_many``).
KQUANTS = frozenset({"q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs"})
FUSED = set(BLOCK_KINDS) | KQUANTS | {"fp8_e4m3", "int4_g32", "int4_g64", "int4_g128"}


def _tables() -> tuple[np.ndarray, np.ndarray]:
    """The fp16 and e8m0 value tables the kernels take."""
    return F16_TO_F32, E8M0_TO_F32


# Set to an int64 array of STAMP_COUNT (benchmarks/expert_kernels.py does) to have each compiled
# one-token call stamp the cycle counter at its start, after quantizing x, after the gate/up kernel,
# after the activation, after quantizing it, after the down kernel and at its end; the MoE layer's
# call (``moe._moe_token``) stamps its routing's start and end too (7 and 8), and the end of the
# router's product (9).
STAMP_COUNT = 10
STAMPS: np.ndarray | None = None
_NO_STAMPS = np.zeros(0, dtype=np.int64)


def seconds_per_cycle() -> float:
    """Seconds a cycle of ``cycles``' counter, measured over 0.2 s (for reading STAMPS)."""
    import time

    cycles()  # compiled or loaded outside the measurement
    started, first = time.perf_counter(), cycles()
    time.sleep(0.2)
    return (time.perf_counter() - started) / (cycles() - first)


def stamp_parts(stamps: np.ndarray, per_cycle: float) -> dict[str, float]:
    """Seconds of the parts of the last one-token expert call that filled ``stamps`` (STAMPS):
    the activations' quantization (x's and the activation's), the two kernels, the activation
    function and the combination; with the MoE layer's stamps (7 to 9), its routing, of that the
    router's product, and the whole block from the routing's start to the combination's end.
    Empty when nothing stamped."""
    if stamps.shape[0] < 7 or not stamps[0]:
        return {}
    s = (stamps - stamps[0]) * per_cycle
    parts = {"quantize": s[1] + s[4] - s[3], "kernels": s[2] - s[1] + s[5] - s[4], "activation": s[3] - s[2],
             "combine": s[6] - s[5]}
    if stamps.shape[0] == STAMP_COUNT and stamps[7]:
        parts |= {"routing": s[8] - s[7], "router": s[9] - s[7], "block": s[6] - s[7]}
    return parts


def stamps() -> np.ndarray:
    """``STAMPS``, or an empty array (no stamps) when it is not set."""
    return _NO_STAMPS if STAMPS is None else STAMPS


@njit(cache=True, nogil=True)
def _quantized_both(x, n, cols, in_order, in_quads):  # pragma: no cover - compiled
    # n vectors of cols values quantized per 32: in order and/or in quad_layout (the same
    # scales and sums), as [n, cols] arrays; the one not needed is the other.
    groups = n * cols // 32
    dx = np.empty(groups, np.float32)
    sums = np.empty(groups, np.float32)
    ordered = np.empty(n * cols, np.int8)
    quads = np.empty(n * cols, np.int8) if in_order and in_quads else ordered
    if in_order:
        _quantize_groups(x, 32, 0, ordered, dx, sums)
    if in_quads:
        _quantize_groups(x, 32, cols, quads, dx, sums)
    return (ordered.reshape(n, cols), quads.reshape(n, cols), dx.reshape(n, cols // 32),
            sums.reshape(n, cols // 32))


@njit(cache=True, nogil=True, fastmath=True, error_model="numpy")
def activate(h, inter, clamped, limit, alpha, gu_bias, has_gu_bias):  # pragma: no cover - compiled
    """The k experts' gate/up outputs h [k, 2 * inter] (plus their biases) through the activation:
    SiLU(gate) * up, or gpt-oss's clamped SwiGLU; [k * inter], one expert after another.

    exp(-slope * gate) = 2^n * 2^f, n = round(y / ln 2), |f| <= 1/2: 2^f by Cephes' exp2f
    polynomial (relative error about 2e-7), 2^n made from its bits, y clamped to +-126 (float32's
    range), in one loop LLVM vectorizes (Numba vectorizes np.exp only through Intel's SVML
    library: a value at a time a layer's SiLU took 20-40 us). Numba's default error model checks
    every float division for a zero divisor, which keeps LLVM from vectorizing; here numpy's
    (1 + exp(-g) is never zero). No scratch vectors: inside a decode step, whose weights stream
    through the caches, five of the output's length were written to lines in no cache, each read
    from memory first (37 us for a Qwen3-30B-A3B-shaped layer's 8 x 768 values; 9 us when called
    twice). SiLU without biases in a loop of its own: the branches on the biases and the clamp
    inside the loop kept it from vectorizing fully (8 x 768 values from the caches: 10.2 us, and
    6.8 this way; calls from Python)."""
    k = h.shape[0]
    a = np.empty(k * inter, np.float32)
    one = np.float32(1.0)
    if not clamped and not has_gu_bias:
        for e in range(k):
            gate, up, out = h[e, :inter], h[e, inter:], a[e * inter:(e + 1) * inter]
            for j in range(inter):
                out[j] = silu_times(gate[j], up[j], LOG2E_NEG)
        return a
    log2e = LOG2E_NEG * (alpha if clamped else one)
    for e in range(k):
        for j in range(inter):
            g = h[e, j]
            u = h[e, inter + j]
            if has_gu_bias:
                g += gu_bias[e, j]
                u += gu_bias[e, inter + j]
            a[e * inter + j] = clamped_swiglu(g, u, limit, log2e) if clamped else silu_times(g, u, log2e)
    return a


@njit(nogil=True, fastmath=True, inline="always")
def _exp2_neg(y):  # pragma: no cover - compiled
    # 2^y for float32 y (``activate``): y clamped to +-126, 2^n from its bits, 2^f by Cephes'
    # exp2f polynomial; inlined into the loops, which LLVM vectorizes.
    y = min(max(y, np.float32(-126.0)), np.float32(126.0))
    whole = np.floor(y + np.float32(0.5))
    f = y - whole
    p = np.float32(1.535336188319500e-4)
    p = p * f + np.float32(1.339887440266574e-3)
    p = p * f + np.float32(9.618437357674640e-3)
    p = p * f + np.float32(5.550332471162809e-2)
    p = p * f + np.float32(2.402264791363012e-1)
    p = p * f + np.float32(6.931472028550421e-1)
    return np.int32((np.int32(whole) + np.int32(127)) << np.int32(23)).view(np.float32) * (p * f + np.float32(1.0))


LOG2E_NEG = np.float32(-1.4426950408889634)  # exp(-x) = 2^(x * LOG2E_NEG)


@njit(nogil=True, fastmath=True, inline="always")
def silu_times(g, u, slope):  # pragma: no cover - compiled
    # g * sigmoid(g * slope / LOG2E_NEG) * u: SiLU(gate) * up with slope LOG2E_NEG (a 2^ slope),
    # the clamped SwiGLU's sigmoid with alpha * LOG2E_NEG; inlined into vectorized loops.
    return g / (np.float32(1.0) + _exp2_neg(g * slope)) * u


@njit(nogil=True, fastmath=True, inline="always")
def clamped_swiglu(g, u, limit, slope):  # pragma: no cover - compiled
    # gpt-oss's clamped SwiGLU of one gate/up pair: the gate clamped above, up within +-limit, plus one
    return silu_times(min(g, limit), min(max(u, -limit), limit) + np.float32(1.0), slope)


_NO_ROW_SCALES = read_only(np.zeros(1, dtype=np.float32))  # the block kinds keep their scales in the blocks


def matvec_blocks(raw: np.ndarray, scheme: str, x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``W @ x`` for one matrix of ``BLOCK_KINDS`` stored as C-contiguous uint8 rows ``raw``
    with VNNI, the activations quantized to int8 per block of 32 as llama.cpp's dot products
    do."""
    raw = read_only(raw)
    f32 = raw.reshape(-1).view(np.float32) if scheme == "int8" else _NO_ROW_SCALES
    f16, e8m0 = _tables()
    _matvec_token(raw, BLOCK_KINDS[scheme], f32, f16, e8m0, writable(np.ascontiguousarray(x, dtype=np.float32)), out)
    return out


@njit(cache=True, nogil=True)
def _matvec_token(raw, kind, f32, f16, e8m0, x, out):  # pragma: no cover - compiled
    # The activations quantized (in quad_layout for q4_0 and mxfp4), then the kernel: one call
    # from Python instead of two (a decode step makes several per layer, each among streaming
    # weights that leave the Python around it slow).
    xq, xq_quads, dx, sums = _quantized_both(x, 1, x.shape[0], kind < 2, kind >= 2)
    _matvec_blocks_vnni(raw, kind, f32, f16, e8m0, xq_quads[0] if kind >= 2 else xq[0], dx[0], sums[0], out)


def quantize_activations(x: np.ndarray, group: int, row: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(int8 values, float32 scale per group, float32 sum per group of the quantized values) of
    ``x``: each group's values over its largest magnitude times 127, rounded to nearest. The
    sums are of the quantized values, so that the minimum term sees the same activations as the
    codes: then the result is exactly the dequantized weights times the quantized activations,
    whose error scales with the weights and not with weights minus their group minimum.

    With ``row`` (the length of each of x's rows; group 32) the int8 values are in
    ``quad_layout``, which the q4_0 and mxfp4 kernels read."""
    x = writable(np.ascontiguousarray(x, dtype=np.float32).reshape(-1))
    groups = x.shape[0] // group
    xq = np.empty(x.shape[0], dtype=np.int8)
    dx = np.empty(groups, dtype=np.float32)
    sums = np.empty(groups, dtype=np.float32)
    # One thread, compiled: the numpy version of these few lines cost 50 us a call, 0.3 ms of a
    # one-layer decode step, for a few thousand values.
    _quantize_groups(x, group, row, xq, dx, sums)
    return xq, dx, sums


@njit(cache=True, nogil=True, inline="always")
def quad_layout(j, row):  # pragma: no cover - compiled
    """Where value j of rows of ``row`` values goes when each whole 128 values of a row (four
    blocks of 32) are laid out as the four blocks' first 16 values, then their last 16: the
    order in which a 512-bit load of four blocks' packed nibbles holds their low, then their
    high nibbles (``_quad_intrinsic``). Values past a row's last whole 128 stay in place."""
    start = (j // row) * row
    k = j - start
    if k >= (row // 128) * 128:
        return j
    within = k % 128
    block, value = within // 32, within % 32
    return start + (k - within) + (value // 16) * 64 + block * 16 + value % 16


def _vector_codegen(builder, context, signature, args):  # type: ignore[no-untyped-def]
    """Helpers of the activations' quantization intrinsics: the 32 float32 values at ``at`` of
    the first argument (two 16-lane vectors), and calls of LLVM's vector functions."""
    from llvmlite import ir

    floats = ir.VectorType(ir.FloatType(), 16)
    x_a = context.make_array(signature.args[0])(context, builder, args[0])
    at_v = context.cast(builder, args[1], signature.args[1], types.intp)

    def call(name, ret, *values):  # type: ignore[no-untyped-def]
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [v.type for v in values]), name)
        return builder.call(fn, list(values))

    halves = [builder.load(builder.bitcast(builder.gep(x_a.data, [builder.add(at_v, ir.Constant(at_v.type, k))]),
                                           floats.as_pointer()), align=4) for k in (0, 16)]
    return halves, call


@intrinsic
def _amax32(typingctx, x, at):  # type: ignore[no-untyped-def]
    """The largest magnitude of x[at:at + 32] (NaN ignored), in vectors."""
    from llvmlite import ir

    floats = ir.VectorType(ir.FloatType(), 16)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        halves, call = _vector_codegen(builder, context, signature, args)
        largest = call("llvm.maxnum.v16f32", floats, *(call("llvm.fabs.v16f32", floats, h) for h in halves))
        return _reduce_lanes(builder, largest, lambda a, b: call(f"llvm.maxnum.v{a.type.count}f32", a.type, a, b))

    return types.float32(x, at), codegen


@intrinsic
def _codes32(typingctx, x, at, inverse, xq, first, second):  # type: ignore[no-untyped-def]
    """x[at:at + 32] times ``inverse``, rounded to the nearest integer (ties to even, as
    np.rint) as int8: the first 16 stored at xq[first], the last 16 at xq[second]; returns the
    sums of those 16 codes and of these. In vectors: Numba's loops over a group's values ran a
    value at a time (2.4 ns a value, 5 us for a 2048-wide vector, several times a layer)."""
    from llvmlite import ir

    i8, i32, f32 = ir.IntType(8), ir.IntType(32), ir.FloatType()
    floats, ints = ir.VectorType(f32, 16), ir.VectorType(i32, 16)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        halves, call = _vector_codegen(builder, context, signature, args)
        xq_a = context.make_array(signature.args[3])(context, builder, args[3])
        first_v, second_v = (context.cast(builder, args[k], signature.args[k], types.intp) for k in (4, 5))
        one = builder.insert_element(ir.Constant(floats, ir.Undefined), args[2], ir.Constant(i32, 0))
        spread = builder.shuffle_vector(one, ir.Constant(floats, ir.Undefined), ir.Constant(ints, [0] * 16))
        totals = []
        for half, where in zip(halves, (first_v, second_v)):
            codes = builder.fptosi(call("llvm.rint.v16f32", floats, builder.fmul(half, spread)), ints)
            totals.append(_reduce_lanes(builder, codes, builder.add))
            target = builder.bitcast(builder.gep(xq_a.data, [where]), ir.VectorType(i8, 16).as_pointer())
            builder.store(builder.trunc(codes, ir.VectorType(i8, 16)), target, align=1)
        return context.make_tuple(builder, signature.return_type, totals)

    return types.UniTuple(types.int32, 2)(x, at, types.float32, xq, first, second), codegen


@njit(cache=True, nogil=True, error_model="numpy")
def _quantize_groups(x, group, row, xq, dx, sums):  # pragma: no cover - compiled
    # Multiplied by the inverse scale, as llama.cpp's q8 activations are, and each group's two
    # halves written where quad_layout puts them (found once a group): a value at a time, with a
    # division and quad_layout's, 53 thousand values a Mixtral decode step took 0.3 ms.
    scale_of_max = np.float32(127)
    # groups of several 32 values (in order: no ``row``) in vectors 32 at a time too
    vectors = _COMPILED and (group == 32 or (group % 32 == 0 and row == 0))
    per = group // 32
    if vectors:
        # Every group's largest magnitude, then every scale and its inverse (divisions in
        # vectors: numpy's error model, no zero-divisor checks), then the codes: a group at a
        # time, a chain of a reduction, two divisions and the codes, 8 x 768 values took 6.8 us
        # from the caches, and 4.8 this way (calls from Python). The inverses wait in ``sums``.
        for g in range(dx.shape[0]):
            amax = _amax32(x, g * group)
            for c in range(1, per):
                amax = max(amax, _amax32(x, g * group + 32 * c))
            dx[g] = amax
        for g in range(dx.shape[0]):
            amax = dx[g]
            d = amax / scale_of_max if amax > 0 else np.float32(1.0)
            dx[g] = d
            sums[g] = np.float32(1.0) / d
    # quad_layout's places of the groups' halves, followed group by group: its integer divisions
    # by the row's length (tens of cycles each on some CPUs), two calls a group, were a sixth of
    # the time (8 x 768 values: 13.9 against 11.5 us on the Intel machine).
    stepped = row > 0 and group == 32 and row % 32 == 0
    whole = (row // 128) * 128
    row_start, k = 0, 0  # the first value of the group's row, and the group's place in it
    for g in range(dx.shape[0]):
        start = g * group
        first, second = start, start + 16  # where the group's first 16 values go, and the rest
        if stepped:
            if k < whole:
                first = row_start + (k & ~127) + ((k & 127) >> 5) * 16
                second = first + 64
            k += 32
            if k == row:
                row_start, k = row_start + row, 0
        elif row:
            first = quad_layout(start, row)
            second = quad_layout(start + 16, row)
        if vectors:
            total = 0
            for c in range(per):  # one 32 at first and second, the others in order after them
                low, high = _codes32(x, start + 32 * c, sums[g], xq, first + 32 * c, second + 32 * c)
                total += low + high
            sums[g] = np.float32(total) * dx[g]
            continue
        amax = np.float32(0.0)
        for j in range(start, start + group):
            amax = max(amax, abs(x[j]))
        d = amax / scale_of_max if amax > 0 else np.float32(1.0)
        inverse = np.float32(1.0) / d
        total = 0
        for t in range(16):
            q = np.int8(np.rint(x[start + t] * inverse))
            xq[first + t] = q
            total += np.int32(q)
        for t in range(16, group):
            q = np.int8(np.rint(x[start + t] * inverse))
            xq[second + t - 16] = q
            total += np.int32(q)
        dx[g] = d
        sums[g] = np.float32(total) * d


@njit(cache=True, nogil=True)
def without_denormals(x):  # pragma: no cover - compiled
    """x (float32, flat) with its denormal values made zeros, for the kernels that multiply the
    activations as floats (fp8_e4m3's and bf16's rows): a denormal operand costs the CPU a
    microcode assist, and the SiLU of a gate below about -87 is one (fp8 down rows of a
    Mixtral-8x7B-shaped expert took 16.7 ms a token with many of them, 2 without). Such a value
    times any weight is below float32's normal range: the sums do not move. x itself where it has
    none (no copy on a decode step's path, where there are none as a rule)."""
    tiny = np.float32(1.1754944e-38)  # float32's smallest normal value
    found = False
    for i in range(x.shape[0]):
        found |= np.float32(0.0) < abs(x[i]) < tiny
    if not found:
        return x
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        v = x[i]
        out[i] = v if abs(v) >= tiny else np.float32(0.0)
    return out


def matvec_int4(raw: np.ndarray, x: np.ndarray, group: int, out: np.ndarray) -> np.ndarray:
    """``W @ x`` for int4 rows ``raw`` [rows, row_bytes] (C-contiguous) with VNNI."""
    rows, row_bytes = raw.shape
    xq, dx, xsum = quantize_activations(x, group, x.shape[0] if group == 32 else 0)  # g32: in quad_layout
    flat = read_only(raw).reshape(-1)  # rows are whole groups of 4-byte scale pairs: the length is even
    _matvec_int4_vnni(flat, flat.view(np.uint16), row_bytes, rows, x.shape[0], group, xq, dx, xsum, out)
    return out


@njit(cache=True, nogil=True)
def quantize_superblocks(x, cols, yk, dk, bsum, layout, natural):  # pragma: no cover - compiled
    """Vectors of cols values (x flat) per 256 values: d = largest magnitude / 127 (1 for zeros),
    codes rint(x / d) into yk [vectors, 2 * cols]: with ``layout`` the first cols laid out for
    kquants' q4_k and q5_k rows (each 128 values' 32-value sub-blocks in the order 0, 2, 1, 3),
    with ``natural`` the next cols in order (q6_k's rows, interleaved q4_k's); the codes' sums
    per 16 in order into bsum. In vectors (the VNNI kernels that read these run only where they
    compile)."""
    per = cols // 256
    for b in range(dk.shape[0]):
        v, within = b // per, (b % per) * 256
        start = 256 * b
        amax = np.float32(0.0)
        for sub in range(8):
            amax = max(amax, _amax32(x, start + 32 * sub))
        d = amax / np.float32(127) if amax > 0 else np.float32(1.0)
        inverse = np.float32(1.0) / d
        dk[b] = d
        row = yk[v]
        for sub in range(8):
            if natural:
                at = cols + within + 32 * sub
                bsum[16 * b + 2 * sub], bsum[16 * b + 2 * sub + 1] = _codes32(x, start + 32 * sub, inverse, row, at,
                                                                              at + 16)
            if layout:
                at = within + 32 * (sub + (1 if sub % 4 == 1 else -1 if sub % 4 == 2 else 0))
                bsum[16 * b + 2 * sub], bsum[16 * b + 2 * sub + 1] = _codes32(x, start + 32 * sub, inverse, row, at,
                                                                              at + 16)


@njit(cache=True, nogil=True)
def superblock_activations(x, n, cols, layout, natural):  # pragma: no cover - compiled
    """n vectors of cols values (x flat) quantized per 256 for q4_k and q5_k (``layout``) and for
    q6_k and the interleaved q4_k (``natural``): yk [n, 2 * cols], dk [n, cols / 256], bsum [n,
    cols / 16] (``quantize_superblocks``); [n, 0] arrays where neither reads them."""
    per = cols if layout or natural else 0
    yk = np.empty((n, 2 * per), np.int8)
    dk = np.empty(n * per // 256, np.float32)
    bsum = np.empty(n * per // 16, np.int16)  # at most 16 * 127: vpmaddwd reads them
    if per:
        quantize_superblocks(x, cols, yk, dk, bsum, layout, natural)
    return yk, dk.reshape(n, per // 256), bsum.reshape(n, per // 16)
