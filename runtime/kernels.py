"""Numba CPU kernels for experts stored in the bundle's schemes.

Each scheme has a matrix-vector kernel over its raw rows (``[rows, row_bytes]`` bytes, the
layouts of ``docs/bundle-format.md``): one token through one weight matrix, reading every weight
byte once, which is what bounds decode speed. ``expert_forward`` chains them into an expert's
``down(act(gate x) * up x)``; ``expert_forward_batch`` decodes the expert once and multiplies a
batch of tokens routed to it. Kernels release the GIL so the CPU experts of a layer can run in a
thread while torch runs the GPU experts.
"""

from __future__ import annotations

import functools
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from ktc.formats.dequant import FP4_E2M1_VALUES
from ktc.formats.float_bits import E8M0_TO_F32, F16_TO_F32, bf16_value, f32_to_bf16_bits, put_decoded
from ktc.formats.kernel_args import read_only, writable
from ktc.formats.schemes import expert_schemes

from . import amx, fp8, interleave, kquants, lanes, rows, vnni

_F16_TO_F32 = F16_TO_F32
# e2m1 code -> value, and e8m0 exponent byte -> 2^(e - 127)
_FP4 = FP4_E2M1_VALUES
_E8M0 = E8M0_TO_F32

_OPTS = dict(cache=True, nogil=True, parallel=True, fastmath=True)


@njit(**_OPTS)
def _matvec_f32(w, x, out):  # pragma: no cover - compiled
    for r in prange(w.shape[0]):
        acc = np.float32(0.0)
        for j in range(x.shape[0]):
            acc += w[r, j] * x[j]
        out[r] = acc


def exact_bf16(values: np.ndarray) -> np.ndarray:
    """float32 ``values`` as bf16 bit patterns (uint16) where every value is one exactly, else as
    they are: half the bytes, the same products. Weights trained and published in bf16 (a MoE
    router, Qwen3-30B-A3B's or Mixtral's, which a GGUF widens to f32; a bf16 bundle's matrices
    decoded) read from memory once a token: a router's f32 bytes were 5% of a
    Qwen3-30B-A3B-shaped Q4_0 layer's."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    if np.any(bits & np.uint32(0xFFFF)):
        return values
    return (bits >> np.uint32(16)).astype(np.uint16)


@njit(**_OPTS)
def _matvec_bf16(w, x, out):  # pragma: no cover - compiled
    # w: uint16 bit patterns [rows, cols]; a bf16 is the top half of a float32.
    cols = x.shape[0]
    if vnni._COMPILED and cols % 16 == 0 and w.strides[1] == 2 and x.strides[0] == 4:
        for r in prange(w.shape[0]):  # 16 lanes a step (vnni.bf16_dot), each row's values back to back
            out[r] = vnni.bf16_dot(w[r], 0, cols // 16, x)
        return
    for r in prange(w.shape[0]):
        widened = np.empty(cols, dtype=np.uint32)
        for j in range(cols):
            widened[j] = np.uint32(w[r, j]) << np.uint32(16)
        values = widened.view(np.float32)
        acc = np.float32(0.0)
        for j in range(cols):
            acc += values[j] * x[j]
        out[r] = acc


@njit(**_OPTS)
def _matvec_f16(w, x, table, out):  # pragma: no cover - compiled
    for r in prange(w.shape[0]):
        acc = np.float32(0.0)
        for j in range(x.shape[0]):
            acc += table[w[r, j]] * x[j]
        out[r] = acc


@njit(**_OPTS)
def _matvec_int8_4rows(codes, scales, x, out):  # pragma: no cover - compiled
    # For long rows: x is read once for four rows (a 14336-wide x is 4x the bytes of a row).
    rows = codes.shape[0]
    cols = x.shape[0]
    last = rows - 1
    for rb in prange((rows + 3) // 4):
        r0, r1, r2, r3 = rb * 4, min(rb * 4 + 1, last), min(rb * 4 + 2, last), min(rb * 4 + 3, last)
        a0 = np.zeros(16, np.float32)
        a1 = np.zeros(16, np.float32)
        a2 = np.zeros(16, np.float32)
        a3 = np.zeros(16, np.float32)
        for c in range(cols // 16):
            base = c * 16
            for j in range(16):
                xj = x[base + j]
                a0[j] += np.float32(codes[r0, base + j]) * xj
                a1[j] += np.float32(codes[r1, base + j]) * xj
                a2[j] += np.float32(codes[r2, base + j]) * xj
                a3[j] += np.float32(codes[r3, base + j]) * xj
        tail0 = tail1 = tail2 = tail3 = np.float32(0.0)
        for j in range(cols // 16 * 16, cols):
            tail0 += np.float32(codes[r0, j]) * x[j]
            tail1 += np.float32(codes[r1, j]) * x[j]
            tail2 += np.float32(codes[r2, j]) * x[j]
            tail3 += np.float32(codes[r3, j]) * x[j]
        _store4(out, rb * 4, rows, (a0.sum() + tail0) * scales[r0], (a1.sum() + tail1) * scales[r1],
                (a2.sum() + tail2) * scales[r2], (a3.sum() + tail3) * scales[r3])


@njit(**_OPTS)
def _matvec_int8(codes, scales, x, out):  # pragma: no cover - compiled
    # codes: int8 [rows, cols] (a view of the row bytes), scales: float32 [rows]
    cols = x.shape[0]
    for r in prange(codes.shape[0]):
        acc = np.float32(0.0)
        for j in range(cols):
            acc += np.float32(codes[r, j]) * x[j]
        out[r] = acc * scales[r]


# Block formats: four rows per iteration, each with 16 accumulator lanes that live in vector
# registers, so x is loaded once for four rows and no horizontal sum is paid per block (the
# one-row, reduce-per-block form ran at 5-10% of the read bandwidth here, this one 3-4x faster).
# Rows past the end (when rows % 4 != 0) repeat the last row and are not stored.


@njit(cache=True, nogil=True, inline="always")
def _half(raw, r, at, table):  # pragma: no cover - compiled
    return table[np.uint16(raw[r, at]) | (np.uint16(raw[r, at + 1]) << np.uint16(8))]


@njit(cache=True, nogil=True, inline="always")
def _e2m1_doubled(code):  # pragma: no cover - compiled
    # 2 x the e2m1 value of a 4-bit code, without a table: 0 1 2 3 4 6 8 12, sign in bit 3
    m = code & np.int32(7)
    shift = max((m >> np.int32(1)) - np.int32(1), np.int32(0))
    mag = m if m < np.int32(2) else (np.int32(2) + (m & np.int32(1))) << shift
    return np.float32(-mag) if code & np.int32(8) else np.float32(mag)


@njit(**_OPTS)
def _matvec_q8_0(raw, x, table, out):  # pragma: no cover - compiled
    # raw: uint8 [rows, cols / 32 * 34]; block = float16 d, 32 int8. Each lane takes values j and
    # j + 16 of a block, so the scale multiplies once per two products.
    rows = raw.shape[0]
    blocks = x.shape[0] // 32
    last = rows - 1
    for rb in prange((rows + 3) // 4):
        r0, r1, r2, r3 = rb * 4, min(rb * 4 + 1, last), min(rb * 4 + 2, last), min(rb * 4 + 3, last)
        a0 = np.zeros(16, np.float32)
        a1 = np.zeros(16, np.float32)
        a2 = np.zeros(16, np.float32)
        a3 = np.zeros(16, np.float32)
        for b in range(blocks):
            base = b * 34
            xb = b * 32
            d0, d1 = _half(raw, r0, base, table), _half(raw, r1, base, table)
            d2, d3 = _half(raw, r2, base, table), _half(raw, r3, base, table)
            for j in range(16):
                xl = x[xb + j]
                xh = x[xb + 16 + j]
                a0[j] += d0 * (np.float32(np.int8(raw[r0, base + 2 + j])) * xl
                               + np.float32(np.int8(raw[r0, base + 18 + j])) * xh)
                a1[j] += d1 * (np.float32(np.int8(raw[r1, base + 2 + j])) * xl
                               + np.float32(np.int8(raw[r1, base + 18 + j])) * xh)
                a2[j] += d2 * (np.float32(np.int8(raw[r2, base + 2 + j])) * xl
                               + np.float32(np.int8(raw[r2, base + 18 + j])) * xh)
                a3[j] += d3 * (np.float32(np.int8(raw[r3, base + 2 + j])) * xl
                               + np.float32(np.int8(raw[r3, base + 18 + j])) * xh)
        _store4(out, rb * 4, rows, a0.sum(), a1.sum(), a2.sum(), a3.sum())


@njit(cache=True, nogil=True, inline="always")
def _store4(out, r, rows, v0, v1, v2, v3):  # pragma: no cover - compiled
    out[r] = v0
    if r + 1 < rows:
        out[r + 1] = v1
    if r + 2 < rows:
        out[r + 2] = v2
    if r + 3 < rows:
        out[r + 3] = v3


@njit(**_OPTS)
def _matvec_q4_0(raw, x, xsum, table, out):  # pragma: no cover - compiled
    # block = float16 d, 16 bytes: value j low nibble, j + 16 high nibble; value = (q - 8) d,
    # so a row is sum_b d_b ((q . x)_b - 8 xsum_b). Nibbles are split in float32 lanes
    # (b - 16 floor(b / 16)): Numba widens integer arithmetic to int64, which halves the lanes.
    rows = raw.shape[0]
    blocks = x.shape[0] // 32
    last = rows - 1
    sixteen = np.float32(16.0)
    sixteenth = np.float32(0.0625)
    eight = np.float32(8.0)
    for rb in prange((rows + 3) // 4):
        r0, r1, r2, r3 = rb * 4, min(rb * 4 + 1, last), min(rb * 4 + 2, last), min(rb * 4 + 3, last)
        a0 = np.zeros(16, np.float32)
        a1 = np.zeros(16, np.float32)
        a2 = np.zeros(16, np.float32)
        a3 = np.zeros(16, np.float32)
        t0 = t1 = t2 = t3 = np.float32(0.0)
        for b in range(blocks):
            base = b * 18
            xb = b * 32
            d0, d1 = _half(raw, r0, base, table), _half(raw, r1, base, table)
            d2, d3 = _half(raw, r2, base, table), _half(raw, r3, base, table)
            sb = eight * xsum[b]
            t0 += d0 * sb
            t1 += d1 * sb
            t2 += d2 * sb
            t3 += d3 * sb
            for j in range(16):
                xl = x[xb + j]
                xh = x[xb + 16 + j]
                c = np.float32(raw[r0, base + 2 + j])
                h = np.floor(c * sixteenth)
                a0[j] += d0 * ((c - h * sixteen) * xl + h * xh)
                c = np.float32(raw[r1, base + 2 + j])
                h = np.floor(c * sixteenth)
                a1[j] += d1 * ((c - h * sixteen) * xl + h * xh)
                c = np.float32(raw[r2, base + 2 + j])
                h = np.floor(c * sixteenth)
                a2[j] += d2 * ((c - h * sixteen) * xl + h * xh)
                c = np.float32(raw[r3, base + 2 + j])
                h = np.floor(c * sixteenth)
                a3[j] += d3 * ((c - h * sixteen) * xl + h * xh)
        _store4(out, rb * 4, rows, a0.sum() - t0, a1.sum() - t1, a2.sum() - t2, a3.sum() - t3)


@njit(**_OPTS)
def _matvec_mxfp4(raw, x, e8m0, out):  # pragma: no cover - compiled
    # block = e8m0 exponent byte, 16 bytes of e2m1 codes (j low nibble, j + 16 high)
    rows = raw.shape[0]
    blocks = x.shape[0] // 32
    last = rows - 1
    half = np.float32(0.5)
    m4 = np.int32(15)
    for rb in prange((rows + 3) // 4):
        r0, r1, r2, r3 = rb * 4, min(rb * 4 + 1, last), min(rb * 4 + 2, last), min(rb * 4 + 3, last)
        a0 = np.zeros(16, np.float32)
        a1 = np.zeros(16, np.float32)
        a2 = np.zeros(16, np.float32)
        a3 = np.zeros(16, np.float32)
        for b in range(blocks):
            base = b * 17
            xb = b * 32
            d0, d1 = half * e8m0[raw[r0, base]], half * e8m0[raw[r1, base]]
            d2, d3 = half * e8m0[raw[r2, base]], half * e8m0[raw[r3, base]]
            for j in range(16):
                xl = x[xb + j]
                xh = x[xb + 16 + j]
                q = np.int32(raw[r0, base + 1 + j])
                a0[j] += d0 * (_e2m1_doubled(q & m4) * xl + _e2m1_doubled(q >> np.int32(4)) * xh)
                q = np.int32(raw[r1, base + 1 + j])
                a1[j] += d1 * (_e2m1_doubled(q & m4) * xl + _e2m1_doubled(q >> np.int32(4)) * xh)
                q = np.int32(raw[r2, base + 1 + j])
                a2[j] += d2 * (_e2m1_doubled(q & m4) * xl + _e2m1_doubled(q >> np.int32(4)) * xh)
                q = np.int32(raw[r3, base + 1 + j])
                a3[j] += d3 * (_e2m1_doubled(q & m4) * xl + _e2m1_doubled(q >> np.int32(4)) * xh)
        _store4(out, rb * 4, rows, a0.sum(), a1.sum(), a2.sum(), a3.sum())


@njit(**_OPTS)
def _matvec_int4(codes, params, x, xsum, shift, out):  # pragma: no cover - compiled
    # codes: uint8 [rows, cols / 2]: per group, byte k holds value k (low nibble) and
    # k + group / 2 (high), unsigned 0..15. x comes permuted to the codes' order: for each run of
    # 16 bytes, the 16 values of its low nibbles, then the 16 of its high nibbles.
    # params: uint16 [rows, 2 * groups], bf16 scales then bf16 minimums; xsum: x summed per group.
    # value = code * scale + minimum, so a row is sum_g scale_g (codes . x)_g + minimum_g xsum_g
    rows = codes.shape[0]
    cols = x.shape[0]
    groups = params.shape[1] // 2
    last = rows - 1
    sixteen = np.float32(16.0)
    sixteenth = np.float32(0.0625)
    for rb in prange((rows + 3) // 4):
        r0, r1, r2, r3 = rb * 4, min(rb * 4 + 1, last), min(rb * 4 + 2, last), min(rb * 4 + 3, last)
        a0 = np.zeros(16, np.float32)
        a1 = np.zeros(16, np.float32)
        a2 = np.zeros(16, np.float32)
        a3 = np.zeros(16, np.float32)
        t0 = t1 = t2 = t3 = np.float32(0.0)
        for g in range(groups):
            sg = xsum[g]
            t0 += bf16_value(params[r0, groups + g]) * sg
            t1 += bf16_value(params[r1, groups + g]) * sg
            t2 += bf16_value(params[r2, groups + g]) * sg
            t3 += bf16_value(params[r3, groups + g]) * sg
        for run in range(cols // 32):
            g = run >> shift  # run // (group / 32), without a division in the loop
            d0, d1 = bf16_value(params[r0, g]), bf16_value(params[r1, g])
            d2, d3 = bf16_value(params[r2, g]), bf16_value(params[r3, g])
            xb = run * 32
            cb = run * 16
            for j in range(16):
                xl = x[xb + j]
                xh = x[xb + 16 + j]
                b = np.float32(codes[r0, cb + j])
                h = np.floor(b * sixteenth)
                a0[j] += d0 * ((b - h * sixteen) * xl + h * xh)
                b = np.float32(codes[r1, cb + j])
                h = np.floor(b * sixteenth)
                a1[j] += d1 * ((b - h * sixteen) * xl + h * xh)
                b = np.float32(codes[r2, cb + j])
                h = np.floor(b * sixteenth)
                a2[j] += d2 * ((b - h * sixteen) * xl + h * xh)
                b = np.float32(codes[r3, cb + j])
                h = np.floor(b * sixteenth)
                a3[j] += d3 * ((b - h * sixteen) * xl + h * xh)
        _store4(out, rb * 4, rows, a0.sum() + t0, a1.sum() + t1, a2.sum() + t2, a3.sum() + t3)


@njit(**_OPTS)
def _int8_rows_many(codes, scales, offsets, x, out):  # pragma: no cover - compiled
    # out[e, r] = row r of the int8 matrix at byte ``offsets[e]`` of ``codes`` (rows of cols
    # codes then a float32 scale, scales being the same buffer viewed as float32) dot x[e].
    # One parallel region for the matrices of every selected expert of a layer.
    k, rows = out.shape
    cols = x.shape[1]
    row_bytes = cols + 4
    for i in prange(k * rows):
        e = i // rows
        r = i - e * rows
        base = offsets[e] + r * row_bytes
        row = codes[base: base + cols]  # slices, not offset arithmetic in the loop: it vectorizes
        xe = x[e]
        acc = np.float32(0.0)
        for j in range(cols):
            acc += np.float32(row[j]) * xe[j]
        out[e, r] = acc * scales[(base + cols) // 4]


def experts_token(file: np.ndarray, scheme: str | list[str], gate_up_offsets: np.ndarray, down_offsets: np.ndarray,
                  hidden: int, inter: int, x: np.ndarray, weights: np.ndarray, *, activation: str = "silu",
                  gate_up_bias: np.ndarray | None = None, down_bias: np.ndarray | None = None,
                  limit: float | None = None, alpha: float | None = None) -> np.ndarray:
    """One token through k experts of one layer stored in ``scheme`` (int8; on a VNNI CPU every
    scheme of ``vnni.FUSED``, or a list of one each), weighted by ``weights`` and summed: two
    parallel regions for the whole layer (gate/up of every expert, then down) instead of two per
    expert. Biases are [k, ...]."""
    file, x = read_only(file), writable(np.ascontiguousarray(x, dtype=np.float32))
    k = gate_up_offsets.shape[0]
    if vnni.HAVE_VNNI:
        schemes = (scheme,) * k if isinstance(scheme, str) else tuple(scheme)
        pairs = [expert_schemes(name) for name in schemes]  # an expert's gate/up and down schemes
        gu_schemes, dn_schemes = tuple(p[0].name for p in pairs), tuple(p[1].name for p in pairs)
        if all(rows.kind(name) is not None for name in gu_schemes + dn_schemes):  # one compiled call
            return rows.token(file, gu_schemes, dn_schemes, gate_up_offsets, down_offsets, hidden, inter, x, weights,
                              activation == "swiglu_clamped", 7.0 if limit is None else limit,
                              1.702 if alpha is None else alpha, gate_up_bias, down_bias)
        return _experts_token_rows(file, gu_schemes, dn_schemes, gate_up_offsets, down_offsets, hidden, inter,
                                   x, weights, activation, gate_up_bias, down_bias, limit, alpha)
    if scheme == "int8" and not vnni.HAVE_VNNI:
        xs = np.ascontiguousarray(np.broadcast_to(x.astype(np.float32), (k, hidden)))
        codes, scales = file.view(np.int8), file.view(np.float32)

        def int8_rows(offsets: np.ndarray, n: int, v: np.ndarray) -> np.ndarray:
            out = np.empty((k, n), dtype=np.float32)
            _int8_rows_many(codes, scales, offsets, v, out)
            return out
        h = int8_rows(gate_up_offsets, 2 * inter, xs)
        if gate_up_bias is not None:
            h += gate_up_bias
        a = np.ascontiguousarray(_act(h, inter, activation, limit, alpha), dtype=np.float32)
        y = int8_rows(down_offsets, hidden, a)
        if down_bias is not None:
            y += down_bias
        return _combine(weights, y)
    names = (scheme,) * k if isinstance(scheme, str) else tuple(scheme)
    return _experts_token_rows(file, names, names, gate_up_offsets, down_offsets, hidden, inter, x, weights,
                               activation, gate_up_bias, down_bias, limit, alpha)


def _experts_token_rows(file: np.ndarray, gu_schemes: tuple[str, ...], dn_schemes: tuple[str, ...],
                        gate_up_offsets: np.ndarray, down_offsets: np.ndarray, hidden: int, inter: int,
                        x: np.ndarray, weights: np.ndarray, activation: str, gate_up_bias: np.ndarray | None,
                        down_bias: np.ndarray | None, limit: float | None, alpha: float | None) -> np.ndarray:
    """``experts_token`` through ``rows.experts_rows``: the gate/up matrices of every expert in one
    call, then the down matrices (each in its expert's own scheme)."""
    xs = np.ascontiguousarray(x, dtype=np.float32).reshape(1, hidden)  # quantized once for all k
    h = rows.experts_rows(file, gu_schemes, gate_up_offsets, 2 * inter, xs)
    if gate_up_bias is not None:
        h += gate_up_bias
    a = np.ascontiguousarray(_act(h, inter, activation, limit, alpha), dtype=np.float32)
    y = rows.experts_rows(file, dn_schemes, down_offsets, hidden, a)
    if down_bias is not None:
        y += down_bias
    return _combine(weights, y)


@njit(cache=True, nogil=True)
def _combine(weights, y):  # pragma: no cover - compiled
    # The k experts' outputs [k, hidden] weighted and summed; compiled (numpy took 21-34 us a
    # layer at Qwen3-30B-A3B's shape, this 10-15), and its own function: the MoE layer benchmark
    # times it.
    out = np.zeros(y.shape[1], dtype=np.float32)
    for e in range(y.shape[0]):
        w = weights[e]
        for j in range(y.shape[1]):
            out[j] += w * y[e, j]
    return out


def int8_row_scales(raw: np.ndarray, cols: int) -> np.ndarray:
    """The float32 scale at the end of each int8 row, gathered into one contiguous array. It
    reads a cache line per row (2.4 ms for a 150k-row lm_head here), so callers that multiply
    by the same matrix again keep it (``linear``'s ``scales``): the kernel reading the scales in
    place through a strided view ran slower than with them contiguous (14.1 against 11.0 ms)."""
    return np.ascontiguousarray(raw[:, cols:cols + 4]).view(np.float32).reshape(raw.shape[0])


def matvec(raw: np.ndarray, scheme: str, x: np.ndarray, out: np.ndarray | None = None,
           scales: np.ndarray | None = None) -> np.ndarray:
    """``W @ x`` for a weight stored in ``scheme`` as raw rows ``[rows, row_bytes]`` (uint8; or
    the plain dtype for f32/f16/bf16), ``x`` float32 of the row length. Returns float32 [rows].
    ``scales``: an int8 matrix's row scales (``int8_row_scales``), when the caller keeps them."""
    x = writable(np.ascontiguousarray(x, dtype=np.float32))
    out = np.empty(raw.shape[0], dtype=np.float32) if out is None else out
    result = cpu_kernels(scheme).matvec(read_only(raw), x, out, scales)
    return out if result is None else result


def _matvec_plain_f32(raw, x, out, scales):  # type: ignore[no-untyped-def]
    _matvec_f32(raw.view(np.float32).reshape(raw.shape[0], x.shape[0]), x, out)


def _matvec_plain_bf16(raw, x, out, scales):  # type: ignore[no-untyped-def]
    _matvec_bf16(raw.view(np.uint16).reshape(raw.shape[0], x.shape[0]), x, out)


def _matvec_plain_f16(raw, x, out, scales):  # type: ignore[no-untyped-def]
    _matvec_f16(raw.view(np.uint16).reshape(raw.shape[0], x.shape[0]), x, _F16_TO_F32, out)


def _matvec_int8_rows(raw, x, out, scales):  # type: ignore[no-untyped-def]
    cols = x.shape[0]
    if vnni.HAVE_VNNI and raw.flags.c_contiguous and raw.dtype == np.uint8 and cols % 32 == 0:
        # vpdpbusd on int8-quantized activations (per 32 values): 31 against 24 GB/s for a
        # 151936 x 2048 lm_head here, 45 against 36 in cache for a 2048 x 768 expert matrix.
        return vnni.matvec_blocks(raw, "int8", x, out)
    codes = raw[:, :cols].view(np.int8)
    scales = int8_row_scales(raw, cols) if scales is None else scales
    # One row at a time while x stays in L1 (it then runs at the read bandwidth here);
    # four when x is long enough that re-reading it per row costs more than the row.
    (_matvec_int8 if cols <= 8192 else _matvec_int8_4rows)(codes, scales, x, out)
    return out


def _matvec_ggml(name: str, fallback):  # type: ignore[no-untyped-def]
    """q8_0, q4_0 and mxfp4 through VNNI where the CPU has it (q8_0: lm_head and attention 27.7
    against 15.7 GB/s at 151936 x 2048 here; since its rows prefetch ahead, long rows too: 30.4
    against 23.7 GB/s at Mixtral's 4096 x 14336 down projection, medians of 15 interleaved
    rounds), else the float kernel ``fallback(raw, x, out)``."""

    def run(raw, x, out, scales):  # type: ignore[no-untyped-def]
        if vnni.HAVE_VNNI and raw.flags.c_contiguous:
            return vnni.matvec_blocks(raw, name, x, out)
        fallback(raw, x, out)
        return out

    return run


def _matvec_int4_rows(group: int):  # type: ignore[no-untyped-def]
    def run(raw, x, out, scales):  # type: ignore[no-untyped-def]
        if vnni.HAVE_VNNI and raw.flags.c_contiguous:
            return vnni.matvec_int4(raw, x, group, out)
        cols = x.shape[0]
        codes = raw[:, : cols // 2]
        params = raw[:, cols // 2:].view(np.uint16)  # rows are 2-byte aligned: no copy
        xsum = x.reshape(cols // group, group).sum(axis=1)
        runs_x = x.reshape(cols // group, 2, group // 32, 16).transpose(0, 2, 1, 3).reshape(-1)
        _matvec_int4(codes, params, np.ascontiguousarray(runs_x), xsum, {32: 0, 64: 1, 128: 2}[group], out)
        return out

    return run


ACT_PARALLEL_VALUES = 1 << 16  # gate/up values from which ``_act`` runs compiled on every thread


def _act(h: np.ndarray, inter: int, activation: str, limit: float | None, alpha: float | None) -> np.ndarray:
    """SiLU(gate) * up, or gpt-oss's clamped SwiGLU, of gate/up products h [..., 2 * inter]. Many
    tokens' (a batched expert's) go compiled on every thread (``_activate_rows``, the exponential
    ``vnni._exp2_neg``'s): numpy's passes and the copy after them took 4.2 ms at 256 x 28,672
    values, the compiled loop 1.2."""
    if vnni._COMPILED and h.size >= ACT_PARALLEL_VALUES and h.dtype == np.float32 and h.shape[-1] == 2 * inter:
        rows_ = np.ascontiguousarray(h).reshape(-1, 2 * inter)
        out = _activate_rows(rows_, inter, activation == "swiglu_clamped", np.float32(7.0 if limit is None else limit),
                             np.float32(1.702 if alpha is None else alpha))
        return out.reshape(h.shape[:-1] + (inter,))
    gate, up = h[..., :inter], h[..., inter:]
    if activation == "swiglu_clamped":  # gpt-oss
        lim = np.float32(limit if limit is not None else 7.0)
        a = np.float32(alpha if alpha is not None else 1.702)
        gate = np.minimum(gate, lim)
        up = np.clip(up, -lim, lim)
        return (up + 1) * (gate / (1 + np.exp(-a * gate)))
    return gate / (1 + np.exp(-gate)) * up  # SiLU(gate) * up


@njit(cache=True, nogil=True, parallel=True, fastmath=True, error_model="numpy")
def _activate_rows(h, inter, clamped, limit, alpha):  # pragma: no cover - compiled
    # ``_act`` of rows h [n, 2 * inter], a row a work item, each loop without branches (LLVM's
    # vectors; numpy's error model: no zero-divisor checks, 1 + exp(-g) is never zero).
    out = np.empty((h.shape[0], inter), np.float32)
    slope = vnni.LOG2E_NEG * (alpha if clamped else np.float32(1.0))
    for t in prange(h.shape[0]):
        gate, up, row = h[t, :inter], h[t, inter:], out[t]
        if clamped:
            for j in range(inter):
                row[j] = vnni.clamped_swiglu(gate[j], up[j], limit, slope)
        else:
            for j in range(inter):
                row[j] = vnni.silu_times(gate[j], up[j], slope)
    return out


def expert_forward(gate_up: np.ndarray, down: np.ndarray, scheme: str, x: np.ndarray, *,
                   activation: str = "silu", gate_up_bias: np.ndarray | None = None,
                   down_bias: np.ndarray | None = None, limit: float | None = None,
                   alpha: float | None = None) -> np.ndarray:
    """One token through one expert: ``down(act(gate x + b) * (up x + b)) + b`` (float32 [hidden]).
    ``scheme``: an expert scheme (one scheme, or ``gate_up+down``)."""
    inter = gate_up.shape[0] // 2
    scheme, down_scheme = (s.name for s in expert_schemes(scheme))
    h = matvec(gate_up, scheme, x)
    if gate_up_bias is not None:
        h += gate_up_bias
    a = _act(h, inter, activation, limit, alpha).astype(np.float32)
    y = matvec(down, down_scheme, a)
    if down_bias is not None:
        y += down_bias
    return y


def expert_forward_batch(gate_up: np.ndarray, down: np.ndarray, scheme: str, x: np.ndarray, *,
                         activation: str = "silu", gate_up_bias: np.ndarray | None = None,
                         down_bias: np.ndarray | None = None, limit: float | None = None,
                         alpha: float | None = None, interleaved: tuple[bool, bool] = (False, False)) -> np.ndarray:
    """Tokens ``x`` [T, hidden] routed to one expert, each product through ``linear``; where both
    products go to ``lanes.matmul``, gate/up's by row, its activation quantized for down 16 tokens
    at a time (``lanes.activated``). ``interleaved``: gate/up's and down's rows are q4_k
    copies (``interleave.repack``), which only ``lanes`` reads: the caller sends them with a SiLU
    and ``interleave.K_LANES_MIN_TOKENS`` tokens or more."""
    x = np.asarray(x, dtype=np.float32)
    inter = gate_up.shape[0] // 2
    scheme, down_scheme = (s.name for s in expert_schemes(scheme))
    n = x.shape[0]
    if any(interleaved) and activation not in ("silu", "swiglu_clamped"):
        raise ValueError(f"interleaved rows go through lanes' products, which take a SiLU, not {activation}")
    if activation in ("silu", "swiglu_clamped") and (any(interleaved) or (
            _by_lanes(gate_up, scheme, n, x.shape[1]) and _by_lanes(down, down_scheme, n, inter))):
        padded = -(-n // lanes.LANE_TOKENS) * lanes.LANE_TOKENS  # gate/up's sums by row: this call's alone
        h_rows = lanes.scratch("h_rows", gate_up.shape[0] * padded, np.float32).reshape(gate_up.shape[0], padded)
        lanes.matmul(x, gate_up, scheme, by_row=True, out=h_rows, interleaved=interleaved[0])
        quantized = lanes.activated(h_rows, n, inter, down_scheme, activation == "swiglu_clamped",
                                    7.0 if limit is None else limit, 1.702 if alpha is None else alpha, gate_up_bias)
        y = lanes.product(quantized, n, inter, down, down_scheme, interleaved=interleaved[1])
        if down_bias is not None:
            y += down_bias
        return y
    h = linear(x, gate_up, scheme)
    if gate_up_bias is not None:
        h += gate_up_bias
    a = _act(h, inter, activation, limit, alpha).astype(np.float32)
    y = linear(a, down, down_scheme)
    if down_bias is not None:
        y += down_bias
    return y


def _by_lanes(raw: np.ndarray, scheme: str, n: int, cols: int) -> bool:
    """Whether ``linear`` sends n tokens times ``raw`` to ``lanes.matmul`` (``in_place``)."""
    kernels = cpu_kernels(scheme)
    return (kernels.in_place is not None and raw.dtype == np.uint8 and raw.flags.c_contiguous
            and kernels.in_place[0](scheme, cols) and lanes.fits(scheme, cols)
            and LANES_MIN_TOKENS[scheme] <= n < LANES_MAX_TOKENS.get(scheme, n + 1)
            and not (amx.fits(scheme, cols) and n >= AMX_MIN_TOKENS[scheme]))


def interleaved_linear(x: np.ndarray, packed: np.ndarray, scheme: str) -> np.ndarray:
    """``x @ W.T`` (float32 [T, rows]) for tokens ``x`` [T, cols] and a matrix's interleaved copy
    ``packed`` (``interleave.repack``): ``interleave.matmul``'s tiles, but q4_k's copies from
    ``interleave.K_LANES_MIN_TOKENS`` tokens on through the stored layout's lanes, each chunk of
    rows put back in the stored layout in the worker's buffer first (``lanes.matmul``)."""
    if scheme in interleave.K_SCHEMES and x.shape[0] >= interleave.K_LANES_MIN_TOKENS:
        return lanes.matmul(writable(np.ascontiguousarray(x, dtype=np.float32)), packed, scheme, interleaved=True)
    return interleave.matmul(x, packed, scheme)


def linear(x: np.ndarray, raw: np.ndarray, scheme: str, scales: np.ndarray | None = None) -> np.ndarray:
    """``x @ W.T`` (float32 [T, rows]) for tokens ``x`` [T, cols] and a weight stored in
    ``scheme`` as raw rows (uint8 [rows, row_bytes], or the plain dtype for f32/f16/bf16).

    One token reads the weights once through the matrix-vector kernels (memory-bound). The block
    kinds (q8_0, q4_0, mxfp4, iq4_nl), q4_k, q5_k, q6_k, iq4_xs and int4 on a VNNI CPU multiply
    two tokens or more in place, in int8 (``CpuKernels.in_place``: row tiles, then from
    ``LANES_MIN_TOKENS`` 16 tokens a vector; through AMX from ``AMX_MIN_TOKENS`` on a CPU
    with it); so does int8 from ``LANES_MIN_TOKENS`` up to ``LANES_MAX_TOKENS`` on a VNNI CPU
    without AMX. Otherwise from ``GEMM_MIN_TOKENS`` tokens on the weights are used as a matrix
    (compute-bound): int8 multiplies in int8 (torch._int_mm, or AMX from ``AMX_INT8_MIN_TOKENS``
    where the CPU has it), bf16 and the other quantized schemes in bf16 (decoded first, in tiles;
    each adds well under 1% relative error), f32 and f16 in float32. Between the two, quantized
    weights go token by token through the one-token kernels (decoding a large matrix costs more
    than a few passes over its bytes). ``scales`` as for ``matvec``."""
    x, raw = writable(np.ascontiguousarray(x, dtype=np.float32)), read_only(raw)
    if x.shape[0] == 1:
        return matvec(raw, scheme, x[0], scales=scales)[None, :]
    kernels = cpu_kernels(scheme)
    if (kernels.in_place is not None and raw.dtype == np.uint8 and raw.flags.c_contiguous
            and kernels.in_place[0](scheme, x.shape[1])):
        return kernels.in_place[1](x, raw, scheme)
    if kernels.stepwise and x.shape[0] < GEMM_MIN_TOKENS:
        if scheme == "int8" and x.shape[0] >= AMX_INT8_MIN_TOKENS and amx.int8_fits(x.shape[1]):
            return _int8_gemm(x, raw, scales)
        return stepwise(x, raw, scheme, scales)
    return kernels.batched(x, raw, scheme, scales)


def stepwise(x: np.ndarray, raw: np.ndarray, scheme: str, scales: np.ndarray | None = None) -> np.ndarray:
    """``x @ W.T`` token by token through the one-token kernel."""
    return np.stack([matvec(raw, scheme, row, scales=scales) for row in x])


def matmul_t(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b.T`` in float32, through torch when it is installed: numpy's OpenBLAS threads and
    Numba's OpenMP threads spin against each other when their parallel regions alternate (a
    4-token expert took 17 ms instead of 0.5 here); torch's and Numba's do not. One row of ``a``
    (a decode step) goes to the Numba kernel instead: the experts' threads are awake, where
    torch's had gone to sleep (a Qwen3-30B-A3B router right after the experts' kernels: 80 us
    through torch, 48 through Numba, medians of 100 interleaved tokens)."""
    if a.ndim == 2 and a.shape[0] == 1 and b.dtype == np.float32 and b.flags.c_contiguous:
        out = np.empty((1, b.shape[0]), dtype=np.float32)
        _matvec_f32(read_only(b), writable(np.ascontiguousarray(a[0], dtype=np.float32)), out[0])
        return out
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is installed wherever the tests run
        return a @ b.T
    return (torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
            @ torch.from_numpy(np.ascontiguousarray(b, dtype=np.float32)).T).numpy()


# Weights come from read-only maps of the bundle; torch only reads them in the runtime's modules.
# One filter for them (catch_warnings around each call costs time and is not thread-safe, and
# the CPU experts run in a thread of their own).
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning,
                        module=r"ktc\.runtime\.")


# From this many tokens on, int8 experts multiply in int8 (torch._int_mm, oneDNN's VNNI GEMM):
# each token's activations are quantized to int8 with one scale (as llama.cpp does), which adds
# about 0.5% relative error, and the weights are used in place, without decoding. Block schemes
# are decoded to bf16 and multiplied by torch (oneDNN, AMX where the CPU has it): 3x faster than
# float32 here, for a rounding of 2^-9 relative per weight.
GEMM_MIN_TOKENS = 16


def _int8_gemm(x: np.ndarray, raw: np.ndarray, w_scale: np.ndarray | None = None) -> np.ndarray:
    """``x @ W.T`` for int8 rows ``raw`` [rows, cols + 4] (codes, then a float32 scale): through
    AMX where the CPU has it (``amx.int8_matmul``, the same products: at Mixtral-8x7B's gate/up,
    28672 x 4096, 3.4 / 6.8 / 26.7 ms at 16 / 64 / 256 tokens against torch's int8 GEMM's 7.9 /
    14.0 / 48.8; its down, 4096 x 14336, 1.5 / 3.6 / 20.1 against 2.7 / 5.2 / 28.6), else
    torch's int8 GEMM."""
    import torch

    cols = x.shape[1]
    w_scale = int8_row_scales(raw, cols) if w_scale is None else w_scale
    if amx.int8_fits(cols) and raw.flags.c_contiguous:
        return amx.int8_matmul(x, raw, w_scale)
    xq, x_scale = amx.int8_tokens(x)
    codes = torch.from_numpy(raw[:, :cols].view(np.int8))  # strided rows: no copy
    acc = torch._int_mm(torch.from_numpy(xq), codes.t()).numpy()
    return acc.astype(np.float32) * x_scale[:, None] * w_scale[None, :]


# int8 products of this many tokens or more go through AMX (``amx.int8_matmul``) where the CPU has
# it, fewer token by token. stepwise/amx time (medians of 7 interleaved rounds, two threads) at 2 /
# 4 / 8 / 12 tokens: Qwen3-30B-A3B's gate/up (1536 x 2048) 0.90 / 1.90 / 3.43 / 4.31, its down
# (2048 x 768) 1.05 / 1.57 / 3.22 / 4.39, Mixtral's gate/up (28672 x 4096) 1.55 / 2.76 / 5.49 / 8.25.
AMX_INT8_MIN_TOKENS = 4


# Bytes of bf16 weights decoded at a time by the batched path: each tile is multiplied while it is
# in L3, and its buffer comes back from the allocator without new pages (glibc serves blocks
# under its dynamic mmap threshold, at most 32 MB, from the heap it keeps). A whole Mixtral
# gate/up matrix decoded at once (235 MB) was mapped afresh on every call, its page faults most
# of the time at 64 tokens (a q8_0 expert: 154 ms against torch's 37 for the same product); whole
# experts at 32 and 128 tokens took 44-64 and 87-103 ms in 16 MB tiles against 50-70 and 113 ms
# decoded whole (4 MB tiles: one GEMM call per 512 rows, slower at 128 tokens).
DECODE_TILE_BYTES = 16 << 20


def _bf16_gemm(x: np.ndarray, raw: np.ndarray, scheme: str, scales: np.ndarray | None = None) -> np.ndarray:
    """``x @ W.T`` with ``W`` decoded to bf16 (``DECODE_TILE_BYTES`` of rows at a time; bf16
    weights used in place: their decode is a view) and ``x`` rounded to bf16, accumulated in
    float32."""
    import torch

    rows, cols = raw.shape[0], x.shape[1]
    xt = torch.from_numpy(x).to(torch.bfloat16)
    if scheme == "bf16":
        w = torch.from_numpy(decode(raw, scheme, cols, bf16=True)).view(torch.bfloat16)
        return (xt @ w.T).float().numpy()
    out = np.empty((x.shape[0], rows), dtype=np.float32)
    step = max(16, DECODE_TILE_BYTES // (2 * cols) // 16 * 16)
    for first in range(0, rows, step):
        last = min(rows, first + step)
        w = torch.from_numpy(decode(raw[first:last], scheme, cols, bf16=True)).view(torch.bfloat16)
        out[:, first:last] = (xt @ w.T).float().numpy()
    return out


# Several tokens of the block kinds (q8_0, q4_0, mxfp4, iq4_nl) and of q4_k, q5_k, q6_k and iq4_xs
# are multiplied in place, without decoding the matrix: from this many tokens on by lanes.matmul (16
# tokens a vector, the codes unpacked a chunk of rows at a time), below it by the row tiles
# (vnni.matmul_blocks, kquants.matmul_k: 2 tokens x 4 or 8 rows, no unpacking), which read the
# matrix once at about the one-token kernels' speed. Measured at Mixtral's 14336 x 4096 (ms,
# medians of 9 interleaved rounds, lanes/tiles): q8_0 2.64/2.48 at 4 tokens, 2.82/3.80 at 8;
# q4_0 3.15/2.72 at 8, 3.51/3.50 at 12; mxfp4 3.20/3.26 at 8, 2.71/4.98 at 12; iq4_nl
# 2.85/2.55 at 8, 2.58/3.10 at 12; q4_k 3.33/2.62 at 8, 3.42/3.87 at 12; q5_k 4.16/3.16 at 8,
# 3.36/4.31 at 12; q6_k 4.24/4.14 at 8, 3.87/4.77 at 12. iq4_xs has no tiles: below 4 tokens
# the one-token kernel token by token (lanes/stepwise 6.32/3.53 at 2, 6.47/6.99 at 4; its
# scales' unpacking is scalar code, about twice the others' fixed cost). lanes.matmul ran
# 1.06-1.65x torch's bf16 GEMM on the weights already decoded at 64 and 256 tokens
# (``benchmarks/expert_kernels.py``), so these schemes never take the decode-to-bf16 path where they
# fit.
LANES_MIN_TOKENS = {"q8_0": 8, "q4_0": 12, "mxfp4": 12, "iq4_nl": 12, "q4_k": 12, "q5_k": 12, "q6_k": 12,
                    "iq4_xs": 4, "int4_g32": 5, "int4_g64": 5, "int4_g128": 5, "int8": 4}
# int8 (on a CPU without AMX) from this many tokens on goes back to torch's int8 GEMM
# (``_int8_gemm``, activations one scale a token). With the span's blocks in a loop instead of
# unrolled (``lanes._blocks_of``) the lanes are ahead at every count measured: whole
# Mixtral-shaped experts, lanes against the GEMM (medians of 5, Zen 5, two threads), 192 tokens
# 45.3 / 59.7 ms, 256 57.2 / 71.5, 384 85.8 / 122.8, 512 117.4 / 151.7, 1024 252.1 / 307.7, 2048
# 555.7 / 625.6 (medians of 3); not measured past that (the GEMM kept from 4096). At
# Qwen3-30B-A3B's shape (2048 x 768, medians of 15) 128 tokens 1.02 / 1.17 ms, 192 1.45 / 1.64, 256
# 1.92 / 2.11, 512 4.57 / 4.62. Before
# (unrolled spans), whole
# experts, lanes against the GEMM (medians of 7, two runs each, Zen 5, two threads): 16 tokens
# 7.0 / 12.6 ms, 64 18.2 / 22.1-23.2, 128 34.7-36.4 / 36.9-37.7, 192 51.9-52.5 / 50.8-58.1, 256
# 66.9-69.1 / 63.1-65.8. One product, GEMM time over the lanes' (medians of 9, two runs): Mixtral's
# gate/up (28672 x 4096) 1.26-1.33 at 3 tokens, 0.79-1.25 at 4, 0.84-1.28 at 6, 0.91-1.45 at 8,
# 1.34-1.50 at 12-16; at Qwen3-30B-A3B's shapes the two are level within noise from 16 tokens (gate/up
# 1536 x 2048 0.94-1.28, down 2048 x 768 0.77-1.10 at 16-64) and the GEMM is ahead at 6-12 tokens
# (0.72-1.04, 0.74-0.91) and 128 (0.87-0.91, 0.67-0.89). Token by token (the one-token kernel)
# against the lanes: 0.93-1.26 at 3 tokens, 1.12-1.68 at 4, 1.85-3.09 at 8.
LANES_MAX_TOKENS = {"int8": 4096}
# On a CPU with AMX (``amx.HAVE_AMX``) these schemes' products of this many tokens or more decode
# the rows to bf16 a chunk at a time and multiply through AMX (``amx.matmul``). The decoding costs
# the same whatever the tokens, so below this lanes.matmul is faster. lanes/amx time (medians of 7
# interleaved rounds, two threads, an Intel Xeon VM) at 12 / 16 / 17 / 24 / 64 / 128 tokens, on
# Qwen3-30B-A3B's gate/up (1536 x 2048), its down (2048 x 768) and Mixtral's down (4096 x 14336):
# q4_0 1.05 / 1.03 / 1.25 / 1.29 / 1.34 / 1.66, 1.01 / 1.15 / 1.26 / 1.27 / 1.54 / 1.42, 1.14 /
# 1.15 / 1.40 / 1.23 / 1.46 / 1.78; q8_0 1.00-1.05 at 12, 1.04-1.15 at 16, 1.21-1.28 at 17 (17 to
# 32 tokens take two 16-token tiles, 16 or fewer one); the K-quants and iq4_xs, whose rows are
# unpacked then converted (the block kinds' in one pass), 0.76-1.03 at 16, 0.97-1.21 at 17,
# 0.98-1.20 at 24 (q4_k, q6_k, iq4_xs; ``docs/runtime.md``). int4 (unpacked, then converted),
# lanes/amx at 24 / 32 / 48 / 64 tokens, medians of 5-7: Mixtral's gate/up (14336 x 4096) g128
# 0.86 / 0.91-0.99 / 1.01 / 1.27, g32 0.94 / 0.98-1.01 / 1.04 / 1.03; Qwen3-30B-A3B's gate/up
# (1536 x 2048) g128 1.09 / 1.18 / 1.20, g32 0.98 / 1.07 / 1.07; its down (2048 x 768) g128 0.88 /
# 0.93 / 1.00, g32 1.08 / 1.04 / 1.12.
# fp8_e4m3 has no VNNI path (its values are no integers): from 3 tokens AMX, below them its one-token
# kernel token by token (stepwise/amx at Mixtral's gate/up 0.98 at 2 tokens, 1.53 at 3, 2.06 at 4;
# Qwen3-30B-A3B's 0.76, 1.00, 1.24), where 16 tokens or more decoded the matrix to bf16 for torch's
# GEMM (at Mixtral's gate/up 42 ms at 16 tokens, 48 at 64, 63 at 256, against AMX's 4.9, 10.2, 29.2).
AMX_MIN_TOKENS = {"q8_0": 16, "q4_0": 16, "mxfp4": 16, "iq4_nl": 16, "q4_k": 24, "q5_k": 24, "q6_k": 24,
                  "iq4_xs": 24, "int4_g32": 32, "int4_g64": 32, "int4_g128": 32, "fp8_e4m3": 3}


def in_place(tiles_fit: Callable[[str, int], bool], tiles: Callable[..., np.ndarray]) -> tuple[
        Callable[[str, int], bool], Callable[..., np.ndarray]]:
    """``CpuKernels.in_place`` for a scheme whose row tiles are ``tiles`` (``tiles_fit``;
    iq4_xs, int4 and fp8_e4m3 have none and pass ``stepwise``): the tiles below
    ``LANES_MIN_TOKENS``, ``lanes.matmul`` from there on and wherever the tiles do not fit (the
    schemes of ``lanes.KINDS``), and ``amx.matmul`` from ``AMX_MIN_TOKENS`` on a CPU with AMX."""

    def fits(scheme: str, cols: int) -> bool:
        return lanes.fits(scheme, cols) or tiles_fit(scheme, cols)

    def multiply(x: np.ndarray, raw: np.ndarray, scheme: str) -> np.ndarray:
        cols = x.shape[1]
        if amx.fits(scheme, cols) and x.shape[0] >= AMX_MIN_TOKENS[scheme]:
            return amx.matmul(x, raw, scheme)
        if lanes.fits(scheme, cols) and (x.shape[0] >= LANES_MIN_TOKENS[scheme] or not tiles_fit(scheme, cols)):
            return lanes.matmul(x, raw, scheme)
        return tiles(x, raw, scheme)

    return fits, multiply


def _f32_gemm(x: np.ndarray, raw: np.ndarray, scheme: str, scales: np.ndarray | None = None) -> np.ndarray:
    return matmul_t(x, decode(raw, scheme, x.shape[1]))


def decode(raw: np.ndarray, scheme: str, cols: int, bf16: bool = False, serial: bool = False) -> np.ndarray:
    """The values [rows, cols] of a matrix stored as ``raw`` rows in ``scheme``, decoded in
    parallel (with ``serial`` on the calling thread alone): float32, or with ``bf16`` their bf16
    bit patterns (uint16, rounded to nearest even). The same values as
    ``ktc.formats.quantize.dequantize``."""
    return cpu_kernels(scheme).decode(read_only(raw), cols, bf16, serial)


def _decode_plain(dtype: type):  # type: ignore[no-untyped-def]
    def run(raw, cols, bf16, serial):  # type: ignore[no-untyped-def]
        values = raw.view(dtype).reshape(raw.shape[0], cols)
        if dtype is np.uint16:  # bf16
            return np.ascontiguousarray(values) if bf16 else (values.astype(np.uint32) << 16).view(np.float32)
        values = values.astype(np.float32, copy=False)
        return f32_to_bf16_bits(values) if bf16 else values

    return run


def block_decoder(kernel, *tables):  # type: ignore[no-untyped-def]
    """A table ``decode`` from a Numba decoder ``kernel(raw, cols, *tables, bf16, out32, out16)``
    that writes float32 values (``out32``) or bf16 bits (``out16``); with ``serial`` its twin
    that runs on the calling thread."""
    serial_kernel = _one_thread(kernel)

    def run(raw, cols, bf16, serial):  # type: ignore[no-untyped-def]
        rows = raw.shape[0]
        raw = raw if raw.dtype == np.uint8 else raw.view(np.uint8).reshape(rows, -1)
        out32 = np.empty((rows, cols) if not bf16 else (0, cols), dtype=np.float32)
        out16 = np.empty((rows, cols) if bf16 else (0, cols), dtype=np.uint16)
        (serial_kernel if serial else kernel)(raw, cols, *tables, bf16, out32, out16)
        return out16 if bf16 else out32

    return run


@functools.cache
def _one_thread(kernel):  # type: ignore[no-untyped-def]
    """A twin of a parallel decoder that runs on the calling thread (its prange a range), cached
    under a name of its own (Numba's cache tells functions apart by name, not by flags). For a
    decode step's one embedding row: a parallel region there woke the kernels' threads (0.6 ms),
    and gguf's numpy decoding, among the step's streaming weights, took about 0.2 ms."""
    py = getattr(kernel, "py_func", kernel)  # the function itself with NUMBA_DISABLE_JIT=1
    twin = types.FunctionType(py.__code__, py.__globals__, py.__name__ + "_one_thread", py.__defaults__,
                              py.__closure__)
    twin.__qualname__ = py.__qualname__ + "_one_thread"
    return njit(cache=True, nogil=True, fastmath=True)(twin)


@njit(**_OPTS)
def _decode_int8(raw, cols, bf16, out32, out16):  # pragma: no cover - compiled
    for r in prange(raw.shape[0]):
        scale = raw[r, cols:cols + 4].copy().view(np.float32)[0]
        for j in range(cols):
            put_decoded(bf16, out32, out16, r, j, np.float32(np.int8(raw[r, j])) * scale)


@njit(**_OPTS)
def _decode_q8_0(raw, cols, table, bf16, out32, out16):  # pragma: no cover - compiled
    for r in prange(raw.shape[0]):
        for b in range(cols // 32):
            d = _half(raw, r, b * 34, table)
            for j in range(32):
                put_decoded(bf16, out32, out16, r, b * 32 + j, d * np.float32(np.int8(raw[r, b * 34 + 2 + j])))


@njit(**_OPTS)
def _decode_q4_0(raw, cols, table, bf16, out32, out16):  # pragma: no cover - compiled
    for r in prange(raw.shape[0]):
        for b in range(cols // 32):
            d = _half(raw, r, b * 18, table)
            for j in range(16):
                c = np.int32(raw[r, b * 18 + 2 + j])
                put_decoded(bf16, out32, out16, r, b * 32 + j, d * np.float32((c & 15) - 8))
                put_decoded(bf16, out32, out16, r, b * 32 + 16 + j, d * np.float32((c >> 4) - 8))


@njit(**_OPTS)
def _decode_mxfp4(raw, cols, fp4, e8m0, bf16, out32, out16):  # pragma: no cover - compiled
    for r in prange(raw.shape[0]):
        for b in range(cols // 32):
            d = e8m0[raw[r, b * 17]]
            for j in range(16):
                c = np.int32(raw[r, b * 17 + 1 + j])
                put_decoded(bf16, out32, out16, r, b * 32 + j, fp4[c & 15] * d)
                put_decoded(bf16, out32, out16, r, b * 32 + 16 + j, fp4[c >> 4] * d)


@njit(**_OPTS)
def _decode_int4(raw, cols, group, bf16, out32, out16):  # pragma: no cover - compiled
    groups = cols // group
    half = group // 2
    for r in prange(raw.shape[0]):
        params = raw[r, cols // 2:].copy().view(np.uint16)
        for g in range(groups):
            d = bf16_value(params[g])
            m = bf16_value(params[groups + g])
            for k in range(half):
                c = np.int32(raw[r, g * half + k])
                put_decoded(bf16, out32, out16, r, g * group + k, np.float32(c & 15) * d + m)
                put_decoded(bf16, out32, out16, r, g * group + half + k, np.float32(c >> 4) * d + m)


@dataclass(frozen=True)
class CpuKernels:
    """A scheme's CPU kernels. ``matvec(raw, x, out, scales)``: one token, ``W @ x`` into
    ``out`` (returning it). ``decode(raw, cols, bf16, serial)``: the matrix's values, float32 or
    bf16 bits. ``batched(x, raw, scheme, scales)``: ``x @ W.T`` for ``GEMM_MIN_TOKENS`` tokens
    or more (decoded to bf16 and multiplied by torch, unless the scheme has better); with
    ``stepwise`` fewer tokens than that go through ``matvec`` one by one (a quantized matrix costs
    more to decode than a few passes over its bytes), else straight to ``batched``.
    ``in_place``: (fits(scheme, cols), multiply(x, raw, scheme)) where the scheme has kernels
    that multiply two tokens or more without decoding (``linear`` takes them for matrices they
    fit; ``in_place`` builds the pair)."""

    matvec: Callable[..., np.ndarray]
    decode: Callable[..., np.ndarray]
    batched: Callable[..., np.ndarray] = _bf16_gemm
    stepwise: bool = True
    in_place: tuple[Callable[[str, int], bool], Callable[..., np.ndarray]] | None = None


# Keyed by the registry's scheme names (``ktc.formats.schemes``); a test checks every scheme the
# registry says runs on the CPU has an entry.
CPU_KERNELS: dict[str, CpuKernels] = {}


def register_cpu(name: str, kernels: CpuKernels) -> None:
    CPU_KERNELS[name] = kernels


def cpu_kernels(scheme: str) -> CpuKernels:
    try:
        return CPU_KERNELS[scheme]
    except KeyError:
        raise ValueError(f"no CPU kernel for scheme {scheme!r}") from None


register_cpu("f32", CpuKernels(_matvec_plain_f32, _decode_plain(np.float32),
                               lambda x, raw, scheme, scales: matmul_t(x, raw.view(np.float32).reshape(
                                   raw.shape[0], x.shape[1])), stepwise=False))
register_cpu("f16", CpuKernels(_matvec_plain_f16, _decode_plain(np.float16), _f32_gemm, stepwise=False))
register_cpu("bf16", CpuKernels(_matvec_plain_bf16, _decode_plain(np.uint16)))


def _int8_in_place(x: np.ndarray, raw: np.ndarray, scheme: str) -> np.ndarray:
    """int8 on a VNNI CPU without AMX (``in_place``'s multiply): below LANES_MIN_TOKENS token by
    token, then the lanes (activations per 256 values, integer sums over them), from
    LANES_MAX_TOKENS torch's int8 GEMM; with AMX, or where the lanes do not fit, ``linear``
    never comes here (``_int8_gemm``)."""
    n = x.shape[0]
    if n < LANES_MIN_TOKENS[scheme]:
        return stepwise(x, raw, scheme)
    if n < LANES_MAX_TOKENS[scheme]:
        return lanes.matmul(x, raw, scheme)
    return _int8_gemm(x, raw)


register_cpu("int8", CpuKernels(_matvec_int8_rows, block_decoder(_decode_int8),
                                lambda x, raw, scheme, scales: _int8_gemm(x, raw, scales),
                                in_place=(lambda scheme, cols: lanes.fits(scheme, cols) and not amx.int8_fits(cols),
                                          _int8_in_place)))
def _blocks_fit(scheme: str, cols: int) -> bool:
    return vnni.batched_fits(scheme, cols)


def _blocks_multiply(x: np.ndarray, raw: np.ndarray, scheme: str) -> np.ndarray:
    return vnni.matmul_blocks(x, raw, scheme)


_BLOCKS_IN_PLACE = in_place(_blocks_fit, _blocks_multiply)
register_cpu("q8_0", CpuKernels(_matvec_ggml("q8_0", lambda raw, x, out: _matvec_q8_0(raw, x, _F16_TO_F32, out)),
                                block_decoder(_decode_q8_0, _F16_TO_F32), in_place=_BLOCKS_IN_PLACE))
register_cpu("q4_0", CpuKernels(_matvec_ggml("q4_0", lambda raw, x, out: _matvec_q4_0(
    raw, x, x.reshape(-1, 32).sum(axis=1), _F16_TO_F32, out)), block_decoder(_decode_q4_0, _F16_TO_F32),
    in_place=_BLOCKS_IN_PLACE))
register_cpu("mxfp4", CpuKernels(_matvec_ggml("mxfp4", lambda raw, x, out: _matvec_mxfp4(raw, x, _E8M0, out)),
                                 block_decoder(_decode_mxfp4, _FP4, _E8M0), in_place=_BLOCKS_IN_PLACE))
# int4 has no row tiles for a few tokens: below LANES_MIN_TOKENS its one-token kernel token by
# token (on a VNNI CPU; elsewhere ``linear``'s usual paths). stepwise/lanes time at 4 / 5 / 6 / 8
# tokens (medians of 5-7, two threads): Mixtral's gate/up g128 0.79 / 1.02 / 1.12 / 1.29, g32
# 0.84 / 0.99 / 1.11 / 1.41; Qwen3-30B-A3B's gate/up g128 0.95 / - / 1.13 / 1.22, its down g128
# 1.17 / - / 1.27 / 1.45. Before the lanes took int4, GEMM_MIN_TOKENS tokens or more decoded the
# matrix to bf16 for torch's GEMM: at Mixtral's gate/up 39-41 ms at 16 tokens, 44-47 at 48
# (mostly the decoding), against the lanes' 5.3-7.7 and AMX's 11.5-13.7.
_INT4_IN_PLACE = in_place(lambda scheme, cols: vnni.HAVE_VNNI, stepwise)
for _group in (32, 64, 128):
    register_cpu(f"int4_g{_group}", CpuKernels(_matvec_int4_rows(_group), block_decoder(_decode_int4, _group),
                                               in_place=_INT4_IN_PLACE))

# fp8: on a CPU with AMX, several tokens multiply in place from AMX_MIN_TOKENS (each worker
# decodes a chunk of rows to bf16, ``amx.fp8_intrinsic``), fewer token by token; elsewhere 16 or
# more decode the matrix to bf16 for torch's GEMM and fewer go token by token.
register_cpu("fp8_e4m3", CpuKernels(fp8.matvec_rows, block_decoder(fp8.decode_rows),
                                    in_place=in_place(amx.fits, stepwise)))


def _kquant_kernels(parts: kquants.CpuParts) -> CpuKernels:
    decode = block_decoder(parts.decoder, *parts.tables)
    if parts.tiles is None:
        return CpuKernels(parts.matvec, decode)
    fits, multiply = parts.tiles
    return CpuKernels(parts.matvec, decode, in_place=in_place(fits, multiply or stepwise))


for _name in kquants.KINDS:
    register_cpu(_name, _kquant_kernels(kquants.cpu_parts(_name)))
