"""One token through weight matrices that share their input (a layer's query, key and value
projections), in one compiled call: the activations quantized once, and every matrix's rows in
one parallel region, 64 rows a work item over all of them, so both threads finish together.

Separate ``HostLinear.matvec`` calls quantized the same input three times and woke the kernels'
threads three times a layer; the Python between them ran among streaming weights that had
evicted it from the caches (a key projection of 590 KB took 45 us, about twice its read time).
For matrices of ``vnni.BLOCK_KINDS`` and the K-quants on a VNNI CPU; ``Projections.of`` says
None for anything else, and the caller runs each matrix's own kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numba import njit, prange

from . import kquants, vnni

# Kind codes: vnni.BLOCK_KINDS (0-3), then the K-quants from _KQUANT on (kquants.KINDS + _KQUANT).
_KQUANT = 4
# q4_k and q6_k read the activations quantized per 256 too
_Q4_K, _Q6_K = _KQUANT + kquants.KINDS["q4_k"], _KQUANT + kquants.KINDS["q6_k"]
_ROWS_PER_ITEM = 64


def _kind(scheme: str) -> int | None:
    if scheme in vnni.BLOCK_KINDS:
        return vnni.BLOCK_KINDS[scheme]
    if scheme in vnni.KQUANTS:
        return _KQUANT + kquants.KINDS[scheme]
    return None


class Projections:
    """Matrices (``HostLinear``) sharing one input, run together by ``__call__``."""

    def __init__(self, linears: Sequence[Any], kinds: list[int]) -> None:
        self.mats = tuple(lin.raw for lin in linears)
        self.kinds = np.array(kinds, dtype=np.int64)
        # int8 rows end in their float32 scale, read through a float32 view of the matrix;
        # every matrix gets a view of the same type (its first 4 bytes where it has no scale)
        self.f32s = tuple(raw.reshape(-1)[: raw.size if kind == 0 else 4].view(np.float32)
                          for raw, kind in zip(self.mats, kinds))
        rows = [int(lin.out_features) for lin in linears]
        self.starts = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        chunks = [(r + _ROWS_PER_ITEM - 1) // _ROWS_PER_ITEM for r in rows]
        self.chunk_starts = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int64)
        # int8, q8_0 and the K-quants but q4_k and q6_k read the activations per 32 in order,
        # q4_0 and mxfp4 in quad_layout; q2_k and q3_k their sums per 16 too
        self.in_order = any(k < 2 or (k >= _KQUANT and k not in (_Q4_K, _Q6_K)) for k in kinds)
        self.in_quads = any(k in (2, 3) for k in kinds)
        self.sums16 = any(k in (_KQUANT + kquants.KINDS["q2_k"], _KQUANT + kquants.KINDS["q3_k"]) for k in kinds)
        self.splits = tuple(int(s) for s in self.starts[1:-1])

    @classmethod
    def of(cls, linears: Sequence[Any]) -> Projections | None:
        """The set, or None where one call cannot take them: no VNNI, a scheme outside the block
        kinds and the K-quants, inputs of different lengths, rows not C-contiguous uint8 of one
        kind of array, biases."""
        if not vnni.HAVE_VNNI or not linears:
            return None
        kinds = [_kind(lin.scheme) for lin in linears]
        cols = linears[0].in_features
        raws = [lin.raw for lin in linears]
        if None in kinds or any(lin.in_features != cols or lin.bias is not None for lin in linears):
            return None
        if any(not isinstance(r, np.ndarray) or r.dtype != np.uint8 or r.ndim != 2 or not r.flags.c_contiguous
               or r.flags.writeable != raws[0].flags.writeable for r in raws):
            return None
        if cols % 32 or (any(k >= _KQUANT for k in kinds) and cols % 256):  # type: ignore[operator]
            return None
        if any(k == 0 and r.size % 4 for k, r in zip(kinds, raws)):
            return None
        return cls(linears, kinds)  # type: ignore[arg-type]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """The matrices' outputs for x (float32 [cols]), one after another: float32 [sum of rows]."""
        f16, e8m0 = vnni._tables()
        return stack_token(self.mats, self.f32s, self.kinds, self.starts, self.chunk_starts, self.in_order,
                           self.in_quads, self.sums16, f16, e8m0, np.ascontiguousarray(x, dtype=np.float32))

    def split(self, out: np.ndarray) -> list[np.ndarray]:
        """``out`` of ``__call__`` cut into each matrix's part."""
        return np.split(out, self.splits)


@njit(cache=True, nogil=True)
def stack_token(mats, f32s, kinds, starts, chunk_starts, in_order, in_quads, sums16, f16, e8m0,
                x):  # pragma: no cover - compiled
    """``Projections.__call__`` compiled, callable from other compiled steps."""
    cols = x.shape[0]
    xq, quads, dx, sums = vnni._quantized_both(x, 1, cols, in_order, in_quads)
    # the block kinds' per-lane activation terms, where one reads them
    lanes = vnni._lanes(dx, sums) if (kinds < _KQUANT).any() else np.zeros((1, 0), np.float32)
    isum16 = np.empty(cols // 16, np.float32)
    dsum16 = np.empty(cols // 16, np.float32)
    if sums16:
        kquants._sums16(xq[0], dx[0], isum16, dsum16)
    layout, natural = (kinds == _Q4_K).any(), (kinds == _Q6_K).any()
    yk, dk, bsum = kquants.superblock_activations(x, 1, cols, layout, natural)
    out = np.empty(starts[-1], np.float32)
    _stack_rows(mats, f32s, kinds, starts, chunk_starts, f16, e8m0, xq[0], quads[0], dx[0], sums[0], lanes[0],
                isum16, dsum16, yk[0], dk[0], bsum[0], out)
    return out


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _stack_rows(mats, f32s, kinds, starts, chunk_starts, f16, e8m0, xq, quads, dx, xsum, lanes, isum16, dsum16,
                yk, dk, bsum, out):  # pragma: no cover - compiled
    # out[starts[m] + r] = row r of matrix m . the activations, 64 rows a work item over all.
    cols = xq.shape[0]
    for item in prange(chunk_starts[-1]):
        m = 0
        while item >= chunk_starts[m + 1]:
            m += 1
        raw = mats[m]
        kind = kinds[m]
        rows, row_bytes = raw.shape
        first = (item - chunk_starts[m]) * _ROWS_PER_ITEM
        last = min(rows, first + _ROWS_PER_ITEM)
        dest = out[starts[m]:starts[m + 1]]
        flat = raw.reshape(-1)
        if kind < _KQUANT:
            vnni._block_rows(kind, flat, f32s[m], f16, e8m0, 0, row_bytes, first, last,
                             quads if kind >= 2 else xq, dx, xsum, lanes, dest)
            continue
        for r in range(first, last):
            dest[r] = kquants._k_row(flat, kind - _KQUANT, r * row_bytes, cols // 256, xq, dx, xsum, isum16, dsum16,
                                     yk, dk, bsum)
