"""Many tokens times one matrix through AMX (Intel's Advanced Matrix Extensions) for prefill:
``tdpbf16ps`` multiplies a tile of 16 rows of 32 bf16 values by one of 32 values of 16 tokens
and adds the products to a 16 x 16 tile of float32 sums, 8,192 multiply-adds an instruction.

``lanes`` multiplies int8 codes by int8 activations (``vpdpbusd``); every block of 32 values has
its own scale, so its sums are converted and scaled block by block, and that float work bounds
it. AMX's int8 product (``tdpbusd``) has the same limit: a block's sums must leave the tiles
(stored, reloaded, scaled) before the next block's, and such a kernel measured 1.1x ``lanes``.
Here the weights are decoded instead, a chunk of rows at a time, to bf16 (values times their
block's scale, then AVX-512 BF16's conversion: the block kinds straight from their blocks, the
K-quants, iq4_xs and int4 from ``lanes``' unpacked codes), and the tokens
rounded to bf16 once a call; the sums then stay in the tiles over a whole row, 2 x 2 tiles of
16 rows by 16 tokens at a time (2 x 1 for a last group of 16 tokens or fewer). The decoding costs the same whatever the tokens: below
``kernels.AMX_MIN_TOKENS`` tokens (16 to 32) ``lanes`` is faster (figures in ``docs/runtime.md``).
Products differ from ``lanes``' by the rounding of weights and tokens to bf16 (about 0.2%
relative) instead of the tokens' to int8 per 256 (or 32) values.

Numba reaches the instructions through LLVM's AMX intrinsics with fixed tile registers (the
configuration loaded at the start of each call, the tiles released at its end). Linux gives a
process AMX's tile state only when asked (``arch_prctl``, ARCH_REQ_XCOMP_PERM, 5.16 and later):
asked once on import; where that fails, or the CPU lacks AMX-BF16, or ``KTC_NO_AMX=1``,
``HAVE_AMX`` is False, the intrinsics compile to nothing (LLVM cannot emit AMX for a CPU
without it) and nothing calls them.
"""
from __future__ import annotations

import os
import platform

import numpy as np
from numba import config, get_num_threads, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ktc.formats.float_bits import bf16_bits
from ktc.formats.kernel_args import read_only, writable

from . import lanes, vnni

ROWS = 32  # rows of a tile pair: two tiles of 16
# Chunks of up to this many tile pairs a worker decodes and multiplies at once: one pass over the
# tokens a chunk. At Mixtral-8x7B's 14336 x 4096, 256 tokens (q4_0, the tiles alone, medians of
# 7): 1 pair 22-24 ms, 4 pairs 18.6-21, 8 pairs slower (the chunk no longer in L2 with the tokens).
MAX_PAIRS = 4
# ... and of at most this many bytes of bf16 rows: Mixtral's down (14336 values a row) one pair a
# chunk, lanes/amx at 24 tokens (q4_0) 0.91 with four, 1.14-1.18 with one (256 KiB and 1 MiB alike).
CHUNK_BYTES = 1 << 20
# Decoded rows are this many values longer than a row: rows a multiple of 4 KB apart share L1's
# sets, and the tiles' 32 rows evicted each other (the tiles alone: 23.2 against 18.6 ms, as above).
PAD = 32


def _request_permission() -> bool:
    """Whether Linux lets this process use AMX's tile data (asked for here; asking again is harmless)."""
    import ctypes

    arch_prctl, req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18  # x86-64's syscall number, its request
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(arch_prctl, req_xcomp_perm, xfeature_xtiledata) == 0
    except (OSError, AttributeError):  # pragma: no cover - no libc syscall here
        return False


def _host_has_amx() -> bool:
    if not vnni.HAVE_VNNI or os.environ.get("KTC_NO_AMX") == "1":
        return False
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    import llvmlite.binding as llvm

    wanted = ("amx-tile", "amx-bf16", "avx512bf16")
    if (config.CPU_NAME or "host") != "host" or config.CPU_FEATURES:  # another target named: it must say so
        if not all(f"+{f}" in (config.CPU_FEATURES or "") for f in wanted):
            return False
    elif not all(llvm.get_host_cpu_features().get(f, False) for f in wanted):
        return False
    return _request_permission()


HAVE_AMX = _host_has_amx()


def tile_config() -> np.ndarray:
    """The 64-byte tile configuration (palette 1) of ``tiles_intrinsic``: every tile 16 rows of 64 bytes
    (0-3 float32 sums of 16 rows x 16 tokens, 4-5 16 rows of 32 bf16 weights, 6-7 32 values of 16
    tokens in pairs: a row a pair of values of each token)."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    colsb, rows = cfg[16:32].view(np.uint16), cfg[48:56]
    colsb[:8], rows[:8] = 64, 16
    return cfg


def _bfloat_type():  # type: ignore[no-untyped-def]
    from llvmlite import ir

    class BFloat(ir.types.Type):  # LLVM's bfloat, written out by name in the module's text
        def _to_string(self) -> str:
            return "bfloat"

    return BFloat


def bf16_row_intrinsic(halves: int, minimums: bool):  # type: ignore[no-untyped-def]
    """``row(w, wat, sc, mn, p, blocks, offset, out, oat)``: ``blocks`` blocks of 32 unsigned codes
    at w[wat:] (``lanes``' unpacked rows) as bf16 bits at out[oat:] (uint16): (code - offset)
    times the scale of its 32 / ``halves`` values at sc[p + ...], plus their minimum at mn[...]
    with ``minimums``; rounded to nearest even."""
    from llvmlite import ir

    _BFloat = _bfloat_type()
    i8, i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
    bytes16, words, floats, pairs = (ir.VectorType(i8, 16), ir.VectorType(i32, 16), ir.VectorType(f32, 16),
                                     ir.VectorType(i16, 32))

    @intrinsic
    def row(typingctx, w, wat, sc, mn, p, blocks, offset, out, oat):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            if not HAVE_AMX:  # never called then (AMX's CPUs have AVX-512 BF16; others may not)
                return context.get_dummy_value()
            w_a, sc_a, mn_a, out_a = vnni._arrays(context, builder, signature, args, (0, 2, 3, 7))
            wat_v, p_v, blocks_v, oat_v = vnni._indices(context, builder, signature, args, (1, 4, 5, 8))
            offset_v = context.cast(builder, args[6], signature.args[6], types.float32)
            index_t = wat_v.type

            def const(k):  # type: ignore[no-untyped-def]
                return ir.Constant(index_t, k)

            def at(array, index, t):  # type: ignore[no-untyped-def]
                return builder.bitcast(builder.gep(array.data, [index]), t.as_pointer())

            def splat(value):  # type: ignore[no-untyped-def]
                one = builder.insert_element(ir.Constant(floats, ir.Undefined), value, ir.Constant(i32, 0))
                return builder.shuffle_vector(one, ir.Constant(floats, ir.Undefined), ir.Constant(words, [0] * 16))

            # AVX-512 BF16's two-vector conversion (round to nearest even; the low half from the
            # second); its result is a vector of LLVM's bfloat, a type llvmlite does not name
            both = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VectorType(_BFloat(), 32),
                                                                                  [floats, floats]),
                                                  "llvm.x86.avx512bf16.cvtne2ps2bf16.512")
            with cgutils.for_range(builder, blocks_v) as loop:
                b = loop.index
                converted = []
                for part in range(2):
                    q = builder.add(builder.mul(b, const(halves)), const(part * halves // 2))
                    scale = splat(builder.load(at(sc_a, builder.add(p_v, q), f32), align=4))
                    codes = builder.load(at(w_a, builder.add(builder.add(wat_v, builder.mul(b, const(32))),
                                                             const(16 * part)), bytes16), align=1)
                    values = builder.fsub(builder.uitofp(codes, floats), splat(offset_v))
                    values = builder.fmul(values, scale)
                    if minimums:
                        values = builder.fadd(values, splat(builder.load(at(mn_a, builder.add(p_v, q), f32), align=4)))
                    converted.append(values)
                o = builder.add(oat_v, builder.mul(b, const(32)))
                builder.store(builder.bitcast(builder.call(both, [converted[1], converted[0]]), pairs),
                              at(out_a, o, pairs), align=2)
            return context.get_dummy_value()

        return types.void(w, wat, sc, mn, p, blocks, offset, out, oat), codegen

    return row


def blocks_intrinsic(kind: int):  # type: ignore[no-untyped-def]
    """``decode(flat, at, blocks, e8m0, out, oat)``: ``blocks`` blocks of ``kind`` (q8_0, q4_0,
    mxfp4, iq4_nl: ``lanes.KINDS``' 1-4) from byte ``at`` of ``flat`` as bf16 bits at out[oat:]:
    their values (signed integers: codes, nibbles minus 8, mxfp4's doubled e2m1 values, iq4's
    levels) times their scale, the values ``bf16_row_intrinsic`` makes of ``lanes``' unpacked
    codes, in one pass over the block instead of two."""
    from llvmlite import ir

    _BFloat = _bfloat_type()
    i8, i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
    bytes16, words, floats, pairs = (ir.VectorType(i8, 16), ir.VectorType(i32, 16), ir.VectorType(f32, 16),
                                     ir.VectorType(i16, 32))
    size, codes_at = lanes._SIZE[kind], lanes._CODES_AT[kind]
    table = {3: tuple(v - 12 for v in vnni.E2M1_TWICE_PLUS_12), 4: vnni.IQ4_LEVELS_INT}.get(kind)

    @intrinsic
    def decode(typingctx, flat, at, blocks, e8m0, out, oat):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            if not HAVE_AMX:
                return context.get_dummy_value()
            flat_a, e8m0_a, out_a = vnni._arrays(context, builder, signature, args, (0, 3, 4))
            at_v, blocks_v, oat_v = vnni._indices(context, builder, signature, args, (1, 2, 5))
            index_t = at_v.type

            def const(k):  # type: ignore[no-untyped-def]
                return ir.Constant(index_t, k)

            def load(array, index, t, align=1):  # type: ignore[no-untyped-def]
                return builder.load(builder.bitcast(builder.gep(array.data, [index]), t.as_pointer()), align=align)

            both = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VectorType(_BFloat(), 32),
                                                                                  [floats, floats]),
                                                  "llvm.x86.avx512bf16.cvtne2ps2bf16.512")
            with cgutils.for_range(builder, blocks_v) as loop:
                base = builder.add(at_v, builder.mul(loop.index, const(size)))
                codes = builder.add(base, const(codes_at))
                if kind == 1:
                    halves = (load(flat_a, codes, bytes16), load(flat_a, builder.add(codes, const(16)), bytes16))
                else:
                    halves = lanes._nibbles(builder, load(flat_a, codes, bytes16))
                    if kind == 2:
                        halves = tuple(builder.sub(h, ir.Constant(bytes16, [8] * 16)) for h in halves)
                    else:
                        halves = lanes._looked_up(builder, table, halves)
                if kind == 3:  # e8m0: a power of two from the table, halved for the doubled values
                    scale = builder.fmul(load(e8m0_a, builder.zext(load(flat_a, base, i8), index_t), f32, 4),
                                         ir.Constant(f32, 0.5))
                else:  # fp16, converted by the CPU (F16C)
                    scale = builder.fpext(builder.bitcast(load(flat_a, base, i16), ir.HalfType()), f32)
                one = builder.insert_element(ir.Constant(floats, ir.Undefined), scale, ir.Constant(i32, 0))
                scale = builder.shuffle_vector(one, ir.Constant(floats, ir.Undefined), ir.Constant(words, [0] * 16))
                low, high = (builder.fmul(builder.sitofp(h, floats), scale) for h in halves)
                o = builder.add(oat_v, builder.mul(loop.index, const(32)))
                builder.store(builder.bitcast(builder.call(both, [high, low]), pairs),
                              builder.bitcast(builder.gep(out_a.data, [o]), pairs.as_pointer()), align=2)
            return context.get_dummy_value()

        return types.void(flat, at, blocks, e8m0, out, oat), codegen

    return decode


def fp8_intrinsic():  # type: ignore[no-untyped-def]
    """``decode(flat, at, blocks, out, oat)``: ``blocks`` blocks of fp8_e4m3 (a float32 scale, then
    128 e4m3 codes) from byte ``at`` of ``flat`` as bf16 bits at out[oat:]: each code made the
    float32 of its value times 2^-120 from its bits (``vnni.e4m3_scaled_floats``, as the one-token
    kernel reads them), times
    2^60 and by the scale times 2^60 (the same single rounding as the value times the scale), then
    AVX-512 BF16's conversion."""
    from llvmlite import ir

    _BFloat = _bfloat_type()
    i8, i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
    bytes16, words, floats, pairs = (ir.VectorType(i8, 16), ir.VectorType(i32, 16), ir.VectorType(f32, 16),
                                     ir.VectorType(i16, 32))

    @intrinsic
    def decode(typingctx, flat, at, blocks, out, oat):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            if not HAVE_AMX:
                return context.get_dummy_value()
            flat_a, out_a = vnni._arrays(context, builder, signature, args, (0, 3))
            at_v, blocks_v, oat_v = vnni._indices(context, builder, signature, args, (1, 2, 4))
            index_t = at_v.type

            def const(k):  # type: ignore[no-untyped-def]
                return ir.Constant(index_t, k)

            def load(index, t):  # type: ignore[no-untyped-def]
                return builder.load(builder.bitcast(builder.gep(flat_a.data, [index]), t.as_pointer()), align=1)

            both = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VectorType(_BFloat(), 32),
                                                                                  [floats, floats]),
                                                  "llvm.x86.avx512bf16.cvtne2ps2bf16.512")
            up = ir.Constant(floats, [2.0 ** 60] * 16)
            with cgutils.for_range(builder, blocks_v) as loop:
                base = builder.add(at_v, builder.mul(loop.index, const(132)))
                scale = builder.fmul(load(base, f32), ir.Constant(f32, 2.0 ** 60))
                one = builder.insert_element(ir.Constant(floats, ir.Undefined), scale, ir.Constant(i32, 0))
                scale = builder.shuffle_vector(one, ir.Constant(floats, ir.Undefined), ir.Constant(words, [0] * 16))
                for step in range(4):
                    values = []
                    for half in range(2):
                        codes = load(builder.add(base, const(4 + 32 * step + 16 * half)), bytes16)
                        values.append(builder.fmul(builder.fmul(vnni.e4m3_scaled_floats(builder, codes), up), scale))
                    o = builder.add(oat_v, builder.add(builder.mul(loop.index, const(128)), const(32 * step)))
                    builder.store(builder.bitcast(builder.call(both, [values[1], values[0]]), pairs),
                                  builder.bitcast(builder.gep(out_a.data, [o]), pairs.as_pointer()), align=2)
            return context.get_dummy_value()

        return types.void(flat, at, blocks, out, oat), codegen

    return decode


def tiles_intrinsic(groups: int, product: str = "tdpbf16ps"):  # type: ignore[no-untyped-def]
    """``tiles(cfg, wb, wstride, xb, xat, steps, sums, sat)``: 32 rows of bf16 weights (row r at
    byte r * wstride of wb, ``steps`` x 32 values) times ``groups`` (2, or 1 for a last group of
    16 tokens or fewer) groups of 16 tokens (from byte xat of xb: a group's ``steps`` steps of
    1024 bytes, then the next group's) into 16 x 16 float32 tiles at sums[sat:] (rows 0-15 by
    group 0, by group 1, rows 16-31 by group 0, by group 1; 256 values each). ``product``
    ``tdpbssd``: 64 int8 values a step instead (the rows' codes, the tokens four a lane), int32
    sums."""
    from llvmlite import ir

    i8, i64 = ir.IntType(8), ir.IntType(64)
    p8 = i8.as_pointer()
    # (sums, rows, tokens) tile registers: 0-3 the sums, 4-5 the two 16-row tiles, 6-7 the groups
    products = ((0, 4, 6), (1, 4, 7), (2, 5, 6), (3, 5, 7)) if groups == 2 else ((0, 4, 6), (2, 5, 6))
    used = sorted({c for c, _, _ in products})

    @intrinsic
    def tiles(typingctx, cfg, wb, wstride, xb, xat, steps, sums, sat):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            if not HAVE_AMX:
                return context.get_dummy_value()
            cfg_a, wb_a, xb_a, sums_a = vnni._arrays(context, builder, signature, args, (0, 1, 3, 6))
            wstride_v, xat_v, steps_v, sat_v = vnni._indices(context, builder, signature, args, (2, 4, 5, 7))
            index_t = wstride_v.type

            def const(k):  # type: ignore[no-untyped-def]
                return ir.Constant(index_t, k)

            def byte(array, index, scale=1):  # type: ignore[no-untyped-def]
                return builder.gep(builder.bitcast(array.data, p8), [builder.mul(index, const(scale))])

            def call(name, argtypes, values):  # type: ignore[no-untyped-def]
                fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), argtypes), name)
                return builder.call(fn, values)

            def reg(t):  # type: ignore[no-untyped-def]
                return ir.Constant(i8, t)

            stride = builder.sext(wstride_v, i64) if wstride_v.type != i64 else wstride_v
            sixty_four = ir.Constant(i64, 64)
            call("llvm.x86.ldtilecfg", [p8], [byte(cfg_a, const(0))])
            for t in used:
                call("llvm.x86.tilezero", [i8], [reg(t)])
            second = builder.mul(steps_v, const(1024))
            with cgutils.for_range(builder, steps_v) as loop:
                s = loop.index
                at = builder.mul(s, const(64))
                call("llvm.x86.tileloadd64", [i8, p8, i64], [reg(4), byte(wb_a, at), stride])
                call("llvm.x86.tileloadd64", [i8, p8, i64],
                     [reg(5), byte(wb_a, builder.add(builder.mul(wstride_v, const(16)), at)), stride])
                x0 = builder.add(xat_v, builder.mul(s, const(1024)))
                call("llvm.x86.tileloadd64", [i8, p8, i64], [reg(6), byte(xb_a, x0), sixty_four])
                if groups == 2:
                    call("llvm.x86.tileloadd64", [i8, p8, i64],
                         [reg(7), byte(xb_a, builder.add(x0, second)), sixty_four])
                for c, a, b in products:
                    call(f"llvm.x86.{product}", [i8, i8, i8], [reg(c), reg(a), reg(b)])
            for t in used:
                call("llvm.x86.tilestored64", [i8, p8, i64],
                     [reg(t), byte(sums_a, builder.add(sat_v, const(256 * t)), 4), sixty_four])
            call("llvm.x86.tilerelease", [], [])
            return context.get_dummy_value()

        return types.void(cfg, wb, wstride, xb, xat, steps, sums, sat), codegen

    return tiles


@intrinsic
def _store_transposed(typingctx, sums, base, out, obase, ostride):  # type: ignore[no-untyped-def]
    """The 16 x 16 float32 tile at sums[base:] (rows of 16 values) transposed into out: its
    column t at out[obase + t * ostride:][:16]. Four rounds of two-vector shuffles, each
    swapping a bit of the row with that bit of the column, instead of 256 single moves."""
    from llvmlite import ir

    f32, i32 = ir.FloatType(), ir.IntType(32)
    floats = ir.VectorType(f32, 16)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        sums_a, out_a = vnni._arrays(context, builder, signature, args, (0, 2))
        base_v, obase_v, ostride_v = vnni._indices(context, builder, signature, args, (1, 3, 4))

        def at(array, index):  # type: ignore[no-untyped-def]
            return builder.bitcast(builder.gep(array.data, [index]), floats.as_pointer())

        rows = [builder.load(at(sums_a, builder.add(base_v, ir.Constant(base_v.type, 16 * i))), align=4)
                for i in range(16)]
        for k in range(4):
            bit = 1 << k
            low = ir.Constant(ir.VectorType(i32, 16), [(p & ~bit) + 16 * ((p >> k) & 1) for p in range(16)])
            high = ir.Constant(ir.VectorType(i32, 16), [(p | bit) + 16 * ((p >> k) & 1) for p in range(16)])
            for r in range(16):
                if not r & bit:
                    a, b = rows[r], rows[r | bit]
                    rows[r], rows[r | bit] = builder.shuffle_vector(a, b, low), builder.shuffle_vector(a, b, high)
        for t in range(16):
            builder.store(rows[t], at(out_a, vnni._nth(builder, obase_v, ostride_v, t)), align=4)
        return context.get_dummy_value()

    return types.void(sums, base, out, obase, ostride), codegen


@njit(cache=True, nogil=True, parallel=True)
def activations(x, n, cols, groups):  # pragma: no cover - compiled
    """Tokens x (float32 [n, cols]) as bf16 bits laid out for ``tiles_intrinsic``: per group of 16 tokens
    (``groups`` of them, the tokens past n zeros) and step of 32 values, 16 rows of the 16
    tokens' pairs of values."""
    steps = cols // 32
    xb = np.zeros(groups * steps * 512, np.uint16)
    for gs in prange(groups * steps):
        g, s = gs // steps, gs % steps
        for lane in range(min(16, n - 16 * g)):
            t = 16 * g + lane
            for k in range(32):
                xb[(gs * 16 + k // 2) * 32 + 2 * lane + k % 2] = bf16_bits(x[t, 32 * s + k])
    return xb


_row_plain, _row_minimums, _row_halves = bf16_row_intrinsic(1, False), bf16_row_intrinsic(1, True), \
    bf16_row_intrinsic(2, False)
_blocks_q8_0, _blocks_q4_0, _blocks_mxfp4, _blocks_iq4_nl = (blocks_intrinsic(kind) for kind in range(1, 5))
_blocks_fp8 = fp8_intrinsic()
_tiles_pair, _tiles_one = tiles_intrinsic(2), tiles_intrinsic(1)
_int8_pair, _int8_one = tiles_intrinsic(2, "tdpbssd"), tiles_intrinsic(1, "tdpbssd")


@njit(cache=True, nogil=True, inline="always")
def _decode_row(kind, raw, row, flat, w, sc, mn, e8m0, blocks, offset, wb, oat):  # pragma: no cover - compiled
    # Row ``row`` of raw as bf16 at wb[oat:]: the block kinds in one pass, the others through
    # lanes' unpacking (codes plus the kind's offset, scales, minimums into w, sc, mn) and a second.
    at = row * raw.shape[1]
    if kind == 1:
        _blocks_q8_0(flat, at, blocks, e8m0, wb, oat)
    elif kind == 2:
        _blocks_q4_0(flat, at, blocks, e8m0, wb, oat)
    elif kind == 3:
        _blocks_mxfp4(flat, at, blocks, e8m0, wb, oat)
    elif kind == 4:
        _blocks_iq4_nl(flat, at, blocks, e8m0, wb, oat)
    elif kind == lanes._FP8:
        _blocks_fp8(flat, at, blocks // 4, wb, oat)
    else:
        lanes._unpack_row(kind, raw, row, flat, w, 0, sc, mn, 0, e8m0, False)  # minimums as floats
        per = lanes.span(kind, blocks)  # int4's groups of 64 and 128: a scale a span, here a block
        if per > 1:
            for b in range(blocks - 1, -1, -1):  # backwards: each reads a span at or before it
                sc[b] = sc[b // per]
                mn[b] = mn[b // per]
        if kind == lanes._HALVES:
            _row_halves(w, 0, sc, mn, 0, blocks, offset, wb, oat)
        elif lanes.has_minimums(kind):
            _row_minimums(w, 0, sc, mn, 0, blocks, offset, wb, oat)
        else:
            _row_plain(w, 0, sc, mn, 0, blocks, offset, wb, oat)


@njit(cache=True, nogil=True, inline="always")
def _put_tiles(sums, used, first, count, g, n, out, flat_out):  # pragma: no cover - compiled
    # A chunk's float32 tiles for pair g of token groups (those of its p-th 32 rows at
    # sums[p * 1024:], as ``tiles_intrinsic`` stores them) into out: whole tiles transposed by
    # shuffles, the others (the chunk's last rows, the last tokens) value by value.
    rows = out.shape[1]
    for p in range(used):
        for half in range(2):
            row = first + p * ROWS + 16 * half
            for m in range(2):
                base = p * 1024 + (2 * half + m) * 256
                token = 16 * (2 * g + m)
                if row + 16 <= rows and token + 16 <= n:
                    _store_transposed(sums, base, flat_out, token * rows + row, rows)
                    continue
                for i in range(min(16, first + count - row)):
                    for lane in range(min(16, n - token)):
                        out[token + lane, row + i] = sums[base + 16 * i + lane]


@njit(cache=True, nogil=True, parallel=True)
def _matmul(raw, kind, e8m0, xb, n, cols, workers, pairs_a_chunk, cfg, out):  # pragma: no cover - compiled
    # out [n, rows] = the tokens (``activations``) times raw's rows of ``lanes.KINDS``' kind: each
    # worker a chunk of ``pairs_a_chunk`` x 32 rows at a time (taken from a counter, as ``lanes``
    # does), decoded to bf16, then every pair of token groups over every 32 of its rows.
    rows = raw.shape[0]
    flat = raw.reshape(-1)
    blocks = cols // 32
    params = blocks * (2 if kind == lanes._HALVES else 1)
    offset = np.float32(lanes._OFFSET[kind])
    pairs = (n + 31) // 32  # of groups of 16 tokens
    size = pairs_a_chunk * ROWS
    pitch = cols + PAD
    taken = np.zeros(8, np.int64)
    flat_out = out.reshape(-1)
    for worker in prange(workers):
        w = np.zeros(cols, np.uint8)
        sc = np.zeros(params, np.float32)
        mn = np.zeros(params, np.float32)
        wb = np.zeros(size * pitch, np.uint16)
        sums = np.empty(pairs_a_chunk * 1024, np.float32)
        while True:
            first, count = vnni.next_chunk(taken, size, rows)
            if count <= 0:
                break
            for r in range(count):
                _decode_row(kind, raw, first + r, flat, w, sc, mn, e8m0, blocks, offset, wb, r * pitch)
            wb[count * pitch:] = 0
            used = (count + ROWS - 1) // ROWS
            for g in range(pairs):
                one = 32 * g + 16 >= n  # the pair's second group holds no token
                for p in range(used):
                    if one:
                        _tiles_one(cfg, wb[p * ROWS * pitch:], 2 * pitch, xb, 2 * g * blocks * 1024, blocks, sums,
                                   p * 1024)
                    else:
                        _tiles_pair(cfg, wb[p * ROWS * pitch:], 2 * pitch, xb, 2 * g * blocks * 1024, blocks, sums,
                                    p * 1024)
                _put_tiles(sums, used, first, count, g, n, out, flat_out)


# The schemes ``matmul`` takes: ``lanes``' kinds but int8 (multiplied as int8: ``int8_matmul``),
# and fp8_e4m3, decoded from its blocks too.
KINDS = {**{name: kind for name, kind in lanes.KINDS.items() if name != "int8"}, "fp8_e4m3": lanes._FP8}


def fits(scheme: str, cols: int) -> bool:
    """Whether ``matmul`` takes matrices of ``scheme`` with rows of ``cols`` values here."""
    kind = KINDS.get(scheme)
    return HAVE_AMX and vnni._COMPILED and kind is not None and cols % lanes._VALUES[kind] == 0


def matmul(x: np.ndarray, raw: np.ndarray, scheme: str) -> np.ndarray:
    """``x @ W.T`` (float32 [n, rows]) for tokens x [n, cols] and one matrix of ``KINDS``
    stored as C-contiguous uint8 rows ``raw`` (``fits``): the weights decoded to bf16 32 rows at
    a time, the tokens rounded to bf16, the products summed in float32 by AMX."""
    x, raw = writable(np.ascontiguousarray(x, dtype=np.float32)), read_only(raw)
    n, cols = x.shape
    xb = activations(x, n, cols, 2 * ((n + 31) // 32))
    out = np.empty((n, raw.shape[0]), dtype=np.float32)
    workers, per_chunk = _chunking(raw.shape[0], 2 * (cols + PAD))
    _matmul(raw, KINDS[scheme], vnni._tables()[1], xb, n, cols, workers, per_chunk, tile_config(), out)
    return out


def _chunking(rows: int, row_bytes: int) -> tuple[int, int]:
    """(workers, pairs of 32 rows a chunk) for a matrix of ``rows`` rows of ``row_bytes`` bytes as
    the tiles read them: 4 chunks a thread at least, to share them out, and a chunk's rows within
    ``CHUNK_BYTES``."""
    workers = get_num_threads()
    pair_count = -(-rows // ROWS)
    per_chunk = max(1, min(MAX_PAIRS, pair_count // (4 * workers), CHUNK_BYTES // (ROWS * row_bytes)))
    return max(1, min(workers, -(-pair_count // per_chunk))), per_chunk


# --- int8 rows (ktc's int8 scheme: codes, then a float32 scale a row): multiplied as stored


@njit(cache=True, nogil=True, parallel=True)
def int8_activations(xq, n, cols, groups):  # pragma: no cover - compiled
    """Tokens' int8 codes xq [n, cols] laid out for ``tdpbssd``: per group of 16 tokens and step
    of 64 values, 16 rows of the 16 tokens' values four a 32-bit lane (tokens past n zeros)."""
    steps = cols // 64
    words = xq.view(np.int32)  # [n, cols / 4]
    xb = np.zeros(groups * steps * 256, np.int32)
    for gs in prange(groups * steps):
        g, s = gs // steps, gs % steps
        for lane in range(min(16, n - 16 * g)):
            for k in range(16):
                xb[(gs * 16 + k) * 16 + lane] = words[16 * g + lane, 16 * s + k]
    return xb


# Stored int8 rows are ``cols + 4`` bytes apart (each row's scale follows its codes), so a row's
# 64 bytes of a tile's step span two cache lines, read again for every pair of token groups. From
# ALIGNED_PAIRS pairs (129 tokens and more) a chunk's codes are first copied, each row 64-byte
# aligned, where the tokens' int8 rows (n x cols bytes) stay in L2 beside them
# (ALIGNED_TOKEN_BYTES): then the rows' loads bound the tiles. Copied against read where stored
# (medians of 9-15 interleaved calls), Mixtral-8x7B's gate/up (28672 x 4096): its rows in the
# caches (L3) 0.74-0.86 of the time at 192 tokens and 0.73-0.81 at 256, but 0.91-1.02 at 128
# and 1.01-1.04 at 64-96 (the copy not repaid); its rows from memory (a 1 GB read between
# calls, as a prefill reads a layer's experts) 0.97 at 192, 0.94 at 256, 1.00 at 128. Its down
# (4096 x 14336), whose tokens' rows outgrow L2 there, 1.00-1.12 at 128-256 (not copied).
ALIGNED_PAIRS = 5
ALIGNED_TOKEN_BYTES = 1 << 20


@njit(cache=True, nogil=True, parallel=True)
def _int8_matmul(raw, xb, x_scale, w_scale, n, cols, workers, pairs_a_chunk, aligned, cfg,
                 out):  # pragma: no cover - compiled
    # out [n, rows] = the tokens' int8 codes (``int8_activations``) times raw's int8 rows, read
    # where they are stored (a chunk's last rows copied beside zeros, so that no tile reads past
    # the matrix), or with ``aligned`` a chunk's codes copied first, each row on a 64-byte
    # boundary (ALIGNED_PAIRS); the int32 sums times the token's and the row's scales (in torch's
    # int8 path's order: sum x token scale x row scale).
    rows, row_bytes = raw.shape
    flat = raw.reshape(-1)
    steps = cols // 64
    pairs = (n + 31) // 32
    size = pairs_a_chunk * ROWS
    taken = np.zeros(8, np.int64)
    flat_out = out.reshape(-1)
    stride = cols if aligned else row_bytes  # between the rows the tiles read
    for worker in prange(workers):
        tail = np.zeros(size * row_bytes, np.uint8)
        sums = np.empty(pairs_a_chunk * 1024, np.int32)
        scaled = np.empty(pairs_a_chunk * 1024, np.float32)
        while True:
            first, count = vnni.next_chunk(taken, size, rows)
            if count <= 0:
                break
            used = (count + ROWS - 1) // ROWS
            if aligned or count < used * ROWS:  # each row's first ``stride`` bytes, then zeros
                for r in range(count):
                    tail[r * stride:(r + 1) * stride] = flat[(first + r) * row_bytes:(first + r) * row_bytes + stride]
                tail[count * stride:used * ROWS * stride] = 0
                rows_at, at = tail, 0
            else:
                rows_at, at = flat, first * row_bytes
            for g in range(pairs):
                one = 32 * g + 16 >= n
                for p in range(used):
                    if one:
                        _int8_one(cfg, rows_at[at + p * ROWS * stride:], stride, xb, 2 * g * steps * 1024,
                                  steps, sums, p * 1024)
                    else:
                        _int8_pair(cfg, rows_at[at + p * ROWS * stride:], stride, xb, 2 * g * steps * 1024,
                                   steps, sums, p * 1024)
                for p in range(used):  # the sums times the tokens' and the rows' scales
                    for t in range(4):
                        row, token = first + p * ROWS + 16 * (t // 2), 16 * (2 * g + t % 2)
                        for i in range(16):
                            ws = w_scale[min(row + i, rows - 1)]
                            for lane in range(16):
                                k = p * 1024 + t * 256 + 16 * i + lane
                                scaled[k] = np.float32(sums[k]) * x_scale[min(token + lane, n - 1)] * ws
                _put_tiles(scaled, used, first, count, g, n, out, flat_out)


def int8_tokens(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Tokens x [n, cols] as int8 codes [n, cols] and one float32 scale each (their largest
    magnitude over 127; 1 for a token of zeros): the int8 scheme's products' activations, here
    and in torch's path (``kernels._int8_gemm``)."""
    amax = np.abs(x).max(axis=1)
    x_scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    return np.ascontiguousarray(np.rint(x / x_scale[:, None]).astype(np.int8)), x_scale


def int8_fits(cols: int) -> bool:
    """Whether ``int8_matmul`` takes int8 rows of ``cols`` values here."""
    return HAVE_AMX and cols % 64 == 0


def int8_matmul(x: np.ndarray, raw: np.ndarray, w_scale: np.ndarray) -> np.ndarray:
    """``x @ W.T`` (float32 [n, rows]) for tokens x [n, cols] and ktc's int8 rows ``raw`` [rows,
    cols + 4] (codes, then a float32 scale; ``w_scale`` the scales gathered): each token
    quantized to int8 with one scale, as torch's int8 path (``kernels._int8_gemm``) does, the
    codes multiplied by AMX's ``tdpbssd`` where they are stored, the same products."""
    x, raw = writable(np.ascontiguousarray(x, dtype=np.float32)), read_only(raw)
    n, cols = x.shape
    xq, x_scale = int8_tokens(x)
    xb = int8_activations(xq, n, cols, 2 * ((n + 31) // 32))
    out = np.empty((n, raw.shape[0]), dtype=np.float32)
    workers, per_chunk = _chunking(*raw.shape)
    aligned = (n + 31) // 32 >= ALIGNED_PAIRS and n * cols <= ALIGNED_TOKEN_BYTES
    _int8_matmul(raw, xb, x_scale, np.ascontiguousarray(w_scale, dtype=np.float32), n, cols, workers, per_chunk,
                 aligned, tile_config(), out)
    return out
