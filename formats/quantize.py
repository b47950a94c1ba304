"""Quantize and dequantize 2-D weights [rows, cols] in every bundle scheme.

Byte layouts (per row; ``docs/bundle-format.md`` is the reference):

- ``f32``, ``f16``, ``bf16``: the values. bf16 rounds to nearest even, as ggml does.
- ``q8_0``, ``q4_0``, ``mxfp4``: ggml's blocks of 32, bit-identical to the ``gguf`` package.
- ``int8``: ``cols`` int8 values, then one float32 scale (``amax / 127``); ``x = q * scale``.
- ``int4_gN``: ``cols / 2`` bytes of 4-bit codes, then ``cols / N`` bf16 scales, then
  ``cols / N`` bf16 minimums; per group of N, ``x = code * scale + minimum`` with ``code`` in
  0..15. The scale and minimum are the least-squares fit to the codes of the best of several
  step counts across the group's range (``INT4_STEPS``).
  Within each group, byte ``k`` holds value ``k`` in its low nibble and ``k + N / 2`` in its high
  nibble: one load of a group's ``N / 2`` bytes and two masks give its values in order, which is
  what the integer dot-product kernels want.
  With a minimum rather than symmetric: on Gaussian weights it has 19% less RMS error at g32
  (0.070 against 0.086) and 8% less at g128 (0.093 against 0.102), for the same four bytes per
  group (two bf16 instead of one float32) and one more multiply-add per group in the kernel.

q8_0 and q4_0 have their own Numba kernels because the ``gguf`` package's numpy versions run at
300-550 MB/s here, too slow to compile a 1 TB model; tests check them bit for bit against it.
mxfp4 uses the ``gguf`` package itself.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ktc.errors import FormatError
from ktc.ir import TensorRef

from .dequant import to_float32
from .schemes import Scheme, get_scheme

_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_F2 = np.float32(2.0)


@njit(cache=True, nogil=True, inline="always")
def _half_bits(f):  # pragma: no cover - compiled
    # IEEE float32 bits -> float16 bits, round to nearest even: numpy's npy_floatbits_to_halfbits
    # (Numba has no float16, and ggml's block scales are float16).
    h_sgn = (f & np.uint32(0x80000000)) >> np.uint32(16)
    f_exp = f & np.uint32(0x7F800000)
    if f_exp >= np.uint32(0x47800000):
        if f_exp == np.uint32(0x7F800000):
            f_sig = f & np.uint32(0x007FFFFF)
            if f_sig != 0:
                ret = np.uint32(0x7C00) + (f_sig >> np.uint32(13))
                if ret == np.uint32(0x7C00):
                    ret += np.uint32(1)
                return np.uint16(h_sgn + ret)
        return np.uint16(h_sgn + np.uint32(0x7C00))
    if f_exp <= np.uint32(0x38000000):
        if f_exp < np.uint32(0x33000000):
            return np.uint16(h_sgn)
        e = f_exp >> np.uint32(23)
        f_sig = np.uint32(0x00800000) + (f & np.uint32(0x007FFFFF))
        f_sig = f_sig >> (np.uint32(113) - e)
        if ((f_sig & np.uint32(0x3FFF)) != np.uint32(0x1000)) or (f & np.uint32(0x7FF)) != 0:
            f_sig += np.uint32(0x1000)
        return np.uint16(h_sgn + (f_sig >> np.uint32(13)))
    h_exp = (f_exp - np.uint32(0x38000000)) >> np.uint32(13)
    f_sig = f & np.uint32(0x007FFFFF)
    if (f_sig & np.uint32(0x3FFF)) != np.uint32(0x1000):
        f_sig += np.uint32(0x1000)
    return np.uint16(h_sgn + h_exp + (f_sig >> np.uint32(13)))


@njit(cache=True, nogil=True, inline="always")
def _abs_max_bits(xbits, b):  # pragma: no cover - compiled
    # The largest |x| of block b, as float32 bits. The magnitude bits of IEEE floats order like
    # the floats (NaN above Inf, as numpy's max has it), and an integer max vectorizes where a
    # float compare-and-branch does not.
    m = np.uint32(0)
    for j in range(xbits.shape[1]):  # not the literal 32: a fully unrolled loop stays scalar
        m = max(m, xbits[b, j] & np.uint32(0x7FFFFFFF))
    return m


@njit(cache=True, nogil=True, inline="always")
def _first_abs_max(xbits, b):  # pragma: no cover - compiled
    # Index of the first value of block b with the largest magnitude, in one max-reduction that
    # vectorizes: the key is the magnitude bits (which order like the floats, NaN above Inf)
    # followed by 31 - index, so equal magnitudes are won by the earlier value.
    best = np.uint64(0)
    last = np.uint64(31)
    for j in range(xbits.shape[1]):
        key = (np.uint64(xbits[b, j] & np.uint32(0x7FFFFFFF)) << np.uint64(5)) | (last - np.uint64(j))
        best = max(best, key)
    return 31 - np.int64(best & np.uint64(31))


@njit(cache=True, nogil=True, inline="always")
def _store_half(out, b, d):  # pragma: no cover - compiled
    h = _half_bits(np.float32(d).view(np.uint32))
    out[b, 0] = np.uint8(h & np.uint16(0xFF))
    out[b, 1] = np.uint8(h >> np.uint16(8))


_CHUNK = 512  # blocks per parallel work item: enough work to hide the scheduling cost


@njit(cache=True, nogil=True, parallel=True)
def _q8_0_kernel(x, xbits, out):  # pragma: no cover - compiled
    # ggml's quantize_row_q8_0_ref: d = amax / 127, q = roundf(x / d) (half away from zero).
    # out: [blocks, 34] = float16 d, then 32 int8.
    n = x.shape[0]
    for c in prange((n + _CHUNK - 1) // _CHUNK):
        for b in range(c * _CHUNK, min(n, (c + 1) * _CHUNK)):
            _q8_0_block(x, xbits, out, b)


@njit(cache=True, nogil=True, inline="always")
def _q8_0_block(x, xbits, out, b):  # pragma: no cover - compiled
    amax = np.uint32(_abs_max_bits(xbits, b)).view(np.float32)
    d = amax / np.float32(127.0)
    inv = _F0 if d == _F0 else _F1 / d
    _store_half(out, b, d)
    for j in range(32):
        v = x[b, j] * inv
        a = abs(v)
        fl = np.floor(a)
        r = np.int32(fl + np.floor(_F2 * (a - fl)))
        out[b, 2 + j] = np.uint8((r if v >= _F0 else -r) & 0xFF)


@njit(cache=True, nogil=True, parallel=True)
def _q4_0_kernel(x, xbits, out):  # pragma: no cover - compiled
    # ggml's quantize_row_q4_0_ref: d = (signed value of largest magnitude) / -8,
    # q = min(15, trunc(x / d + 8.5)); value j in the low nibble, j + 16 in the high one.
    # out: [blocks, 18] = float16 d, then 16 bytes of codes.
    n = x.shape[0]
    for c in prange((n + _CHUNK - 1) // _CHUNK):
        for b in range(c * _CHUNK, min(n, (c + 1) * _CHUNK)):
            _q4_0_block(x, xbits, out, b)


@njit(cache=True, nogil=True, inline="always")
def _q4_0_block(x, xbits, out, b):  # pragma: no cover - compiled
    d = x[b, _first_abs_max(xbits, b)] / np.float32(-8.0)
    inv = _F0 if d == _F0 else _F1 / d
    _store_half(out, b, d)
    half = x.shape[1] // 2  # 16, not as a literal (see _abs_max_bits)
    for j in range(half):
        lo = np.trunc(x[b, j] * inv + np.float32(8.5))
        hi = np.trunc(x[b, j + half] * inv + np.float32(8.5))
        qlo = np.uint8(min(lo, np.float32(15.0)))
        qhi = np.uint8(min(hi, np.float32(15.0)))
        out[b, 2 + j] = qlo | (qhi << np.uint8(4))


def f32_to_f16_bits(values: np.ndarray) -> np.ndarray:
    """float16 bit patterns of float32 values (the kernels' conversion, exposed for tests)."""
    return _half_bits_array(np.ascontiguousarray(values, dtype=np.float32).reshape(-1).view(np.uint32))


@njit(cache=True, nogil=True)
def _half_bits_array(bits):  # pragma: no cover - compiled
    out = np.empty(bits.shape[0], dtype=np.uint16)
    for i in range(bits.shape[0]):
        out[i] = _half_bits(bits[i])
    return out


@njit(cache=True, nogil=True, parallel=True)
def _int8_kernel(x, scales, codes):  # pragma: no cover - compiled
    for r in prange(x.shape[0]):
        amax = _F0
        for j in range(x.shape[1]):
            v = abs(x[r, j])
            if v > amax:
                amax = v
        d = amax / np.float32(127.0)
        inv = _F0 if d == _F0 else _F1 / d
        scales[r] = d
        for j in range(x.shape[1]):
            v = x[r, j] * inv
            a = abs(v)
            fl = np.floor(a)
            q = fl + np.floor(_F2 * (a - fl))
            if q > np.float32(127.0):
                q = np.float32(127.0)
            codes[r, j] = np.int8(q) if v >= _F0 else np.int8(-q)


# Candidate step counts across an int4 group's range (its largest minus its smallest value): 15
# never clips; more steps trade a clipped extreme for finer steps. For each, the scale and minimum
# are then fitted by least squares to the codes, and the candidate with the smallest squared
# error wins (ggml's make_qkx quantizers search the same way).
INT4_STEPS = np.arange(14.0, 19.0, 0.25).astype(np.float32)


@njit(cache=True, nogil=True, inline="always")
def bf16_bits(f):  # pragma: no cover - compiled
    # float32 -> bf16 bits, round to nearest even (finite values); Numba code calls it too
    n = np.uint64(np.float32(f).view(np.uint32))
    return np.uint16((n + np.uint64(0x7FFF) + ((n >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16))


@njit(cache=True, nogil=True, inline="always")
def bf16_value(bits):  # pragma: no cover - compiled
    # bf16 bits -> float32 (the upper half of a float32)
    return np.uint32(np.uint32(bits) << np.uint32(16)).view(np.float32)


@njit(cache=True, nogil=True, inline="always")
def _uint4_code(v, m, inv):  # pragma: no cover - compiled
    # round((v - m) / d), clamped to [0, 15]
    q = np.floor((v - m) * inv + np.float32(0.5))
    return max(_F0, min(np.float32(15.0), q))


@njit(cache=True, nogil=True, parallel=True)
def _int4_kernel(x, group, steps, params, codes):  # pragma: no cover - compiled
    # x: [rows, cols]; params: uint16 [rows, 2 * groups] (bf16 scales, then bf16 minimums);
    # codes: [rows, cols // 2]
    groups = x.shape[1] // group
    n = np.float64(group)
    for r in prange(x.shape[0]):
        for g in range(groups):
            start = g * group
            lo = x[r, start]
            hi = lo
            sx = 0.0
            for j in range(group):
                v = x[r, start + j]
                lo = min(lo, v)
                hi = max(hi, v)
                sx += np.float64(v)
            best_d = np.float64(0.0)
            best_m = np.float64(lo)
            if hi > lo:
                best_err = np.inf
                for c in range(steps.shape[0]):
                    inv = steps[c] / (hi - lo)
                    sq = 0.0
                    sqq = 0.0
                    sqx = 0.0
                    for j in range(group):
                        v = x[r, start + j]
                        q = np.float64(_uint4_code(v, lo, inv))
                        sq += q
                        sqq += q * q
                        sqx += q * v
                    det = n * sqq - sq * sq
                    if det <= 0.0:
                        continue
                    d = (n * sqx - sq * sx) / det
                    m = (sx - d * sq) / n
                    if d <= 0.0:
                        continue
                    err = 0.0
                    for j in range(group):
                        v = x[r, start + j]
                        e = np.float64(v) - np.float64(_uint4_code(v, lo, inv)) * d - m
                        err += e * e
                    if err < best_err:
                        best_err = err
                        best_d = d
                        best_m = m
            d_bits = bf16_bits(np.float32(best_d))
            m_bits = bf16_bits(np.float32(best_m))
            params[r, g] = d_bits
            params[r, groups + g] = m_bits
            d = bf16_value(d_bits)
            m = bf16_value(m_bits)
            inv = _F0 if d == _F0 else _F1 / d
            half = group // 2
            for k in range(half):
                cl = np.uint8(_uint4_code(x[r, start + k], m, inv))
                ch = np.uint8(_uint4_code(x[r, start + half + k], m, inv))
                codes[r, start // 2 + k] = cl | (ch << np.uint8(4))


@njit(cache=True, nogil=True, parallel=True)
def _bf16_kernel(bits, out):  # pragma: no cover - compiled
    # ggml_compute_fp32_to_bf16: quiet NaNs, round to nearest even.
    for i in prange(bits.shape[0]):
        n = np.uint32(bits[i])
        if (n & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
            out[i] = np.uint16((n >> np.uint32(16)) | np.uint32(64))
        else:
            out[i] = np.uint16((np.uint64(n) + np.uint64(0x7FFF) + np.uint64((n >> np.uint32(16)) & np.uint32(1)))
                               >> np.uint64(16))


def f32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """bf16 bit patterns of float32 values, in parallel (as ggml rounds them)."""
    out = np.empty(values.size, dtype=np.uint16)
    _bf16_kernel(values.reshape(-1).view(np.uint32), out)
    return out.reshape(values.shape)


def quantize(values: np.ndarray, scheme: Scheme | str, out: np.ndarray | None = None) -> np.ndarray:
    """Bytes [rows, row_bytes] of float32 ``values`` [rows, cols] in ``scheme``.

    ``out``, a contiguous uint8 array of exactly that many bytes, receives them without an
    intermediate copy (the compiler passes the expert's buffer)."""
    return _into(_quantize(values, scheme, out), out)


def _into(result: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """``result`` in ``out`` (copied there unless it was written there already)."""
    if out is None:
        return result
    if not np.may_share_memory(result, out):
        out.reshape(-1)[:] = result.reshape(-1)
    return out.reshape(result.shape)


def _quantize(values: np.ndarray, scheme: Scheme | str, out: np.ndarray | None) -> np.ndarray:
    scheme = get_scheme(scheme) if isinstance(scheme, str) else scheme
    x = np.ascontiguousarray(values, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"quantize takes a 2-D matrix, not shape {x.shape}")
    rows, cols = x.shape
    if not scheme.fits(cols):
        raise FormatError(f"scheme {scheme.name} needs rows that are a multiple of "
                          f"{scheme.block_elems} values; this row has {cols}")
    name = scheme.name
    if name == "f32":
        return x.view(np.uint8).reshape(rows, cols * 4)
    if name == "f16":
        return x.astype(np.float16).view(np.uint8).reshape(rows, cols * 2)
    if name == "bf16":
        return f32_to_bf16_bits(x).view(np.uint8).reshape(rows, cols * 2)
    if name in ("q8_0", "q4_0"):
        blocks = x.reshape(-1, 32)
        dest = (np.empty((blocks.shape[0], scheme.block_bytes), dtype=np.uint8) if out is None
                else out.reshape(blocks.shape[0], scheme.block_bytes))
        (_q8_0_kernel if name == "q8_0" else _q4_0_kernel)(blocks, blocks.view(np.uint32), dest)
        return dest.reshape(rows, -1)
    if name == "mxfp4":
        from gguf import GGMLQuantizationType, quants

        return np.ascontiguousarray(quants.quantize(x, GGMLQuantizationType.MXFP4)).reshape(rows, -1)
    if name == "int8":
        scales = np.empty(rows, dtype=np.float32)
        codes = np.empty((rows, cols), dtype=np.int8)
        _int8_kernel(x, scales, codes)
        return np.concatenate([codes.view(np.uint8), scales.view(np.uint8).reshape(rows, 4)], axis=1)
    if name.startswith("int4_g"):
        group = scheme.block_elems
        params = np.empty((rows, 2 * (cols // group)), dtype=np.uint16)
        codes = np.empty((rows, cols // 2), dtype=np.uint8)
        _int4_kernel(x, group, INT4_STEPS, params, codes)
        return np.concatenate([codes, params.view(np.uint8)], axis=1)
    raise FormatError(f"no quantizer for scheme {name}")


def dequantize(raw: np.ndarray, scheme: Scheme | str, cols: int) -> np.ndarray:
    """Float32 [rows, cols] from bytes [rows, row_bytes] in ``scheme``."""
    scheme = get_scheme(scheme) if isinstance(scheme, str) else scheme
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    rows = raw.shape[0]
    name = scheme.name
    if name == "f32":
        return raw.view(np.float32).reshape(rows, cols).copy()
    if name == "f16":
        return raw.view(np.float16).reshape(rows, cols).astype(np.float32)
    if name == "bf16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(rows, cols)
    if scheme.gguf_type:
        from gguf import GGMLQuantizationType, quants

        return quants.dequantize(raw, GGMLQuantizationType[scheme.gguf_type]).reshape(rows, cols).astype(
            np.float32, copy=False)
    if name == "int8":
        codes = raw[:, :cols].view(np.int8).astype(np.float32)
        scales = raw[:, cols:cols + 4].copy().view(np.float32)
        return codes * scales
    if name.startswith("int4_g"):
        group = scheme.block_elems
        groups = cols // group
        packed = raw[:, : cols // 2].reshape(rows, groups, group // 2)
        params = (raw[:, cols // 2:].copy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        scales, minimums = params[:, :groups], params[:, groups:]
        values = np.concatenate([packed & 15, packed >> 4], axis=2).astype(np.float32)
        return (values * scales[:, :, None] + minimums[:, :, None]).reshape(rows, cols)
    raise FormatError(f"no dequantizer for scheme {name}")


# Source storage types that are already a bundle scheme, byte for byte.
_PASS_THROUGH = {"F32": "f32", "F16": "f16", "BF16": "bf16", "Q8_0": "q8_0", "Q4_0": "q4_0",
                 "MXFP4": "mxfp4"}


def _mxfp4_blocks_to_ggml(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """gpt-oss MXFP4 (byte j: values 2j and 2j+1) -> ggml MXFP4 blocks (scale byte, then byte j:
    values j and j+16). The codes and exponents are the same; only their order changes."""
    rows = blocks.shape[0]
    nib = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(rows, -1, 32)
    packed = nib[..., :16] | (nib[..., 16:] << 4)
    out = np.concatenate([scales.reshape(rows, -1, 1), packed], axis=-1)
    return out.reshape(rows, -1)


def convert(ref: TensorRef, scheme: Scheme | str, out: np.ndarray | None = None, *,
            finite: bool = True) -> np.ndarray:
    """A 2-D source tensor in ``scheme``: the stored bytes when the source already is that
    scheme (no requantizing), else dequantized exactly and quantized (into ``out`` if given).
    With ``finite``, a float source holding NaN or Inf is refused (``check_finite``)."""
    return _into(_convert(ref, scheme, out, finite), out)


def _convert(ref: TensorRef, scheme: Scheme | str, out: np.ndarray | None, finite: bool) -> np.ndarray:
    scheme = get_scheme(scheme) if isinstance(scheme, str) else scheme
    if len(ref.shape) != 2:
        raise FormatError(f"expected a 2-D weight, found shape {ref.shape}", tensor=ref.name)
    if _PASS_THROUGH.get(ref.dtype) == scheme.name and ref.scale is None:
        raw = np.ascontiguousarray(ref.load())
        if finite:
            check_finite(raw, ref.name, ref.dtype)
        return raw.view(np.uint8).reshape(ref.shape[0], -1)
    if ref.dtype == "MXFP4_BLOCKS" and scheme.name == "mxfp4" and ref.scale is not None:
        scales = np.asarray(ref.scale.load())
        if finite and (bad := int(np.count_nonzero(scales == 0xFF))):  # e8m0's NaN
            raise FormatError(f"{bad} of {scales.size} MXFP4 block scales are NaN", tensor=ref.name,
                              hint="fix the checkpoint, or compile it anyway with --allow-nonfinite")
        return _mxfp4_blocks_to_ggml(np.asarray(ref.load()), scales)
    values = to_float32(ref)
    if finite:
        check_finite(values, ref.name)
    return _quantize(values, scheme, out)


_FLOAT_BITS = {"F32": (np.uint32, 0x7F800000), "F16": (np.uint16, 0x7C00), "BF16": (np.uint16, 0x7F80)}
# Bytes per block of the block formats passed through as stored. Q8_0 and Q4_0 blocks start with
# an fp16 scale; MXFP4 blocks with an e8m0 exponent whose 0xFF is NaN.
_BLOCK_SCALES = {"Q8_0": 34, "Q4_0": 18, "MXFP4": 17}


def check_finite(values: np.ndarray, name: str, dtype: str = "F32") -> None:
    """Refuse a tensor holding NaN or Inf, naming it. ``values`` are float32 (a source decoded to
    be quantized), the stored elements of an ``F32``/``F16``/``BF16`` source passed through, or
    the stored blocks of a ``Q8_0``/``Q4_0``/``MXFP4`` one (their scales are checked: a block's
    values are finite when its scale is). Runs on values already in memory: no extra read of the
    checkpoint. A float32 sum is the quick test (10 ms for 235 MB here, half of
    ``isfinite().all()``); only a non-finite sum, which a huge finite value can also give, counts
    element by element."""
    if values.size == 0:
        return
    if dtype in _BLOCK_SCALES:
        raw = np.ascontiguousarray(values).view(np.uint8).reshape(-1)
        block = _BLOCK_SCALES[dtype]
        if raw.size % block:
            return  # not whole blocks: the reader's own checks speak about that
        blocks = raw.reshape(-1, block)
        if dtype == "MXFP4":
            bad = int(np.count_nonzero(blocks[:, 0] == 0xFF))
        else:
            scales = np.ascontiguousarray(blocks[:, :2]).view(np.uint16).reshape(-1)
            bad = int(np.count_nonzero((scales & 0x7C00) == 0x7C00))
        if bad:
            raise FormatError(f"{bad} of {blocks.shape[0]} {dtype} blocks have a NaN or infinite scale",
                              tensor=name, hint="fix the checkpoint, or compile it anyway with --allow-nonfinite")
        return
    if dtype not in _FLOAT_BITS:
        return
    if dtype == "F32" and values.dtype == np.float32 and np.isfinite(np.sum(values, dtype=np.float32)):
        return
    uint, exponent = _FLOAT_BITS[dtype]
    bad = int(np.count_nonzero((np.ascontiguousarray(values).view(uint) & exponent) == exponent))
    if bad:
        raise FormatError(f"{bad} of {values.size} values are NaN or infinite", tensor=name,
                          hint="fix the checkpoint, or compile it anyway with --allow-nonfinite")
