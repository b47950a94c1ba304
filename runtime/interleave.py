"""q4_0 matrices laid out for the CPU's products: rows interleaved 16 at a time (``repack``).

In ggml's q4_0 layout each row is a run of 18-byte blocks (an fp16 scale, then 16 bytes of
4-bit codes). A one-token product of such rows (``vnni._row_intrinsic``) takes a row at a time:
each 72-byte step of four blocks costs two unaligned loads, a permute to gather the codes, the
scales picked and converted, the activations' per-lane scales and sums loaded, two products and
two multiply-adds, for 128 weights. Read from L2 on the Zen 4 machine that bounds a core at about
26 GB/s, below what two cores read from memory in its fast phases (60-70 GB/s): the kernels,
not the memory, set the decode speed there. llama.cpp's CPU backend meets the same bound the
same way: it copies q4_0 tensors into interleaved groups of rows when it loads them
(``--repack``, on by default; its Q4_0 decode of a two-layer Qwen3-30B-A3B-shaped model fell
from 132-152 to 74-83 tok/s here without it).

Here 16 rows make a group, and the group's blocks go in pairs: the pair's 32 fp16 scales (block
b's for rows 0-15, then block b+1's) in one 64-byte line, then for each block four lines, line k
holding bytes 4k..4k+3 of each row's 16 code bytes (row r at bytes 4r..4r+3). One product
(``vpdpbusd``) then multiplies 16 rows' codes by four activations broadcast to every lane, a
block's scales convert once for 16 rows, and every load is a whole aligned line of one stream:
from L2 55 GB/s a core against 26; from memory, one Qwen3-30B-A3B-shaped output matrix (151936 x
2048) on two cores 69 against 42 GB/s in a fast phase (a 1 or 2 thread sweep of prototypes with
and without software prefetch; the hardware prefetcher follows the single stream best, so there
is none). The bytes are the same ones, reordered: a group is ``16 * row_bytes`` bytes, as
before.

``repack`` makes the copy (``HostLinear`` does when it loads a q4_0 matrix on a VNNI CPU:
``runtime.linear``; ``ExpertSet`` for a layer of q4_0 experts; both release the map's pages of
what they copied, ``Bundle.release``), ``unpack`` undoes it, ``matvec`` and ``matmul`` multiply one token or
several, and ``rows`` is the one-token product of a run of groups for ``runtime.rows``' kind
``rows.Q4_0X16`` (projections that share their input in one parallel region).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ktc.formats.kernel_args import read_only, writable

from . import vnni

GROUP = 16  # rows interleaved together
BLOCK = 18  # bytes of a q4_0 block: an fp16 scale, 16 bytes of codes
PAIR_BYTES = 2 * GROUP * BLOCK  # 576: a pair of blocks of a group, nine cache lines
# Tokens a step of ``matmul``'s tile: each line of codes, unpacked once, multiplied by this many
# tokens' activations (two registers a token: its products and its sums).
TILE_TOKENS = 8
GROUPS_PER_ITEM = 4  # groups a parallel work item (64 rows, as rows.ROWS_PER_ITEM)


def fits(rows: int, cols: int) -> bool:
    """Whether a [rows, cols] q4_0 matrix can be interleaved: whole groups of rows, whole pairs
    of blocks in a row."""
    return rows > 0 and rows % GROUP == 0 and cols > 0 and cols % 64 == 0


def aligned_empty(nbytes: int) -> np.ndarray:
    """uint8 [nbytes] starting on a cache line."""
    buffer = np.empty(nbytes + 64, dtype=np.uint8)
    start = -buffer.ctypes.data % 64
    return buffer[start:start + nbytes]


def repack(raw: np.ndarray, rows_at_once: int = 4096, out: np.ndarray | None = None) -> np.ndarray:
    """The interleaved copy (uint8 [rows, row_bytes], on a cache line) of q4_0 rows ``raw``
    (uint8 [rows, row_bytes]; ``fits``), made ``rows_at_once`` rows at a time (a whole-matrix
    transpose would need another copy's memory); into ``out`` (uint8 [rows, row_bytes]) where
    given."""
    rows, row_bytes = raw.shape
    blocks = row_bytes // BLOCK
    if raw.dtype != np.uint8 or row_bytes % BLOCK or not fits(rows, blocks * 32):
        raise ValueError(f"q4_0 rows {raw.shape} cannot be interleaved by {GROUP} (rows a multiple of {GROUP}, "
                         "an even number of blocks a row)")
    if out is None:
        out = aligned_empty(rows * row_bytes).reshape(rows, row_bytes)
    elif out.shape != raw.shape or out.dtype != np.uint8:
        raise ValueError(f"an interleaved copy of {raw.shape} rows goes into uint8 {raw.shape}, not {out.dtype} {out.shape}")
    step = max(GROUP, rows_at_once // GROUP * GROUP)
    for first in range(0, rows, step):
        part = np.asarray(raw[first:first + step])
        n = part.shape[0] // GROUP
        b = part.reshape(n, GROUP, blocks // 2, 2, BLOCK)
        # [group, pair, block of the pair, row, 2 bytes] and [group, pair, block, line k, row, 4 bytes]
        scales = b[..., :2].transpose(0, 2, 3, 1, 4).reshape(n, blocks // 2, 64)
        codes = b[..., 2:].reshape(n, GROUP, blocks // 2, 2, 4, 4).transpose(0, 2, 3, 4, 1, 5).reshape(
            n, blocks // 2, 2 * GROUP * 16)
        target = out[first:first + step].reshape(n, blocks // 2, PAIR_BYTES)
        target[..., :64] = scales
        target[..., 64:] = codes
    return out


def unpack(packed: np.ndarray) -> np.ndarray:
    """q4_0 rows (uint8 [rows, row_bytes]) of an interleaved copy: ``repack`` undone."""
    rows, row_bytes = packed.shape
    blocks = row_bytes // BLOCK
    n = rows // GROUP
    p = np.asarray(packed).reshape(n, blocks // 2, PAIR_BYTES)
    scales = p[..., :64].reshape(n, blocks // 2, 2, GROUP, 2).transpose(0, 3, 1, 2, 4)
    codes = p[..., 64:].reshape(n, blocks // 2, 2, 4, GROUP, 4).transpose(0, 4, 1, 2, 3, 5).reshape(
        n, GROUP, blocks // 2, 2, 16)
    out = np.empty((n, GROUP, blocks // 2, 2, BLOCK), dtype=np.uint8)
    out[..., :2] = scales
    out[..., 2:] = codes
    return out.reshape(rows, row_bytes)


def _tile_intrinsic(tokens: int):  # type: ignore[no-untyped-def]
    """``tile(flat, at, pairs, xq, xbase, xstride, dx, sums, dbase, dstride, out, obase, ostride)``:
    the 16 rows of the group at byte ``at`` of flat (``pairs`` pairs of blocks) times ``tokens``
    tokens' activations (token t's int8 values at xq[xbase + t * xstride], in order, quantized
    per 32; its scales and dequantized sums per 32 at dx and sums [dbase + t * dstride]), each
    token's 16 results stored at out[obase + t * ostride]. Per block and token: the products of
    the codes (unsigned, 0..15) summed in 16 int32 lanes, one a row; then, in float, times the
    activations' scale less 8 times their sum (the codes' offset), times the rows' scales."""
    from llvmlite import ir

    i8, i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
    vector = ir.VectorType
    bytes64, words, lanes = vector(i8, 64), vector(i32, 16), vector(f32, 16)

    @intrinsic
    def tile(typingctx, flat, at, pairs, xq, xbase, xstride, dx, sums, dbase, dstride, out, obase,
             ostride):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            flat_a, xq_a, dx_a, sums_a, out_a = vnni._arrays(context, builder, signature, args, (0, 3, 6, 7, 10))
            at_v, pairs_v, xbase_v, xstride_v, dbase_v, dstride_v, obase_v, ostride_v = vnni._indices(
                context, builder, signature, args, (1, 2, 4, 5, 8, 9, 11, 12))
            index_t = at_v.type

            def const(k):  # type: ignore[no-untyped-def]
                return ir.Constant(index_t, k)

            def load(array, index, t):  # type: ignore[no-untyped-def]
                return builder.load(builder.bitcast(builder.gep(array.data, [index]), t.as_pointer()), align=1)

            def splat(value, t):  # type: ignore[no-untyped-def]
                one = builder.insert_element(ir.Constant(t, ir.Undefined), value, ir.Constant(i32, 0))
                return builder.shuffle_vector(one, one, ir.Constant(vector(i32, 16), [0] * 16))

            dpbusd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(words, [words] * 3),
                                                    "llvm.x86.avx512.vpdpbusd.512")
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(lanes, [lanes] * 3),
                                                 "llvm.fma.v16f32")
            low_bits = ir.Constant(bytes64, [15] * 64)
            accs = [cgutils.alloca_once_value(builder, ir.Constant(lanes, [0.0] * 16)) for _ in range(tokens)]
            x_bases = [vnni._nth(builder, xbase_v, xstride_v, t) for t in range(tokens)]
            d_bases = [vnni._nth(builder, dbase_v, dstride_v, t) for t in range(tokens)]
            with cgutils.for_range(builder, pairs_v) as loop:
                pair_at = builder.add(at_v, builder.mul(loop.index, const(PAIR_BYTES)))
                scale_words = load(flat_a, pair_at, vector(i16, 32))
                for half in range(2):
                    block = builder.add(builder.mul(loop.index, const(2)), const(half))
                    codes_at = builder.add(pair_at, const(64 + 4 * 64 * half))
                    x_at = builder.mul(block, const(32))
                    dots = [ir.Constant(words, [0] * 16) for _ in range(tokens)]
                    for k in range(4):
                        line = load(flat_a, builder.add(codes_at, const(64 * k)), bytes64)
                        low = builder.and_(line, low_bits)
                        high = builder.and_(builder.lshr(line, ir.Constant(bytes64, [4] * 64)), low_bits)
                        for codes, first in ((low, 4 * k), (high, 16 + 4 * k)):
                            codes_w = builder.bitcast(codes, words)
                            for t in range(tokens):
                                x4 = load(xq_a, builder.add(x_bases[t], builder.add(x_at, const(first))), i32)
                                dots[t] = builder.call(dpbusd, [dots[t], codes_w, splat(x4, words)])
                    halves = builder.shuffle_vector(scale_words, scale_words,
                                                    ir.Constant(vector(i32, 16), list(range(16 * half, 16 * half + 16))))
                    scales = builder.fpext(builder.bitcast(halves, vector(ir.HalfType(), 16)), lanes)
                    for t in range(tokens):
                        d_at = builder.add(d_bases[t], block)
                        offset = builder.fmul(load(sums_a, d_at, f32), ir.Constant(f32, -8.0))
                        term = builder.call(fma, [builder.sitofp(dots[t], lanes), splat(load(dx_a, d_at, f32), lanes),
                                                  splat(offset, lanes)])
                        builder.store(builder.call(fma, [scales, term, builder.load(accs[t])]), accs[t])
            for t in range(tokens):
                at_out = builder.add(obase_v, builder.mul(ostride_v, const(t)))
                builder.store(builder.load(accs[t]), builder.bitcast(builder.gep(out_a.data, [at_out]),
                                                                      lanes.as_pointer()), align=4)
            return context.get_dummy_value()

        return (types.void(flat, at, pairs, xq, xbase, xstride, dx, sums, dbase, dstride, out, obase, ostride),
                codegen)

    return tile


_tile_one = _tile_intrinsic(1)
_tile_many = _tile_intrinsic(TILE_TOKENS)


@njit(cache=True, nogil=True, inline="always")
def rows(flat, base, row_bytes, first, last, cols, xq, dx, sums, out):  # pragma: no cover - compiled
    """out[first:last] (whole groups) of the interleaved matrix at byte ``base`` of flat times one
    token's activations (xq in order, dx and sums per 32: ``vnni._quantized_both``)."""
    pairs = cols // 64
    for g in range(first // GROUP, last // GROUP):
        _tile_one(flat, base + g * GROUP * row_bytes, pairs, xq, 0, 0, dx, sums, 0, 0, out, g * GROUP, 0)


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _matvec(packed, x, out):  # pragma: no cover - compiled
    n_rows, row_bytes = packed.shape
    cols = x.shape[0]
    xq, _, dx, sums = vnni._quantized_both(x, 1, cols, True, False)
    flat = packed.reshape(-1)
    groups = n_rows // GROUP
    items = (groups + GROUPS_PER_ITEM - 1) // GROUPS_PER_ITEM
    threads = vnni.thread_count()
    counters = vnni.work_counters(threads)
    for t in prange(threads):
        while True:
            item = vnni.work_item(counters, t, threads, items)
            if item < 0:
                break
            first = item * GROUPS_PER_ITEM * GROUP
            rows(flat, 0, row_bytes, first, min(n_rows, first + GROUPS_PER_ITEM * GROUP), cols, xq[0], dx[0], sums[0],
                 out)


def matvec(packed: np.ndarray, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``W @ x`` (float32 [rows]) for an interleaved q4_0 matrix ``packed`` (``repack``) and
    float32 x [cols], the activations quantized to int8 per 32 as the q4_0 rows' kernels do."""
    out = np.empty(packed.shape[0], dtype=np.float32) if out is None else out
    _matvec(read_only(packed), writable(np.ascontiguousarray(x, dtype=np.float32)), out)
    return out


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _matmul(packed, x, out):  # pragma: no cover - compiled
    # Work items: GROUPS_PER_ITEM groups by TILE_TOKENS tokens, the groups' tokens in tiles, the
    # tokens past the last whole tile one at a time.
    n_rows, row_bytes = packed.shape
    n, cols = x.shape
    xq, _, dx, sums = vnni._quantized_both(x.reshape(-1), n, cols, True, False)
    flat, xq_flat, dx_flat, sums_flat, out_flat = packed.reshape(-1), xq.reshape(-1), dx.reshape(-1), \
        sums.reshape(-1), out.reshape(-1)
    blocks = cols // 32
    pairs = cols // 64
    groups = n_rows // GROUP
    group_items = (groups + GROUPS_PER_ITEM - 1) // GROUPS_PER_ITEM
    token_items = (n + TILE_TOKENS - 1) // TILE_TOKENS
    threads = vnni.thread_count()
    counters = vnni.work_counters(threads)
    for t in prange(threads):
        while True:
            item = vnni.work_item(counters, t, threads, group_items * token_items)
            if item < 0:
                break
            gi, ti = item // token_items, item % token_items
            first_token = ti * TILE_TOKENS
            for g in range(gi * GROUPS_PER_ITEM, min(groups, (gi + 1) * GROUPS_PER_ITEM)):
                at = g * GROUP * row_bytes
                if first_token + TILE_TOKENS <= n:
                    _tile_many(flat, at, pairs, xq_flat, first_token * cols, cols, dx_flat, sums_flat,
                               first_token * blocks, blocks, out_flat, first_token * n_rows + g * GROUP, n_rows)
                else:
                    for token in range(first_token, n):
                        _tile_one(flat, at, pairs, xq_flat, token * cols, 0, dx_flat, sums_flat, token * blocks, 0,
                                  out_flat, token * n_rows + g * GROUP, 0)


def matmul(x: np.ndarray, packed: np.ndarray) -> np.ndarray:
    """``x @ W.T`` (float32 [n, rows]) for tokens x [n, cols] and an interleaved q4_0 matrix
    ``packed``, each token's activations quantized to int8 per 32."""
    x = writable(np.ascontiguousarray(x, dtype=np.float32))
    out = np.empty((x.shape[0], packed.shape[0]), dtype=np.float32)
    _matmul(read_only(packed), x, out)
    return out
