"""ggml's blocks of 32 (q8_0, q4_0, mxfp4): bit-identical to the ``gguf`` package, whose
``dequantize`` is each ggml type's reference decoder.

q8_0 and q4_0 quantize in Numba because the ``gguf`` package's numpy versions run at 300-550 MB/s
here, too slow to compile a 1 TB model; tests check them bit for bit against it. mxfp4 uses the
``gguf`` package itself.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numba import njit, prange

from ktc.errors import FormatError
from ktc.ir import TensorRef

from .float_bits import store_half
from .scheme import Scheme, register

_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_F2 = np.float32(2.0)


def gguf_dequantize(gguf_type: str) -> Callable[[np.ndarray, int], np.ndarray]:
    """The ``gguf`` package's decoder of ``gguf_type`` as a scheme's reference ``dequantize``."""

    def dequantize(raw: np.ndarray, cols: int) -> np.ndarray:
        from gguf import GGMLQuantizationType, quants

        raw = np.ascontiguousarray(raw, dtype=np.uint8)
        values = quants.dequantize(raw, GGMLQuantizationType[gguf_type])
        return values.reshape(raw.shape[0], cols).astype(np.float32, copy=False)

    return dequantize


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
    store_half(out, b, d)
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
    store_half(out, b, d)
    half = x.shape[1] // 2  # 16, not as a literal (see _abs_max_bits)
    for j in range(half):
        lo = np.trunc(x[b, j] * inv + np.float32(8.5))
        hi = np.trunc(x[b, j + half] * inv + np.float32(8.5))
        qlo = np.uint8(min(lo, np.float32(15.0)))
        qhi = np.uint8(min(hi, np.float32(15.0)))
        out[b, 2 + j] = qlo | (qhi << np.uint8(4))


def _blocks_of_32(kernel):  # type: ignore[no-untyped-def]
    def quantize(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        blocks = x.reshape(-1, 32)
        block_bytes = 34 if kernel is _q8_0_kernel else 18
        dest = (np.empty((blocks.shape[0], block_bytes), dtype=np.uint8) if out is None
                else out.reshape(blocks.shape[0], block_bytes))
        kernel(blocks, blocks.view(np.uint32), dest)
        return dest.reshape(x.shape[0], -1)

    return quantize


def _mxfp4_from_gpt_oss(ref: TensorRef, start: int = 0, stop: int | None = None, finite: bool = True) -> np.ndarray:
    """gpt-oss MXFP4 (``*_blocks`` with ``*_scales``; byte j holds values 2j and 2j+1) -> ggml
    MXFP4 blocks (scale byte, then byte j: values j and j+16). The codes and exponents are the
    same; only their order changes."""
    if ref.scale is None:
        raise FormatError("MXFP4 blocks without their scales tensor", tensor=ref.name)
    stop = ref.shape[0] if stop is None else stop
    scales = np.asarray(ref.scale.load())[start:stop]
    if finite and (bad := int(np.count_nonzero(scales == 0xFF))):  # e8m0's NaN
        raise FormatError(f"{bad} of {scales.size} MXFP4 block scales are NaN", tensor=ref.name,
                          hint="fix the checkpoint, or compile it anyway with --allow-nonfinite")
    blocks = np.asarray(ref.load())[start:stop]
    rows = blocks.shape[0]
    nib = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(rows, -1, 32)
    packed = nib[..., :16] | (nib[..., 16:] << 4)
    return np.concatenate([scales.reshape(rows, -1, 1), packed], axis=-1).reshape(rows, -1)


def _quantize_mxfp4(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants

    return np.ascontiguousarray(quants.quantize(x, GGMLQuantizationType.MXFP4)).reshape(x.shape[0], -1)


# Errors: step / sqrt(12) relative to the block's typical absolute maximum (about 2.1 sigma for
# 32 Gaussian values); mxfp4 as measured.
register(
    Scheme("q8_0", 8.5, 32, 34, gguf_type="Q8_0", sources=("Q8_0",), error=4.8e-3, half_scales=(0,),
           quantize=_blocks_of_32(_q8_0_kernel), dequantize=gguf_dequantize("Q8_0"),
           description="ggml Q8_0: fp16 scale + 32 int8 per block"),
    Scheme("q4_0", 4.5, 32, 18, gguf_type="Q4_0", sources=("Q4_0",), error=7.6e-2, half_scales=(0,),
           quantize=_blocks_of_32(_q4_0_kernel), dequantize=gguf_dequantize("Q4_0"),
           description="ggml Q4_0: fp16 scale + 32 4-bit values per block"),
    Scheme("mxfp4", 4.25, 32, 17, gguf_type="MXFP4", sources=("MXFP4",), error=1.1e-1, e8m0_scales=(0,),
           scaled_sources=("MXFP4_BLOCKS",), from_scaled=_mxfp4_from_gpt_oss,
           quantize=_quantize_mxfp4, dequantize=gguf_dequantize("MXFP4"),
           description="ggml MXFP4: e8m0 exponent + 32 e2m1 values per block"),
)
