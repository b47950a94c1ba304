"""Float32 values of any stored tensor: plain types, bf16, fp8 with block scales, ggml blocks
(through the ``gguf`` package, the reference) and gpt-oss MXFP4 blocks."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ktc.errors import FormatError
from ktc.ir import TensorRef


def _fp8_e4m3_table() -> np.ndarray:
    # e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, 0x7f/0xff are NaN.
    codes = np.arange(256, dtype=np.int64)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> 3) & 0xF
    mantissa = codes & 0x7
    normal = (1 + mantissa / 8.0) * np.exp2(exponent - 7.0)
    subnormal = (mantissa / 8.0) * np.exp2(-6.0)
    values = sign * np.where(exponent == 0, subnormal, normal)
    values[(codes & 0x7F) == 0x7F] = np.nan
    return values.astype(np.float32)


FP8_E4M3_VALUES = _fp8_e4m3_table()
# The e2m1 code points of MXFP4 (OCP Microscaling spec v1.0).
FP4_E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6],
                           dtype=np.float32)


@njit(cache=True, nogil=True, parallel=True)
def _bf16_to_f32(bits, out):  # pragma: no cover - compiled
    for i in prange(bits.shape[0]):
        out[i] = np.uint32(bits[i]) << np.uint32(16)


def plain_to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Float32 values of a plain (not block-quantized) stored array."""
    if dtype == "BF16":
        # Numba, in parallel: numpy's astype-and-shift is two single-threaded passes.
        out = np.empty(raw.shape, dtype=np.uint32)
        _bf16_to_f32(np.ascontiguousarray(raw).reshape(-1), out.reshape(-1))
        return out.view(np.float32)
    if dtype == "F8_E4M3":
        return FP8_E4M3_VALUES[raw]
    if dtype == "F8_E5M2":
        # e5m2 is the upper byte of an IEEE half.
        return (raw.astype(np.uint16) << 8).view(np.float16).astype(np.float32)
    return raw.astype(np.float32, copy=False)


def to_float32(ref: TensorRef) -> np.ndarray:
    """The tensor's values as float32 of ``ref.shape``: a new array, or for float32 sources a
    read-only view of the mapped file (no copy)."""
    # float32 and bf16 are read by parallel kernels, whose threads fault the pages in faster
    # than one populate call maps them.
    raw = ref.load(populate=ref.dtype not in ("F32", "BF16"))
    st = ref.storage
    if ref.dtype == "MXFP4_BLOCKS":
        if ref.scale is None:
            raise FormatError("MXFP4 blocks without their scales tensor", tensor=ref.name)
        return _mxfp4_blocks_to_float32(raw, ref.scale.load()).reshape(ref.shape)
    if st.is_quantized:
        from gguf import GGMLQuantizationType, quants  # the reference decoder

        values = quants.dequantize(np.ascontiguousarray(raw), GGMLQuantizationType[ref.dtype])
        return values.reshape(ref.shape).astype(np.float32, copy=False)
    values = plain_to_float32(raw, ref.dtype)
    if ref.scale is not None:
        values = values * _expand_block_scales(ref)
    return np.asarray(values, dtype=np.float32)


def _expand_block_scales(ref: TensorRef) -> np.ndarray:
    assert ref.scale is not None
    scales = to_float32(ref.scale)
    block = ref.scale_block or ()
    if len(block) != len(ref.shape):
        raise FormatError(f"scale blocks {block} do not match shape {ref.shape}", tensor=ref.name)
    for axis, size in enumerate(block):
        scales = np.repeat(scales, size, axis=axis)
    index = tuple(slice(0, n) for n in ref.shape)
    if any(s < n for s, n in zip(scales.shape, ref.shape)):
        raise FormatError(f"scales {ref.scale.shape} x block {block} do not cover shape {ref.shape}",
                          tensor=ref.name)
    return scales[index]


def _mxfp4_blocks_to_float32(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    # gpt-oss: 16 bytes per 32 values, low nibble first; one e8m0 exponent (bias 127) per block.
    nibbles = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], -1)
    values = FP4_E2M1_VALUES[nibbles].reshape(*scales.shape, 32)
    exponent = np.ldexp(np.float32(1.0), scales.astype(np.int32) - 127).astype(np.float32)
    return (values * exponent[..., None]).reshape(*blocks.shape[:-1], -1)


def to_float32_rows(ref: TensorRef, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` of a 2-D tensor as float32, reading only those rows.

    Tensors with 2-D block scales (FP8) cannot take a view, so their rows and the matching
    rows of scales are read directly; ``start`` must then be a multiple of the block height.
    """
    if ref.scale is not None and ref.scale_block is not None:
        if ref.view:
            raise FormatError("a tensor with block scales cannot be viewed", tensor=ref.name)
        rows_per_block = ref.scale_block[0]
        if start % rows_per_block:
            raise FormatError(f"row {start} is not at a scale block boundary", tensor=ref.name)
        raw = ref.load()[start:stop]
        scales = to_float32(ref.scale)[start // rows_per_block: -(-stop // rows_per_block)]
        scales = np.repeat(np.repeat(scales, rows_per_block, axis=0), ref.scale_block[1], axis=1)
        return plain_to_float32(raw, ref.dtype) * scales[: stop - start, : ref.shape[1]]
    from ktc.ir import Slice

    return to_float32(ref.with_view(Slice(0, start, stop)))
