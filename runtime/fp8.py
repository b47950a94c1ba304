"""Kernels for ``fp8_e4m3`` (e4m3 codes in blocks of 128 with a float32 scale each; layout in
``ktc.formats.codec_fp8``): the CPU's one-token and decode kernels (Numba, a table of the 256
code values) and the device decoder (torch's ``float8_e4m3fn``), registered under the scheme's
name."""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, prange

from ktc.formats.codec_fp8 import BLOCK, BLOCK_BYTES
from ktc.formats.dequant import FP8_E4M3_VALUES
from ktc.formats.kernel_args import read_only

from .device import register_device
from .kernels import CpuKernels, _put, block_decoder, register_cpu


@njit(cache=True, nogil=True, inline="always")
def _scale(raw, r, at):  # pragma: no cover - compiled
    return raw[r, at: at + 4].copy().view(np.float32)[0]


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _matvec(raw, x, table, out):  # pragma: no cover - compiled
    blocks = x.shape[0] // 128
    for r in prange(raw.shape[0]):
        total = np.float32(0.0)
        for b in range(blocks):
            base = b * 132
            acc = np.zeros(16, np.float32)
            for j in range(0, 128, 16):
                for lane in range(16):
                    acc[lane] += table[raw[r, base + 4 + j + lane]] * x[b * 128 + j + lane]
            total += _scale(raw, r, base) * acc.sum()
        out[r] = total


@njit(cache=True, nogil=True, parallel=True)
def _decode(raw, cols, table, bf16, out32, out16):  # pragma: no cover - compiled
    for r in prange(raw.shape[0]):
        for b in range(cols // 128):
            s = _scale(raw, r, b * 132)
            for j in range(128):
                _put(bf16, out32, out16, r, b * 128 + j, table[raw[r, b * 132 + 4 + j]] * s)


def _matvec_rows(raw, x, out, scales):  # type: ignore[no-untyped-def]
    _matvec(read_only(np.ascontiguousarray(raw, dtype=np.uint8)), x, FP8_E4M3_VALUES, out)
    return out


def _device_decode(raw: Any, cols: int) -> Any:
    import torch

    blocks = raw.reshape(raw.shape[0], cols // BLOCK, BLOCK_BYTES)
    scales = blocks[..., :4].contiguous().view(torch.float32)
    return (blocks[..., 4:].contiguous().view(torch.float8_e4m3fn).float() * scales).reshape(raw.shape[0], cols)


register_cpu("fp8_e4m3", CpuKernels(_matvec_rows, block_decoder(_decode, FP8_E4M3_VALUES)))
register_device("fp8_e4m3", _device_decode)
