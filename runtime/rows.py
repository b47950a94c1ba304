"""One token's rows of every VNNI kind at once, mixed in one parallel region: the block kinds
(``vnni.BLOCK_KINDS``: int8, q8_0, q4_0, mxfp4, iq4_nl), the K-quants and iq4_xs
(``kquants.KINDS``), fp8_e4m3, int4 (g32, g64, g128) and, for projections, bf16, with the
activations quantized once in every form the kinds present read.

Two users: a layer's projections that share their input (``projections.py``), and one token
through a layer's experts (``experts_token``; ``chosen_experts_token`` also counts the chosen
experts and picks their tables from the layer's, for the MoE layer's one compiled call). A model quantized by
llama.cpp mixes families within a layer (Q4_K_M: q4_k gate/up, q6_k down in some layers; a
q8_0 attention beside q4_0 experts), so one code path serves every mix instead of one per family.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
from numba import njit, prange

from ktc.formats.kernel_args import read_only, writable
from ktc.formats.schemes import get_scheme

from . import interleave, kquants, vnni

# Kind codes: vnni.BLOCK_KINDS (0-4), then the K-quants from KQUANT on (kquants.KINDS + KQUANT).
KQUANT = len(vnni.BLOCK_KINDS)
# q4_k, q5_k and q6_k read the activations quantized per 256; q2_k and q3_k the sums per 16 too
_Q4_K, _Q5_K, _Q6_K = (KQUANT + kquants.KINDS[name] for name in kquants.PER_256)
_Q2_K, _Q3_K = KQUANT + kquants.KINDS["q2_k"], KQUANT + kquants.KINDS["q3_k"]
# bf16 rows read as they are (the float32 activations, not quantized): a model's attention and
# other non-expert matrices compiled from a Hugging Face checkpoint, which ktc keeps in bf16 by
# default. Projections only (``kind(..., plain=True)``): an expert's rows are read through the
# bundle's whole map, which these rows would read as 16-bit words.
BF16 = KQUANT + len(kquants.KINDS)
# fp8_e4m3 rows (blocks of 128 codes after a float32 scale) read as they are by ``vnni.fp8_rows``
# times the float32 activations: DeepSeek-V3's and Kimi-K2's FP8 experts and projections passed
# through (before, an expert at a time, its codes looked up in a table one by one: a tenth of
# the read bandwidth).
FP8 = BF16 + 1
# int4_g32, int4_g64 and int4_g128 rows (``vnni._int4_row``: codes, then bf16 scales and minimums
# a group) times the activations quantized per group of the kind's own size: INT4 + 0, 1, 2.
INT4 = FP8 + 1
INT4_GROUPS = {"int4_g32": 0, "int4_g64": 1, "int4_g128": 2}
# q4_0, q8_0, mxfp4 and q4_k rows interleaved 16 at a time (``interleave.repack``: a layer's
# projections and output matrix on a VNNI CPU, ``HostLinear.interleaved``; the experts of
# ``ExpertSet``'s copy) times the activations in order, per 32 (q4_k: per 256, as q6_k's rows
# read them): Q4_0X16 plus the scheme's place in ``interleave.SCHEMES``. Not stored schemes:
# ``kind`` never names them; the caller that made the copy says so (``INTERLEAVED``).
Q4_0X16 = INT4 + len(INT4_GROUPS)
INTERLEAVED = {name: Q4_0X16 + code for code, name in enumerate(interleave.SCHEMES)}
_Q4_KX16 = INTERLEAVED["q4_k"]
ROWS_PER_ITEM = 64  # rows per parallel work item, over all the matrices of a call (whole groups of the interleaved)
# A token's down rows in spans of every expert (``rows_combined``) where an expert's span is
# this long or longer, else an expert at a time (``rows_many``, then ``combined``). Measured in
# decode steps here, down regions, medians of interleaved runs: at Qwen3-30B-A3B's shape (768-value
# rows: spans of 27-52 KB) an expert at a time took Q4_0 289-302 against 340-365 us, Q8_0 452-466
# against 566-573, Q4_K_M 406-413 against 459-487 (plus the sum's 5-6 us); at Mixtral-8x7B's
# (14336-value rows: spans of 476-975 KB) Q4_0 2640-2750 against 2290-2460 us, MXFP4 and Q4_K_M
# 3% slower, Q8_0 3% faster.
SPAN_BYTES = 128 * 1024


def kind(scheme: str, *, plain: bool = False) -> int | None:
    """The kind code of ``scheme``, or None where these kernels do not read it (with ``plain``,
    bf16 too: ``BF16``)."""
    if scheme in vnni.BLOCK_KINDS:
        return vnni.BLOCK_KINDS[scheme]
    if scheme in vnni.KQUANTS:
        return KQUANT + kquants.KINDS[scheme]
    if plain and scheme == "bf16":
        return BF16
    if scheme == "fp8_e4m3":
        return FP8
    if scheme in INT4_GROUPS:
        return INT4 + INT4_GROUPS[scheme]
    return None


@functools.lru_cache(maxsize=4096)
def layout(schemes: tuple[str, ...], cols: int) -> tuple[np.ndarray, np.ndarray]:
    """(kind codes, bytes a row) of matrices of ``cols`` columns in ``schemes``; kept per
    selection (a decode step's Python runs among streaming weights, where each small step costs
    microseconds)."""
    return (np.array([kind(name) for name in schemes], dtype=np.int64),
            np.array([get_scheme(name).matrix_bytes(1, cols) for name in schemes], dtype=np.int64))


@njit(cache=True, nogil=True)
def activations(x, n, cols, kinds):  # pragma: no cover - compiled
    """n vectors of cols values (x flat) quantized for the matrices of ``kinds``: (xq, quads, dx,
    sums, lanes, isum16, dsum16, yk, dk, bsum, xs, iq, idx, isum), each [n, ...]: int8 values per 32 in order (int8,
    q8_0, q2_k, q3_k, iq4_xs) and in quad_layout (q4_0, mxfp4, iq4_nl), their scales and dequantized
    sums, the block kinds' per-lane terms (``vnni.lanes_into``, the parts those present read),
    the int8 and dequantized sums per 16 (q3_k's offsets, q2_k's minimums), and the activations
    per 256 of q4_k, q5_k and q6_k (``kquants.superblock_activations``), the vectors as floats,
    denormals made zeros (``FP8`` and ``BF16`` read them: ``vnni.without_denormals``), and int4's (int8 values [3, n * cols], scales and dequantized sums
    [3, n * cols // 32]: per 32 (in quad_layout), 64 and 128 values, those of group g in the first
    n * cols / (32 << g) places). What no kind present reads is left unfilled, or empty."""
    in_order, in_quads, sums16, blocks = False, False, False, False
    int4 = 0  # a bit for each int4 group size present
    floats = False  # a kind that multiplies the activations as floats: fp8's and bf16's rows
    for code in kinds:
        if INT4 <= code < Q4_0X16:
            int4 |= 1 << (code - INT4)
        floats |= code == FP8 or code == BF16
        in_order |= (code < 2 or (code >= Q4_0X16 and code != _Q4_KX16)
                     or (KQUANT <= code < BF16 and code != _Q4_K and code != _Q5_K and code != _Q6_K))
        in_quads |= 2 <= code < KQUANT
        sums16 |= code == _Q2_K or code == _Q3_K
        blocks |= code < KQUANT
    xq, quads, dx, sums = vnni._quantized_both(x, n, cols, in_order, in_quads)
    if blocks:  # only the parts the kinds present read (``vnni.lanes_into``): 8 x 768 values' whole
        # lanes are 48 KB, which inside a decode step were written to lines in no cache
        parts = np.zeros(4, np.bool_)
        for code in kinds:
            if code < KQUANT:
                parts[max(code - 1, 0)] = True
        lanes = np.empty((n, 64 * (cols // 32)), np.float32)
        for v in range(n):
            vnni.lanes_into(dx[v], sums[v], lanes[v], parts)
    else:
        lanes = np.zeros((n, 0), np.float32)
    isum16 = np.empty((n, cols // 16), np.float32)
    dsum16 = np.empty((n, cols // 16), np.float32)
    if sums16:
        kquants._sums16(xq.reshape(-1), dx.reshape(-1), isum16.reshape(-1), dsum16.reshape(-1))
    yk, dk, bsum = kquants.superblock_activations(x, n, cols, ((kinds == _Q4_K) | (kinds == _Q5_K)).any(),
                                                  ((kinds == _Q6_K) | (kinds == _Q4_KX16)).any())
    width = n * cols if int4 else 0
    iq, idx, isum = np.empty((3, width), np.int8), np.empty((3, width // 32), np.float32), np.empty((3, width // 32),
                                                                                                   np.float32)
    for g in range(3):
        if int4 & (1 << g):  # groups never straddle two vectors: cols is a multiple of the group
            count = width // (32 << g)  # int4_g32 reads its activations in quad_layout, as q4_0
            vnni._quantize_groups(x, 32 << g, cols if g == 0 else 0, iq[g], idx[g, :count], isum[g, :count])
    xs = vnni.without_denormals(x) if floats else x
    return xq, quads, dx, sums, lanes, isum16, dsum16, yk, dk, bsum, xs.reshape(n, cols), iq, idx, isum


@njit(cache=True, nogil=True, inline="always")
def rows(code, flat, f32, f16, e8m0, base, row_bytes, first, last, cols, act, v, out,
         acc):  # pragma: no cover - compiled
    """out[r] for rows first..last of the matrix of kind ``code`` at byte ``base`` of flat (f32: a
    float32 view of the same bytes, where int8 rows keep their scales) times vector v of ``act``
    (``activations``); acc: 16 float32s of scratch (a thread's, ``vnni._block_rows``)."""
    xq, quads, dx, sums, lanes, isum16, dsum16, yk, dk, bsum, xs, iq, idx, isum = act
    if code == _Q4_KX16:  # whole groups, as below; the activations per 256 in order, as q6_k's
        interleave.k_rows(flat, base, row_bytes, first, last, cols, yk[v], cols, dk[v], bsum[v], out)
        return
    if code >= Q4_0X16:  # whole groups: the matrix's rows and ROWS_PER_ITEM are multiples of 16
        interleave.rows(code - Q4_0X16, flat, base, row_bytes, first, last, cols, xq[v], dx[v], sums[v], out)
        return
    if code >= INT4:
        g = code - INT4
        group = 32 << g
        groups = cols // group
        xe = iq[g, v * cols:(v + 1) * cols]
        dxe, sume = idx[g, v * groups:(v + 1) * groups], isum[g, v * groups:(v + 1) * groups]
        words = flat.view(np.uint16)
        for r in range(first, last):
            at = base + r * row_bytes
            out[r] = vnni._int4_row(group // 2, flat, at, groups, xe, dxe, sume, words, (at + cols // 2) // 2)
        return
    if code < KQUANT:
        vnni._block_rows(code, flat, f32, f16, e8m0, base, row_bytes, first, last, quads[v] if code >= 2 else xq[v],
                         dx[v], sums[v], lanes[v], out, acc)
        return
    if code == FP8:
        vnni.fp8_rows(flat, base + first * row_bytes, row_bytes, last - first, cols // 128, xs[v], out, first)
        return
    if code == BF16:  # 16-bit words from an even byte (a projection's own matrix: base 0)
        words, xs_v = flat.view(np.uint16), xs[v]
        for r in range(first, last):
            out[r] = vnni.bf16_dot(words, (base + r * row_bytes) // 2, cols // 16, xs_v)
        return
    # vector v's views taken once, not for every row (``kquants.k_rows``' arguments): taken in the
    # row loop, made again for each row, they cost as much as a short row's products. Qwen3-30B-
    # A3B's down rows (768 values, 8 experts' 2048 rows, cold) q4_k 133-138 against 202-206 us on
    # two cores, 235-259 against 379-403 on one; q6_k on one 296-298 against 407-414; 2048-value
    # rows 5-10% less.
    kquants.k_rows(flat, code - KQUANT, base, row_bytes, first, last, cols // 256, xq[v], dx[v], sums[v], isum16[v],
                   dsum16[v], yk[v], dk[v], bsum[v], out)


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def rows_many(flat, f32, f16, e8m0, kinds, offsets, row_bytes, cols, act, out):  # pragma: no cover - compiled
    """out[e, r] = row r of the matrix of kind kinds[e] (row_bytes[e] bytes a row) at byte
    offsets[e] of flat times vector e of ``act`` (or its one vector): the same matrix of every
    selected expert of a layer, whatever their kinds, in one parallel region, ``ROWS_PER_ITEM``
    rows a work item over all of them (``vnni.work_item``), so both threads finish together."""
    k, n_rows = out.shape
    chunks = (n_rows + ROWS_PER_ITEM - 1) // ROWS_PER_ITEM
    shared = act[2].shape[0] == 1  # one vector for every expert (gate/up of one token)
    threads = vnni.thread_count()
    counters = vnni.work_counters(threads)
    for t in prange(threads):
        acc = np.zeros(16, np.float32)
        while True:
            item = vnni.work_item(counters, t, threads, k * chunks)
            if item < 0:
                break
            e = item // chunks
            first = (item - e * chunks) * ROWS_PER_ITEM
            rows(kinds[e], flat, f32, f16, e8m0, offsets[e], row_bytes[e], first,
                 min(n_rows, first + ROWS_PER_ITEM), cols, act, 0 if shared else e, out[e], acc)


def experts_rows(file: np.ndarray, scheme: str | Sequence[str], offsets: np.ndarray, rows: int,
                 x: np.ndarray) -> np.ndarray:
    """[k, rows]: the matrix stored at byte ``offsets[e]`` of ``file`` (the bundle mapped as
    uint8, of a length that is a multiple of 4) times x[e], for the k selected experts of a layer
    at once; ``x`` of one row is every expert's (quantized once). ``scheme``: one of
    ``vnni.FUSED`` for all k, or one each, mixed in one parallel region (``rows_many``)."""
    vectors, cols = x.shape
    k = offsets.shape[0]
    file = read_only(file)
    kinds, row_bytes = _fused_layout((scheme,) * k if isinstance(scheme, str) else tuple(scheme), cols)
    f16, e8m0 = vnni._tables()
    act = activations(writable(np.ascontiguousarray(x, dtype=np.float32)).reshape(-1), vectors, cols, kinds)
    out = np.empty((k, rows), dtype=np.float32)
    rows_many(file, file.view(np.float32), f16, e8m0, kinds, offsets, row_bytes, cols, act, out)
    return out


@functools.lru_cache(maxsize=4096)
def _fused_layout(schemes: tuple[str, ...], cols: int) -> tuple[np.ndarray, np.ndarray]:
    """``layout`` of the selected experts' schemes, each checked to be one of ``vnni.FUSED``."""
    if not set(schemes) <= vnni.FUSED:
        raise ValueError(f"no multi-expert kernel for {sorted(set(schemes) - vnni.FUSED)}")
    return layout(schemes, cols)


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def rows_combined(flat, f32, f16, e8m0, kinds, offsets, row_bytes, cols, act, weights, bias, has_bias,
                  out):  # pragma: no cover - compiled
    """out[r] = sum over e of weights[e] * (row r of expert e's matrix times its vector e of
    ``act``, plus bias[e, r]): the down matrices of a token's experts and their weighted sum in
    one parallel region, a work item ``ROWS_PER_ITEM`` rows of every expert
    (``vnni.work_item``), so each thread sums the rows it has just computed: for long rows
    (``SPAN_BYTES``)."""
    n_rows = out.shape[0]
    chunks = (n_rows + ROWS_PER_ITEM - 1) // ROWS_PER_ITEM
    y = np.empty(n_rows, np.float32)  # an expert's rows, each item writing and reading its own
    threads = vnni.thread_count()
    counters = vnni.work_counters(threads)
    for t in prange(threads):
        acc = np.zeros(16, np.float32)
        while True:
            c = vnni.work_item(counters, t, threads, chunks)
            if c < 0:
                break
            first = c * ROWS_PER_ITEM
            last = min(n_rows, first + ROWS_PER_ITEM)
            for r in range(first, last):
                out[r] = 0.0
            for e in range(kinds.shape[0]):
                rows(kinds[e], flat, f32, f16, e8m0, offsets[e], row_bytes[e], first, last, cols, act, e, y, acc)
                add_weighted(out, y, weights[e], bias[e if has_bias else 0], has_bias, first, last)


@njit(cache=True, nogil=True, fastmath=True)
def combined(y, weights, bias, has_bias):  # pragma: no cover - compiled
    """sum over e of weights[e] * (y[e] + bias[e]): a token's experts' outputs y [k, hidden]
    (plus their down biases) weighted and summed, the experts in order (as ``rows_combined``
    sums them), on one thread after the down rows' region (``SPAN_BYTES``). Summed inside that
    region by each thread for its share of the rows once every item was computed (an atomic
    count of them): 12 us against these 5-6 (Qwen3-30B-A3B's shape); by the thread that computed
    a span's last expert: the down region 320 against 290 us (the span's counter crossed between
    the cores at every item)."""
    k, hidden = y.shape
    out = np.zeros(hidden, np.float32)
    for e in range(k):
        add_weighted(out, y[e], weights[e], bias[e if has_bias else 0], has_bias, 0, hidden)
    return out


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def add_weighted(out, y, w, bias, has_bias, first, last):  # pragma: no cover - compiled
    """out[r] += w * (y[r] + bias[r]) (without bias where not ``has_bias``) for r in
    first..last: an expert's output rows weighted into a sum (``rows_combined``, ``combined``,
    ``_into_tokens``), one loop each way so that both vectorize."""
    if has_bias:
        for r in range(first, last):
            out[r] += w * (y[r] + bias[r])
    else:
        for r in range(first, last):
            out[r] += w * y[r]


@njit(cache=True, nogil=True)
def experts_token(file, f32, f16, e8m0, gu_kinds, gu_offsets, gu_rows, dn_kinds, dn_offsets, dn_rows, x, weights,
                  inter, clamped, limit, alpha, gu_bias, has_gu_bias, dn_bias, has_dn_bias,
                  stamps):  # pragma: no cover - compiled
    """One token x through k experts (their gate/up and down matrices' kinds, byte offsets in
    file and bytes a row), weighted by ``weights`` and summed, in one compiled call: x quantized,
    every gate/up in one parallel region, the activation (``vnni.activate``), it quantized, every
    down and their weighted sum (``rows_combined``, or for short rows every down in a region,
    then ``combined``: ``SPAN_BYTES``). With ``stamps`` of 7 or more
    (``vnni.STAMPS``), the cycle counter at the start, after quantizing x, after the gate/up rows,
    after the activation, after quantizing it, after the down rows, and after their sum (the same
    count where the sum is inside the down rows' region)."""
    k = gu_kinds.shape[0]
    hidden = x.shape[0]
    timed = stamps.shape[0] >= 7
    if timed:
        stamps[0] = vnni._cycles()
    act = activations(x, 1, hidden, gu_kinds)
    if timed:
        stamps[1] = vnni._cycles()
    h = np.empty((k, 2 * inter), np.float32)
    rows_many(file, f32, f16, e8m0, gu_kinds, gu_offsets, gu_rows, hidden, act, h)
    if timed:
        stamps[2] = vnni._cycles()
    a = vnni.activate(h, inter, clamped, limit, alpha, gu_bias, has_gu_bias)
    if timed:
        stamps[3] = vnni._cycles()
    act_a = activations(a, k, inter, dn_kinds)
    if timed:
        stamps[4] = vnni._cycles()
    if dn_rows.max() * ROWS_PER_ITEM >= SPAN_BYTES:  # long rows: each thread's span of every expert
        out = np.empty(hidden, np.float32)
        rows_combined(file, f32, f16, e8m0, dn_kinds, dn_offsets, dn_rows, inter, act_a, weights, dn_bias,
                      has_dn_bias, out)
        if timed:  # the combination is inside the down rows' region
            stamps[5] = stamps[6] = vnni._cycles()
        return out
    y = np.empty((k, hidden), np.float32)  # short rows: an expert at a time, then their sum
    rows_many(file, f32, f16, e8m0, dn_kinds, dn_offsets, dn_rows, inter, act_a, y)
    if timed:
        stamps[5] = vnni._cycles()
    out = combined(y, weights, dn_bias, has_dn_bias)
    if timed:
        stamps[6] = vnni._cycles()
    return out


@njit(cache=True, nogil=True)
def pairs_token(file, f32, f16, e8m0, gu_kinds, gu_offsets, gu_rows, dn_kinds, dn_offsets, dn_rows, inter, clamped,
                limit, alpha, gu_bias, has_gu_bias, dn_bias, has_dn_bias, experts, tokens, weights, xs,
                n):  # pragma: no cover - compiled
    """Pairs of an expert and one token (``experts``, ``tokens``, their routing ``weights``; xs
    [pairs, hidden]: each pair's token's hidden state; the tables the whole layer's, as for
    ``chosen_experts_token``) in one compiled call: every pair's gate/up rows in one parallel
    region, the activation and its quantization, every pair's down rows in another, then each
    output weighted and added to its token's row of out [n, hidden]. For the experts a prompt
    chunk gives one token each (at Qwen3-30B-A3B's shape most of them, for up to a few dozen
    tokens), which otherwise run an expert a call."""
    p, hidden = xs.shape
    gk, dk = gu_kinds[experts], dn_kinds[experts]  # the pairs' kinds, each read twice below
    act = activations(xs.reshape(-1), p, hidden, gk)
    h = np.empty((p, 2 * inter), np.float32)
    rows_many(file, f32, f16, e8m0, gk, gu_offsets[experts], gu_rows[experts], hidden, act, h)
    a = vnni.activate(h, inter, clamped, limit, alpha, gu_bias[experts] if has_gu_bias else gu_bias, has_gu_bias)
    act_a = activations(a, p, inter, dk)
    y = np.empty((p, hidden), np.float32)
    rows_many(file, f32, f16, e8m0, dk, dn_offsets[experts], dn_rows[experts], inter, act_a, y)
    return _into_tokens(y, experts, tokens, weights, dn_bias, has_dn_bias, n)


@njit(cache=True, nogil=True)
def _into_tokens(y, experts, tokens, weights, dn_bias, has_dn_bias, n):  # pragma: no cover - compiled
    # [n, hidden]: each row i of y, the output of expert experts[i] for token tokens[i], plus
    # that expert's down bias where present, weighted by weights[i] and added to its token's row
    out = np.zeros((n, y.shape[1]), np.float32)
    for i in range(y.shape[0]):
        add_weighted(out[tokens[i]], y[i], weights[i], dn_bias[experts[i] if has_dn_bias else 0], has_dn_bias, 0,
                     y.shape[1])
    return out


@njit(cache=True, nogil=True)
def _groups_product(file, f16, e8m0, code, offsets, row_bytes, x, groups, out):  # pragma: no cover - compiled
    # out rows groups[g]..groups[g + 1] = x's rows there times the matrix of kind ``code`` (a
    # block kind, q4_k, q5_k, q6_k, or an interleaved kind) at byte offsets[g] of file, each
    # group's matrix once
    cols = x.shape[1]
    if code >= Q4_0X16:
        interleave.groups_product(code - Q4_0X16, file, offsets, row_bytes, x, groups, out)
    elif code < KQUANT:
        xq, dx, sums, lanes, width = vnni.padded_activations(x, code)
        vnni._blocks_batched_groups(file, code, offsets, row_bytes, f16, e8m0, xq, dx, sums, cols, lanes, width,
                                    groups, out)
    else:
        yk, ybase, dk, bsum = kquants.k_activations(x, code - KQUANT)
        kquants.k_batched_groups(file, code - KQUANT, offsets, row_bytes, cols, yk, ybase, dk, bsum, groups, out)


@njit(cache=True, nogil=True)
def experts_groups(file, f16, e8m0, gu_code, gu_offsets, gu_row_bytes, dn_code, dn_offsets, dn_row_bytes, inter,
                   clamped, limit, alpha, gu_bias, has_gu_bias, dn_bias, has_dn_bias, groups, row_experts, xs, weights,
                   tokens, n_tokens):  # pragma: no cover - compiled
    """Several experts, each with a few tokens, in one compiled call: expert g's tokens are rows
    groups[g]..groups[g + 1] of xs [tokens, hidden] (row_experts: each row's expert, the index of
    its biases in the layer's gu_bias and dn_bias where present; weights: their routing weights;
    tokens: their rows of the result), its gate/up of kind gu_code (a block kind other than
    int8, or q4_k, q5_k, q6_k: their row tiles; or an interleaved kind, with fewer tokens than
    ``interleave.FEW_TOKENS``) at byte gu_offsets[g] of file, its down of
    dn_code at dn_offsets[g]. Every expert's gate/up rows in one parallel region (BATCH_ROWS
    rows of an expert a work item), the activation, every down in another; each row weighted
    and added to row tokens[t] of the result [n_tokens, hidden], as ``pairs_token`` adds its
    pairs'."""
    n, hidden = xs.shape
    h = np.empty((n, 2 * inter), np.float32)
    _groups_product(file, f16, e8m0, gu_code, gu_offsets, gu_row_bytes, xs, groups, h)
    a = vnni.activate(h, inter, clamped, limit, alpha, gu_bias[row_experts] if has_gu_bias else gu_bias,
                      has_gu_bias).reshape(n, inter)
    y = np.empty((n, hidden), np.float32)
    _groups_product(file, f16, e8m0, dn_code, dn_offsets, dn_row_bytes, a, groups, y)
    return _into_tokens(y, row_experts, tokens, weights, dn_bias, has_dn_bias, n_tokens)


def groups_fit(scheme: str, cols: int) -> bool:
    """Whether ``experts_groups`` takes matrices of ``scheme`` with rows of ``cols`` values."""
    if scheme in vnni.BLOCK_KINDS:
        return vnni.batched_fits(scheme, cols)
    return kquants.batched_fits(scheme, cols)


@njit(cache=True, nogil=True)
def chosen_experts_token(file, f32, f16, e8m0, gu_kinds, gu_offsets, gu_rows, dn_kinds, dn_offsets, dn_rows, inter,
                         clamped, limit, alpha, gu_bias, has_gu_bias, dn_bias, has_dn_bias, counts, idx, weights, x,
                         stamps):  # pragma: no cover - compiled
    """One token through the layer's experts ``idx`` (weighted by ``weights``; the tables are
    the whole layer's, per expert, as ``experts.ExpertSet.one_call_tables`` builds them): counted,
    then ``experts_token`` over them."""
    # The chosen experts' six tables in one array, not six (fancy indexing): a decode step's
    # allocations run among streaming weights, their allocator's lines evicted. From the routing's
    # end to the experts' start, Qwen3-30B-A3B-shaped MXFP4 decodes (two layers, alternating
    # processes, the memory's slow phase): 1.7-2.4 us with six, 1.1-1.6 with one.
    k = idx.shape[0]
    chosen = np.empty((6, k), np.int64)
    for j in range(k):
        e = idx[j]
        counts[e] += 1
        chosen[0, j], chosen[1, j], chosen[2, j] = gu_kinds[e], gu_offsets[e], gu_rows[e]
        chosen[3, j], chosen[4, j], chosen[5, j] = dn_kinds[e], dn_offsets[e], dn_rows[e]
    return experts_token(file, f32, f16, e8m0, chosen[0], chosen[1], chosen[2], chosen[3],
                         chosen[4], chosen[5], x, weights, inter, clamped, limit, alpha,
                         gu_bias[idx] if has_gu_bias else gu_bias, has_gu_bias,
                         dn_bias[idx] if has_dn_bias else dn_bias, has_dn_bias, stamps)


_NO_BIAS = np.zeros((1, 1), dtype=np.float32)


def token(file: np.ndarray, gu_schemes: tuple[str, ...], dn_schemes: tuple[str, ...], gate_up_offsets: np.ndarray,
          down_offsets: np.ndarray, hidden: int, inter: int, x: np.ndarray, weights: np.ndarray, clamped: bool,
          limit: float, alpha: float, gate_up_bias: np.ndarray | None, down_bias: np.ndarray | None) -> np.ndarray:
    """``kernels.experts_token`` for experts whose matrices all have a kind (gate/up and down may
    differ): one compiled call (``experts_token``)."""
    gu_kinds, gu_rows = layout(gu_schemes, hidden)
    dn_kinds, dn_rows = layout(dn_schemes, inter)
    f16, e8m0 = vnni._tables()
    file = read_only(file)
    return experts_token(file, file.view(np.float32), f16, e8m0, gu_kinds,
                         np.ascontiguousarray(gate_up_offsets, dtype=np.int64), gu_rows, dn_kinds,
                         np.ascontiguousarray(down_offsets, dtype=np.int64), dn_rows,
                         writable(np.ascontiguousarray(x, dtype=np.float32)),
                         np.ascontiguousarray(weights, dtype=np.float32),
                         inter, clamped, np.float32(limit), np.float32(alpha),
                         _NO_BIAS if gate_up_bias is None else np.ascontiguousarray(gate_up_bias, dtype=np.float32),
                         gate_up_bias is not None,
                         _NO_BIAS if down_bias is None else np.ascontiguousarray(down_bias, dtype=np.float32),
                         down_bias is not None, vnni.stamps())
