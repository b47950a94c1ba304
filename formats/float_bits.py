"""Float conversions the codecs and the runtime share, as ggml rounds them: float32 to bf16 bits
and to fp16 bits (Numba has no float16), for single values inside compiled code and for arrays."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .kernel_args import read_only

# fp16 bits -> float32 value, every one of the 65536.
F16_TO_F32 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
# e8m0 exponent byte -> 2^(e - 127) (OCP Microscaling v1.0; 0xFF encodes NaN).
with np.errstate(over="ignore"):
    E8M0_TO_F32 = np.ldexp(np.float32(1.0), np.arange(256) - 127).astype(np.float32)
E8M0_TO_F32[255] = np.nan


@njit(cache=True, nogil=True, inline="always")
def half_bits(f):  # pragma: no cover - compiled
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


def f32_to_f16_bits(values: np.ndarray) -> np.ndarray:
    """float16 bit patterns of float32 values (the kernels' conversion, exposed for tests)."""
    return _half_bits_array(np.ascontiguousarray(values, dtype=np.float32).reshape(-1).view(np.uint32))


@njit(cache=True, nogil=True)
def _half_bits_array(bits):  # pragma: no cover - compiled
    out = np.empty(bits.shape[0], dtype=np.uint16)
    for i in range(bits.shape[0]):
        out[i] = half_bits(bits[i])
    return out


@njit(cache=True, nogil=True, inline="always")
def store_half(out, b, d):  # pragma: no cover - compiled
    h = half_bits(np.float32(d).view(np.uint32))
    out[b, 0] = np.uint8(h & np.uint16(0xFF))
    out[b, 1] = np.uint8(h >> np.uint16(8))


@njit(cache=True, nogil=True, inline="always")
def bf16_bits(f):  # pragma: no cover - compiled
    # float32 -> bf16 bits, round to nearest even (finite values); Numba code calls it too
    n = np.uint64(np.float32(f).view(np.uint32))
    return np.uint16((n + np.uint64(0x7FFF) + ((n >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16))


@njit(cache=True, nogil=True, inline="always")
def put_decoded(bf16, out32, out16, r, j, v):  # pragma: no cover - compiled
    # a decoder's value v at [r, j]: as float32 into out32, or with bf16 as its bf16 bits into out16
    if bf16:
        out16[r, j] = bf16_bits(v)  # decoded weights are finite: no NaN to quiet
    else:
        out32[r, j] = v


@njit(cache=True, nogil=True, inline="always")
def bf16_value(bits):  # pragma: no cover - compiled
    # bf16 bits -> float32 (the upper half of a float32)
    return np.uint32(np.uint32(bits) << np.uint32(16)).view(np.float32)


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
    _bf16_kernel(read_only(values.reshape(-1).view(np.uint32)), out)
    return out.reshape(values.shape)
