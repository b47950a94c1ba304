"""Kernels for ``fp8_e4m3`` (e4m3 codes in blocks of 128 with a float32 scale each; layout in
``ktc.formats.codec_fp8``): the CPU's one-token kernel (``vnni.fp8_rows``, also what a MoE
layer's fused call and a layer's projections read fp8 rows with: ``rows.FP8``), its decode kernel
(Numba, each code's value from its bits) and the device decoder (torch's ``float8_e4m3fn``);
``kernels`` registers them under the scheme's name with several tokens through AMX where the CPU
has it (``amx.matmul``), and ``device`` the device decoder."""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, prange

from ktc.formats.codec_fp8 import BLOCK, BLOCK_BYTES
from ktc.formats.float_bits import bf16_bits
from ktc.formats.kernel_args import read_only

from . import vnni


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _matvec(raw, x, out):  # pragma: no cover - compiled
    # Rows through ``vnni.fp8_rows``, 16 a work item (the codes made floats in vectors; a table
    # of their values, looked up one at a time, read a matrix at a tenth of the read bandwidth).
    blocks = x.shape[0] // 128
    flat = raw.reshape(-1)
    rows, row_bytes = raw.shape
    x = vnni.without_denormals(x)  # the rows multiply x as floats: no denormal operands
    for item in prange((rows + 15) // 16):
        first = 16 * item
        vnni.fp8_rows(flat, first * row_bytes, row_bytes, min(16, rows - first), blocks, x, out, first)


@njit(cache=True, nogil=True, inline="always")
def _value(code):  # pragma: no cover - compiled
    # An e4m3 code's value from its bits, no table (a look-up a value kept LLVM from vectorizing
    # the decoder's loop): a normal code's exponent and mantissa are float32's shifted by 20 with
    # 120 added to the exponent; a subnormal's (exponent 0) is its mantissa times 2^-9. NaN codes
    # (0x7F, 0xFF; ktc's import refuses or replaces them) read as 480, as the one-token kernel's.
    magnitude = np.int32(code) & np.int32(0x7F)
    normal = np.int32((magnitude << np.int32(20)) + np.int32(120 << 23)).view(np.float32)
    value = normal if magnitude >= 8 else np.float32(magnitude) * np.float32(2.0 ** -9)
    return -value if code & np.uint8(0x80) else value


@njit(cache=True, nogil=True, parallel=True)
def decode_rows(raw, cols, bf16, out32, out16):  # pragma: no cover - compiled
    # the decode kernel (``kernels.block_decoder``)
    # A block's scale from its four bytes (a copy of them, viewed, allocated an array a block),
    # each output's loop apart.
    for r in prange(raw.shape[0]):
        for b in range(cols // 128):
            at = b * 132
            s = np.uint32(np.uint32(raw[r, at]) | (np.uint32(raw[r, at + 1]) << np.uint32(8))
                          | (np.uint32(raw[r, at + 2]) << np.uint32(16))
                          | (np.uint32(raw[r, at + 3]) << np.uint32(24))).view(np.float32)
            if bf16:
                for j in range(128):
                    out16[r, b * 128 + j] = bf16_bits(_value(raw[r, at + 4 + j]) * s)
            else:
                for j in range(128):
                    out32[r, b * 128 + j] = _value(raw[r, at + 4 + j]) * s


def matvec_rows(raw, x, out, scales):  # type: ignore[no-untyped-def]
    """One token (``kernels.CpuKernels.matvec``)."""
    _matvec(read_only(np.ascontiguousarray(raw, dtype=np.uint8)), np.ascontiguousarray(x, dtype=np.float32), out)
    return out


def device_decode(raw: Any, cols: int) -> Any:
    """The values of fp8 rows on a device (``device.register_device``)."""
    import torch

    blocks = raw.reshape(raw.shape[0], cols // BLOCK, BLOCK_BYTES)
    scales = blocks[..., :4].contiguous().view(torch.float32)
    return (blocks[..., 4:].contiguous().view(torch.float8_e4m3fn).float() * scales).reshape(raw.shape[0], cols)
