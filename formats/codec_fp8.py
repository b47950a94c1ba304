"""FP8 e4m3 with block scales, as DeepSeek-V3, Kimi-K2 and GLM-4.5-FP8 ship their weights: each
matrix's e4m3 values (``float8_e4m3fn``: no infinities, 0x7F/0xFF NaN, largest 448) and one
float32 scale per 128 x 128 block (``weight_scale_inv``; value = code * scale).

``fp8_e4m3`` stores rows in blocks of 128 values, each a float32 scale then the 128 e4m3 codes
(132 bytes, 8.25 bits a weight): the checkpoint's codes unchanged and its scales repeated for
each of the 128 rows a block scale covers, so that any rows (an expert's, a slice of a fused
gate/up) are whole blocks with their scales, like every other scheme. Converting a checkpoint's
FP8 tensor to it is exact; converting it to another scheme decodes it exactly
(``formats.dequant``) and quantizes.
"""

from __future__ import annotations

import numpy as np

from ktc.errors import FormatError
from ktc.ir import TensorRef

from .dequant import FP8_E4M3_VALUES
from .scheme import Scheme, register

BLOCK = 128
BLOCK_BYTES = 4 + BLOCK
E4M3_MAX = 448.0  # the largest finite e4m3 value


def pack(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Rows of blocks from e4m3 ``codes`` (uint8 [rows, cols]) and one float32 scale per block
    (``scales`` [rows, cols / 128])."""
    rows, cols = codes.shape
    out = np.empty((rows, cols // BLOCK, BLOCK_BYTES), dtype=np.uint8)
    out[:, :, :4] = np.ascontiguousarray(scales, dtype=np.float32).view(np.uint8).reshape(rows, -1, 4)
    out[:, :, 4:] = codes.reshape(rows, -1, BLOCK)
    return out.reshape(rows, -1)


def from_block_scaled(ref: TensorRef, start: int = 0, stop: int | None = None, finite: bool = True) -> np.ndarray:
    """Rows ``start:stop`` of a checkpoint's FP8 tensor with 2-D block scales, in this scheme:
    its codes and scales as they are, laid out per row. With ``finite``, NaN codes (0x7F, 0xFF)
    and non-finite scales are refused."""
    stop = ref.shape[0] if stop is None else stop
    if ref.scale is None or ref.scale_block is None or len(ref.shape) != 2:
        raise FormatError("an FP8 weight without its block scales", tensor=ref.name,
                          hint="the checkpoint's weight_scale_inv tensor is missing")
    block_rows, block_cols = ref.scale_block
    if block_cols != BLOCK or ref.shape[1] % BLOCK:
        raise FormatError(f"FP8 scale blocks of {block_rows}x{block_cols} over rows of {ref.shape[1]}: "
                          f"stored as fp8_e4m3 they must be {BLOCK} values wide", tensor=ref.name)
    scales = np.asarray(ref.scale.load())
    want = (-(-ref.shape[0] // block_rows), ref.shape[1] // BLOCK)
    if scales.shape != want:
        raise FormatError(f"FP8 scales of shape {scales.shape}; a {ref.shape[0]}x{ref.shape[1]} weight in "
                          f"{block_rows}x{block_cols} blocks needs {want}", tensor=ref.name)
    from .dequant import plain_to_float32

    per_row = plain_to_float32(scales, ref.scale.dtype).astype(np.float32)[np.arange(start, stop) // block_rows]
    codes = np.asarray(ref.load())[start:stop].view(np.uint8)
    if finite:
        bad = int(np.count_nonzero((codes & 0x7F) == 0x7F)) + int(np.count_nonzero(~np.isfinite(per_row)))
        if bad:
            raise FormatError(f"{bad} FP8 values or block scales are NaN or infinite", tensor=ref.name,
                              hint="fix the checkpoint, or compile it anyway with --allow-nonfinite")
    return pack(codes, per_row)


def _quantize(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    import torch

    rows, cols = x.shape
    blocks = x.reshape(rows, cols // BLOCK, BLOCK)
    amax = np.abs(blocks).max(axis=2)
    scales = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)
    scaled = torch.from_numpy(np.ascontiguousarray(blocks / scales[:, :, None], dtype=np.float32))
    codes = scaled.to(torch.float8_e4m3fn).view(torch.uint8).numpy()  # round to nearest even
    return pack(codes.reshape(rows, cols), scales)


def _dequantize(raw: np.ndarray, cols: int) -> np.ndarray:
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // BLOCK, BLOCK_BYTES)
    scales = np.ascontiguousarray(blocks[:, :, :4]).view(np.float32)
    return (FP8_E4M3_VALUES[blocks[:, :, 4:]] * scales).reshape(rows, cols)


# Error: e4m3's 3 mantissa bits, step / sqrt(12) relative to a Gaussian block's values.
register(Scheme("fp8_e4m3", 8.25, BLOCK, BLOCK_BYTES, error=2.6e-2, scaled_sources=("F8_E4M3",),
                from_scaled=from_block_scaled, quantize=_quantize, dequantize=_dequantize,
                description="e4m3 with a float32 scale per 128 values (DeepSeek-V3's FP8, scales per row)"))
