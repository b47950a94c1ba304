"""One token through weight matrices that share their input (a layer's query, key and value
projections), in one compiled call: the activations quantized once, and every matrix's rows in
one parallel region, 64 rows a work item over all of them, so both threads finish together.

Separate ``HostLinear.matvec`` calls quantized the same input three times and woke the kernels'
threads three times a layer; the Python between them ran among streaming weights that had
evicted it from the caches (a key projection of 590 KB took 45 us, about twice its read time).
For matrices of ``vnni.BLOCK_KINDS``, the K-quants, fp8_e4m3, int4 and bf16 (``rows.BF16``) on a VNNI CPU;
``Projections.of`` says None for anything else, and the caller runs each matrix's own kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numba import njit, prange

from ktc.formats.kernel_args import read_only

from . import rows, vnni


# Matrices one call takes. Every set is padded to this many (with empty ones, which no work item
# reaches), so that stack_token and _stack_rows are compiled for one tuple type: a decode step's
# query/key/value set and its output projection were two types, about 8 s of compiling each on
# two cores, paid again whenever the sources change.
STACK = 4
_EMPTY = read_only(np.zeros((0, 4), dtype=np.uint8))


class Projections:
    """Matrices (``HostLinear``) sharing one input, run together by ``__call__``."""

    def __init__(self, linears: Sequence[Any], kinds: list[int], raws: Sequence[np.ndarray]) -> None:
        # read-only views of every matrix: a tuple of arrays is one Numba type only when their
        # flags agree, and a GGUF's query and key rows, un-permuted from llama.cpp's rotary
        # order, are arrays of their own beside the bundle's read-only map
        # ... padded with empty matrices to STACK of them: a tuple's length is part of its type
        pad = STACK - len(linears)
        self.mats = tuple(read_only(raw) for raw in raws) + (_EMPTY,) * pad
        self.kinds = np.array(list(kinds) + [kinds[0]] * pad, dtype=np.int64)
        # int8 rows end in their float32 scale, read through a float32 view of the matrix;
        # every matrix gets a view of the same type (its first 4 bytes where it has no scale)
        self.f32s = tuple(raw.reshape(-1)[: raw.size if kind == 0 else 4].view(np.float32)
                          for raw, kind in zip(self.mats, self.kinds))
        heights = [int(lin.out_features) for lin in linears]
        self.splits = tuple(int(s) for s in np.cumsum(heights)[:-1])
        heights += [0] * pad
        self.starts = np.concatenate([[0], np.cumsum(heights)]).astype(np.int64)
        chunks = [(r + rows.ROWS_PER_ITEM - 1) // rows.ROWS_PER_ITEM for r in heights]
        self.chunk_starts = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int64)

    @classmethod
    def of(cls, linears: Sequence[Any], *, biases_apart: bool = False) -> Projections | None:
        """The set, or None where one call cannot take them: no VNNI, a scheme outside the block
        kinds, the K-quants, fp8_e4m3, int4 and bf16, inputs of different lengths, rows not C-contiguous uint8 (or,
        bf16's, uint16) arrays, biases (unless ``biases_apart``: the caller adds them to the
        outputs), more than ``STACK`` matrices."""
        if not vnni.HAVE_VNNI or not linears or len(linears) > STACK:
            return None
        # a matrix with an interleaved copy (``HostLinear.interleaved``) is read from it
        copies = [getattr(lin, "interleaved", None) for lin in linears]
        kinds = [rows.INTERLEAVED[lin.scheme] if copy is not None else rows.kind(lin.scheme, plain=True)
                 for lin, copy in zip(linears, copies)]
        cols = linears[0].in_features
        raws = [copy if copy is not None else _row_bytes(lin.raw) for lin, copy in zip(linears, copies)]
        if None in kinds or any(lin.in_features != cols or (lin.bias is not None and not biases_apart)
                                for lin in linears):
            return None
        if any(not isinstance(r, np.ndarray) or r.dtype != np.uint8 or r.ndim != 2 or not r.flags.c_contiguous
               for r in raws):
            return None
        if cols % 32 or (any(rows.KQUANT <= k < rows.BF16 for k in kinds) and cols % 256) or (  # type: ignore[operator]
                rows.FP8 in kinds and cols % 128) or any(rows.INT4 <= k < rows.Q4_0X16 and cols % (32 << (k - rows.INT4))
                                                         for k in kinds):  # type: ignore[operator]
            return None
        if any(k == 0 and r.size % 4 for k, r in zip(kinds, raws)):
            return None
        return cls(linears, kinds, raws)  # type: ignore[arg-type]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """The matrices' outputs for x (float32 [cols]), one after another: float32 [sum of rows]."""
        f16, e8m0 = vnni._tables()
        return stack_token(self.mats, self.f32s, self.kinds, self.starts, self.chunk_starts, f16, e8m0,
                           np.ascontiguousarray(x, dtype=np.float32))

    def split(self, out: np.ndarray) -> list[np.ndarray]:
        """``out`` of ``__call__`` cut into each matrix's part."""
        return np.split(out, self.splits)


def _row_bytes(raw: Any) -> Any:
    """A matrix's rows as bytes: bf16 matrices are kept as uint16 words (``HostLinear``)."""
    if isinstance(raw, np.ndarray) and raw.dtype == np.uint16 and raw.ndim == 2 and raw.flags.c_contiguous:
        return raw.view(np.uint8)
    return raw


@njit(cache=True, nogil=True)
def stack_token(mats, f32s, kinds, starts, chunk_starts, f16, e8m0, x):  # pragma: no cover - compiled
    """``Projections.__call__`` compiled, callable from other compiled steps."""
    out = np.empty(starts[-1], np.float32)
    _stack_rows(mats, f32s, kinds, starts, chunk_starts, f16, e8m0, x.shape[0],
                rows.activations(x, 1, x.shape[0], kinds), out)
    return out


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _stack_rows(mats, f32s, kinds, starts, chunk_starts, f16, e8m0, cols, act, out):  # pragma: no cover - compiled
    # out[starts[m] + r] = row r of matrix m . the activations, ROWS_PER_ITEM rows a work item
    # over all (``vnni.work_item``: both threads finish together), a thread's scratch allocated
    # once.
    threads = vnni.thread_count()
    counters = vnni.work_counters(threads)
    for t in prange(threads):
        acc = np.zeros(16, np.float32)
        while True:
            item = vnni.work_item(counters, t, threads, chunk_starts[-1])
            if item < 0:
                break
            m = 0
            while item >= chunk_starts[m + 1]:
                m += 1
            raw = mats[m]
            first = (item - chunk_starts[m]) * rows.ROWS_PER_ITEM
            rows.rows(kinds[m], raw.reshape(-1), f32s[m], f16, e8m0, 0, raw.shape[1], first,
                      min(raw.shape[0], first + rows.ROWS_PER_ITEM), cols, act, 0, out[starts[m]:starts[m + 1]], acc)
