"""The plain float schemes: f32, f16, bf16 (rounded to nearest even, as ggml does)."""

from __future__ import annotations

import numpy as np

from .float_bits import f32_to_bf16_bits
from .scheme import Scheme, register


def _rows(raw: np.ndarray, cols: int, dtype: type) -> np.ndarray:
    return np.ascontiguousarray(raw, dtype=np.uint8).view(dtype).reshape(raw.shape[0], cols)


def _plain_bytes(values: np.ndarray) -> np.ndarray:
    return values.view(np.uint8).reshape(values.shape[0], -1)


# Half a unit in the last place, relative: the nominal error of each float type.
register(
    Scheme("f32", 32, 1, 4, error=0.0, sources=("F32",), description="IEEE float32",
           quantize=lambda x, out=None: _plain_bytes(x),
           dequantize=lambda raw, cols: _rows(raw, cols, np.float32).copy()),
    Scheme("f16", 16, 1, 2, error=2.8e-4, sources=("F16",), description="IEEE float16",
           quantize=lambda x, out=None: _plain_bytes(x.astype(np.float16)),
           dequantize=lambda raw, cols: _rows(raw, cols, np.float16).astype(np.float32)),
    Scheme("bf16", 16, 1, 2, error=2.3e-3, sources=("BF16",), description="bfloat16",
           quantize=lambda x, out=None: _plain_bytes(f32_to_bf16_bits(x)),
           dequantize=lambda raw, cols: (_rows(raw, cols, np.uint16).astype(np.uint32) << 16).view(np.float32)),
)
