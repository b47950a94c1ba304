"""Quantize and dequantize 2-D weights [rows, cols] in any registered scheme, and convert a source
tensor to a scheme (its stored bytes when they already are that scheme).

Each scheme's codec lives with its registry entry (``schemes.py`` and the ``codec_*`` modules;
``docs/bundle-format.md`` gives the byte layouts); this module is the one entry point the
compiler and the runtime call.
"""

from __future__ import annotations

import numpy as np

from ktc.errors import FormatError
from ktc.ir import TensorRef

from .float_bits import bf16_bits, bf16_value, f32_to_bf16_bits, f32_to_f16_bits  # noqa: F401  (re-exported)
from .codec_int import INT4_STEPS  # noqa: F401  (re-exported)
from .dequant import to_float32
from .kernel_args import read_only
from .schemes import Scheme, get_scheme, source_scheme


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
    x = read_only(np.ascontiguousarray(values, dtype=np.float32))  # one type for the codecs' kernels
    if x.ndim != 2:
        raise ValueError(f"quantize takes a 2-D matrix, not shape {x.shape}")
    if not scheme.fits(x.shape[1]):
        raise FormatError(f"scheme {scheme.name} needs rows that are a multiple of "
                          f"{scheme.block_elems} values; this row has {x.shape[1]}")
    if scheme.quantize is None:
        raise FormatError(f"scheme {scheme.name} has no quantizer: it passes through from "
                          f"{', '.join(scheme.sources)} tensors only")
    return scheme.quantize(x, out)


def dequantize(raw: np.ndarray, scheme: Scheme | str, cols: int) -> np.ndarray:
    """Float32 [rows, cols] from bytes [rows, row_bytes] in ``scheme`` (its reference decoder)."""
    scheme = get_scheme(scheme) if isinstance(scheme, str) else scheme
    return scheme.dequantize(np.ascontiguousarray(raw, dtype=np.uint8), cols)


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
    if ref.dtype in scheme.sources and ref.scale is None:
        raw = np.ascontiguousarray(ref.load())
        if finite:
            check_finite(raw, ref.name, ref.dtype)
        return raw.view(np.uint8).reshape(ref.shape[0], -1)
    if ref.scale is not None and ref.dtype in scheme.scaled_sources and scheme.from_scaled is not None:
        return scheme.from_scaled(ref, 0, ref.shape[0], finite)
    values = to_float32(ref)
    if finite:
        check_finite(values, ref.name)
    return _quantize(values, scheme, out)


_FLOAT_BITS = {"F32": (np.uint32, 0x7F800000), "F16": (np.uint16, 0x7C00), "BF16": (np.uint16, 0x7F80)}


def check_finite(values: np.ndarray, name: str, dtype: str = "F32") -> None:
    """Refuse a tensor holding NaN or Inf, naming it. ``values`` are float32 (a source decoded to
    be quantized), the stored elements of an ``F32``/``F16``/``BF16`` source passed through, or
    the stored blocks of a block scheme's source type (``Q8_0``, ``Q4_K``, ``MXFP4``...: their
    fp16 or e8m0 scales are checked, as the scheme's registry entry places them; a block's values
    are finite when its scales are). Runs on values already in memory: no extra read of the
    checkpoint. A float32 sum is the quick test (10 ms for 235 MB here, half of
    ``isfinite().all()``); only a non-finite sum, which a huge finite value can also give, counts
    element by element."""
    if values.size == 0:
        return
    scheme = source_scheme(dtype)
    if scheme is not None and (scheme.half_scales or scheme.e8m0_scales):
        raw = np.ascontiguousarray(values).view(np.uint8).reshape(-1)
        if raw.size % scheme.block_bytes:
            return  # not whole blocks: the reader's own checks speak about that
        blocks = raw.reshape(-1, scheme.block_bytes)
        bad_blocks = np.zeros(blocks.shape[0], dtype=bool)
        for at in scheme.e8m0_scales:
            bad_blocks |= blocks[:, at] == 0xFF  # e8m0's NaN
        for at in scheme.half_scales:
            scales = np.ascontiguousarray(blocks[:, at:at + 2]).view(np.uint16).reshape(-1)
            bad_blocks |= (scales & 0x7C00) == 0x7C00
        if bad := int(np.count_nonzero(bad_blocks)):
            raise FormatError(f"{bad} of {blocks.shape[0]} {dtype} blocks have a NaN or infinite scale",
                              tensor=name, hint="fix the checkpoint, or compile it anyway with --allow-nonfinite")
        return
    if dtype not in _FLOAT_BITS:
        return
    if dtype == "F32" and values.dtype == np.float32:
        with np.errstate(over="ignore", invalid="ignore"):  # an overflowing sum is the slow path, not a warning
            total = np.sum(values, dtype=np.float32)
        if np.isfinite(total):
            return
    uint, exponent = _FLOAT_BITS[dtype]
    bad = int(np.count_nonzero((np.ascontiguousarray(values).view(uint) & exponent) == exponent))
    if bad:
        raise FormatError(f"{bad} of {values.size} values are NaN or infinite", tensor=name,
                          hint="fix the checkpoint, or compile it anyway with --allow-nonfinite")
