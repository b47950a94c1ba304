"""ggml's K-quants (super-blocks of 256 values: q2_k to q6_k) and the IQ4 non-linear 4-bit types
(iq4_nl in blocks of 32, iq4_xs in super-blocks of 256), byte for byte as ggml stores them: a
GGUF tensor in one of them passes through to the bundle unchanged, and the ``gguf`` package's
``dequantize`` is each one's reference decoder.

Block layouts (little-endian; ``d``/``dmin`` are fp16):

- ``q2_k`` (84 bytes): 16 bytes of 4-bit scale (low) and minimum (high) per 16 values, 64 bytes of
  2-bit codes, ``d``, ``dmin``. value = d * scale * code - dmin * minimum.
- ``q3_k`` (110 bytes): 32 bytes of high bits, 64 bytes of low 2 bits, 12 bytes of sixteen 6-bit
  scales (offset 32), ``d``. value = d * (scale - 32) * (code - 4 * (1 - high bit)).
- ``q4_k`` (144 bytes): ``d``, ``dmin``, 12 bytes of eight 6-bit scales and minimums (one pair
  per 32 values), 128 bytes of 4-bit codes (each 32 bytes: values of two sub-blocks, low nibble
  then high). value = d * scale * code - dmin * minimum.
- ``q5_k`` (176 bytes): as q4_k with 32 bytes of fifth bits before the codes.
- ``q6_k`` (210 bytes): 128 bytes of low 4 bits, 64 bytes of high 2 bits, sixteen int8 scales,
  ``d``. value = d * scale * (code - 32).
- ``iq4_nl`` (18 bytes per 32): ``d``, 16 bytes of 4-bit indices into a fixed table of 16 levels.
- ``iq4_xs`` (136 bytes): ``d``, 16 bits of the scales' high bits, 4 bytes of their low bits (eight
  6-bit scales, offset 32), 128 bytes of indices into iq4_nl's table.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .codec_ggml import gguf_dequantize
from .float_bits import F16_TO_F32, half_bits, store_half
from .scheme import Scheme, register

# Relative RMS error on Gaussian weights [256, 4096] of ggml's own quantizer (ggml_quantize_chunk
# from llama.cpp's build, without an importance matrix): what a scheme costs in quality where ktc
# passes it through, and the bar ktc's quantizers are held to.
GGML_ERROR = {"q2_k": 0.297, "q3_k": 0.151, "q4_k": 0.0713, "q5_k": 0.0361, "q6_k": 0.0177,
              "iq4_nl": 0.0761, "iq4_xs": 0.0767}


# Quantizing float weights to q4_k, q5_k and q6_k: llama.cpp's quantize_row_q4_K_ref family
# (without an importance matrix), float32 arithmetic in its order. On 64 x 4096 Gaussian weights
# the bytes are those of ggml_quantize_chunk, which llama-quantize calls (benchmarks/kquants.py
# compares them where llama.cpp's library is built).


@njit(cache=True, nogil=True, inline="always")
def _nearest(v):  # pragma: no cover - compiled
    # ggml's nearest_int: round half to even
    return np.int32(np.rint(v))


@njit(cache=True, nogil=True)
def _qkx2(x, weights, nmax, rmin, rdelta, nstep, L, aux):  # pragma: no cover - compiled
    # make_qkx2_quants: scale and (negated) minimum of n values fitted to codes 0..nmax by
    # weighted least squares over nstep + 1 candidate step counts; codes into L.
    n = x.shape[0]
    lo = x[0]
    hi = x[0]
    sum_w = weights[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        lo = min(lo, x[i])
        hi = max(hi, x[i])
        sum_w += weights[i]
        sum_x += weights[i] * x[i]
    if lo > 0:
        lo = np.float32(0)
    if hi == lo:
        L[:] = 0
        return np.float32(0), -lo
    iscale = np.float32(nmax) / (hi - lo)
    scale = np.float32(1) / iscale
    best = np.float32(0)
    for i in range(n):
        l = max(0, min(nmax, _nearest(iscale * (x[i] - lo))))
        L[i] = l
        diff = scale * np.float32(l) + lo - x[i]
        best += weights[i] * diff * diff
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * np.float32(step) + np.float32(nmax)) / (hi - lo)
        sl = np.float32(0)
        sl2 = np.float32(0)
        sxl = np.float32(0)
        for i in range(n):
            l = max(0, min(nmax, _nearest(iscale * (x[i] - lo))))
            aux[i] = l
            w = weights[i]
            lf = np.float32(l)
            sl += w * lf
            sl2 += w * lf * lf
            sxl += w * lf * x[i]
        det = sum_w * sl2 - sl * sl
        if det > 0:
            this_scale = (sum_w * sxl - sum_x * sl) / det
            this_min = (sl2 * sum_x - sl * sxl) / det
            if this_min > 0:
                this_min = np.float32(0)
                this_scale = sxl / sl2
            err = np.float32(0)
            for i in range(n):
                diff = this_scale * np.float32(aux[i]) + this_min - x[i]
                err += weights[i] * diff * diff
            if err < best:
                L[:] = aux[:]
                best = err
                scale = this_scale
                lo = this_min
    return scale, -lo


@njit(cache=True, nogil=True, parallel=True)
def _q45_k_kernel(x, nmax, out, table):  # pragma: no cover - compiled
    # x: [blocks, 256]; out: [blocks, 144] (q4_k, nmax 15) or [blocks, 176] (q5_k, nmax 31)
    five = nmax == 31
    rmin = np.float32(-0.5) if five else np.float32(-1.0)
    nstep = 15 if five else 20
    for b in prange(x.shape[0]):
        L = np.zeros(256, np.int32)
        aux = np.zeros(32, np.int32)
        w = np.empty(32, np.float32)
        scales = np.empty(8, np.float32)
        mins = np.empty(8, np.float32)
        for j in range(8):
            s2 = np.float32(0)
            for l in range(32):
                s2 += x[b, 32 * j + l] * x[b, 32 * j + l]
            av = np.sqrt(s2 / np.float32(32))
            for l in range(32):
                w[l] = av + abs(x[b, 32 * j + l])
            scales[j], mins[j] = _qkx2(x[b, 32 * j: 32 * j + 32], w, nmax, rmin, np.float32(0.1), nstep,
                                       L[32 * j: 32 * j + 32], aux)
        max_scale = max(np.float32(0), scales.max())
        max_min = max(np.float32(0), mins.max())
        inv_scale = np.float32(63) / max_scale if max_scale > 0 else np.float32(0)
        inv_min = np.float32(63) / max_min if max_min > 0 else np.float32(0)
        packed = np.zeros(12, np.int32)
        for j in range(8):
            ls = min(63, _nearest(inv_scale * scales[j]))
            lm = min(63, _nearest(inv_min * mins[j]))
            if j < 4:
                packed[j] = ls
                packed[j + 4] = lm
            else:
                packed[j + 4] = (ls & 15) | ((lm & 15) << 4)
                packed[j - 4] |= (ls >> 4) << 6
                packed[j] |= (lm >> 4) << 6
        store_half(out, b, max_scale / np.float32(63))
        dm_bits = half_bits(np.float32(max_min / np.float32(63)).view(np.uint32))
        out[b, 2] = np.uint8(dm_bits & np.uint16(0xFF))
        out[b, 3] = np.uint8(dm_bits >> np.uint16(8))
        for k in range(12):
            out[b, 4 + k] = np.uint8(packed[k])
        d_all = table[np.uint16(out[b, 0]) | (np.uint16(out[b, 1]) << np.uint16(8))]
        dmin_all = table[dm_bits]
        for j in range(8):
            if j < 4:
                sc = packed[j] & 63
                m = packed[j + 4] & 63
            else:
                sc = (packed[j + 4] & 15) | ((packed[j - 4] >> 6) << 4)
                m = (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4)
            d = d_all * np.float32(sc)
            if d == 0:
                continue
            dm = dmin_all * np.float32(m)
            for i in range(32):
                L[32 * j + i] = max(0, min(nmax, _nearest((x[b, 32 * j + i] + dm) / d)))
        codes = 48 if five else 16
        if five:
            for k in range(32):
                out[b, 16 + k] = 0
        for n in range(4):
            for l in range(32):
                l1 = L[64 * n + l]
                l2 = L[64 * n + 32 + l]
                if five:
                    if l1 > 15:
                        l1 -= 16
                        out[b, 16 + l] |= np.uint8(1 << (2 * n))
                    if l2 > 15:
                        l2 -= 16
                        out[b, 16 + l] |= np.uint8(2 << (2 * n))
                out[b, codes + 32 * n + l] = np.uint8(l1 | (l2 << 4))


@njit(cache=True, nogil=True)
def _qx(x, nmax, L):  # pragma: no cover - compiled
    # make_qx_quants with rmse_type 1 (weights x^2): a signed scale for codes -nmax..nmax-1,
    # searched over 19 step counts around nmax; L gets code + nmax.
    n = x.shape[0]
    mx = np.float32(0)
    amax = np.float32(0)
    for i in range(n):
        if abs(x[i]) > amax:
            amax = abs(x[i])
            mx = x[i]
    if amax < np.float32(1e-15):
        L[:] = 0
        return np.float32(0)
    iscale = -np.float32(nmax) / mx
    slx = np.float32(0)
    sl2 = np.float32(0)
    for i in range(n):
        l = max(-nmax, min(nmax - 1, _nearest(iscale * x[i])))
        L[i] = l + nmax
        w = x[i] * x[i]
        lf = np.float32(l)
        slx += w * x[i] * lf
        sl2 += w * lf * lf
    scale = slx / sl2 if sl2 != 0 else np.float32(0)
    best = scale * slx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(np.float32(nmax) + np.float32(0.1) * np.float32(step)) / mx
        slx = np.float32(0)
        sl2 = np.float32(0)
        for i in range(n):
            l = max(-nmax, min(nmax - 1, _nearest(iscale * x[i])))
            w = x[i] * x[i]
            lf = np.float32(l)
            slx += w * x[i] * lf
            sl2 += w * lf * lf
        if sl2 > 0 and slx * slx > best * sl2:
            for i in range(n):
                L[i] = nmax + max(-nmax, min(nmax - 1, _nearest(iscale * x[i])))
            scale = slx / sl2
            best = scale * slx
    return scale


@njit(cache=True, nogil=True, parallel=True)
def _q6_k_kernel(x, out, table):  # pragma: no cover - compiled
    for b in prange(x.shape[0]):
        L = np.zeros(256, np.int32)
        scales = np.empty(16, np.float32)
        max_scale = np.float32(0)
        max_abs = np.float32(0)
        for ib in range(16):
            s = _qx(x[b, 16 * ib: 16 * ib + 16], 32, L[16 * ib: 16 * ib + 16])
            scales[ib] = s
            if abs(s) > max_abs:
                max_abs = abs(s)
                max_scale = s
        out[b, :] = 0
        if max_abs < np.float32(1e-15):
            continue
        iscale = np.float32(-128) / max_scale
        bits = half_bits(np.float32(np.float32(1) / iscale).view(np.uint32))
        out[b, 208] = np.uint8(bits & np.uint16(0xFF))
        out[b, 209] = np.uint8(bits >> np.uint16(8))
        d_all = table[bits]
        for ib in range(16):
            sc = min(127, _nearest(iscale * scales[ib]))
            out[b, 192 + ib] = np.uint8(sc & 0xFF)
            d = d_all * np.float32(sc)
            if d == 0:
                continue
            for i in range(16):
                L[16 * ib + i] = max(-32, min(31, _nearest(x[b, 16 * ib + i] / d))) + 32
        for n in range(2):
            for l in range(32):
                a, c, e, g = L[128 * n + l], L[128 * n + l + 32], L[128 * n + l + 64], L[128 * n + l + 96]
                out[b, 64 * n + l] = np.uint8((a & 15) | ((e & 15) << 4))
                out[b, 64 * n + l + 32] = np.uint8((c & 15) | ((g & 15) << 4))
                out[b, 128 + 32 * n + l] = np.uint8((a >> 4) | ((c >> 4) << 2) | ((e >> 4) << 4) | ((g >> 4) << 6))


def _k_quantizer(kernel, block_bytes: int, *args):  # type: ignore[no-untyped-def]
    def quantize(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        blocks = x.reshape(-1, 256)
        dest = (np.empty((blocks.shape[0], block_bytes), dtype=np.uint8) if out is None
                else out.reshape(blocks.shape[0], block_bytes))
        kernel(blocks, *args, dest, F16_TO_F32)
        return dest.reshape(x.shape[0], -1)

    return quantize


QUANTIZERS = {"q4_k": _k_quantizer(_q45_k_kernel, 144, 15), "q5_k": _k_quantizer(_q45_k_kernel, 176, 31),
              "q6_k": _k_quantizer(_q6_k_kernel, 210)}


def _k(name: str, bits: float, block_bytes: int, half_scales: tuple[int, ...], description: str,
       elems: int = 256) -> Scheme:
    gguf_type = name.upper()
    return Scheme(name, bits, elems, block_bytes, gguf_type=gguf_type, sources=(gguf_type,),
                  error=GGML_ERROR[name], half_scales=half_scales, dequantize=gguf_dequantize(gguf_type),
                  quantize=QUANTIZERS.get(name), description=description)


register(
    _k("q2_k", 2.625, 84, (80, 82), "ggml Q2_K: 2-bit codes, 4-bit scales and minimums per 16"),
    _k("q3_k", 3.4375, 110, (108,), "ggml Q3_K: 3-bit codes, 6-bit scales per 16"),
    _k("q4_k", 4.5, 144, (0, 2), "ggml Q4_K: 4-bit codes, 6-bit scales and minimums per 32"),
    _k("q5_k", 5.5, 176, (0, 2), "ggml Q5_K: 5-bit codes, 6-bit scales and minimums per 32"),
    _k("q6_k", 6.5625, 210, (208,), "ggml Q6_K: 6-bit codes, int8 scales per 16"),
    _k("iq4_nl", 4.5, 18, (0,), "ggml IQ4_NL: fp16 scale + 32 non-linear 4-bit values per block", elems=32),
    _k("iq4_xs", 4.25, 136, (0,), "ggml IQ4_XS: non-linear 4-bit values, 6-bit scales per 32"),
)
