"""q4_0, q8_0, mxfp4 and q4_k matrices laid out for the CPU's products: rows interleaved 16 at
a time (``repack``).

In ggml's q4_0 layout each row is a run of 18-byte blocks (an fp16 scale, then 16 bytes of
4-bit codes). A one-token product of such rows (``vnni._row_intrinsic``) takes a row at a time:
each 72-byte step of four blocks costs two unaligned loads, a permute to gather the codes, the
scales picked and converted, the activations' per-lane scales and sums loaded, two products and
two multiply-adds, for 128 weights. Read from L2 on the Zen 4 machine that bounds a core at about
26 GB/s, below what two cores read from memory in its fast phases (60-70 GB/s): the kernels,
not the memory, set the decode speed there. q8_0's 34-byte blocks and mxfp4's 17-byte ones fare
the same way (two cores 41-50 and 21-27 GB/s from the caches). llama.cpp's CPU backend meets
the same bound the same way: it copies q4_0 tensors into interleaved groups of rows when it loads
them (``--repack``, on by default; its Q4_0 decode of a two-layer Qwen3-30B-A3B-shaped model
fell from 132-152 to 74-83 tok/s here without it).

Here 16 rows make a group, and the group's blocks go in units whose scales fill one 64-byte
line (``Layout``): pairs of fp16 scales' blocks (block b's for rows 0-15, then block b+1's),
fours of mxfp4's e8m0 bytes; then for each block its codes in lines of 4 bytes a row: q4_0's and
mxfp4's four lines, line k holding bytes 4k..4k+3 of each row's 16 code bytes (row r at bytes
4r..4r+3); q8_0's eight, its codes plus 128 (``vpdpbusd`` multiplies unsigned bytes by signed
ones; the offset times the activations' sum comes off, as q4_0's 8 does, and mxfp4's 12 after
its codes are looked up as twice their values plus 12, ``vnni.E2M1_TWICE_PLUS_12``). One
product (``vpdpbusd``) then multiplies 16 rows' codes by four activations broadcast to every
lane, a block's scales convert once for 16 rows, and every load is a whole aligned line of one
stream: q4_0 from L2 55 GB/s a core against 26; from memory, one Qwen3-30B-A3B-shaped output
matrix (151936 x 2048) on two cores 69 against 42 GB/s in a fast phase (a 1 or 2 thread sweep of
prototypes with and without software prefetch; the hardware prefetcher follows the single
stream best, so there is none); q8_0 from the caches on two cores 68-90 against 33-41 GB/s,
mxfp4 46-64 against 21-27. The bytes are the same ones, reordered (q8_0's codes offset): a group
is ``16 * row_bytes`` bytes.

Rows of whole blocks that do not fill whole units take a tail (``fits(..., tail=True)``; only
``ExpertSet`` and the calibration's expert probe make such copies): the copy fills each row's last unit out with blocks of zero
bytes (``copy_row_bytes``), and the tiles read that unit's blocks up to the row's own, never the
activations past them. gpt-oss's experts have rows of 2880 values, 22.5 units of mxfp4's 128:
their copy is 2.2% larger than the stored rows, and one token through a 5760 x 2880 matrix in the
caches ran 81-83 GB/s against the stored rows' 34 (two cores, medians of 15 rounds of 50 calls).

q4_k's super-blocks (256 values, 144 bytes a row) go the same way, each group's super-block its
16 rows' 36 four-byte words word by word (``_k_tile_intrinsic``): the codes a line of 16 rows at a
time as q4_0's, the 6-bit scales and minimums unpacked for 16 rows at once. From the caches on
two cores 61-72 GB/s against 25-30 for the stored rows; from memory, a Mixtral-8x7B-shaped
expert's matrices in the slow phase (34 GB/s) 30-32 against 27-29; unlike q4_0's, one token's
tile asks for its lines 8 KB ahead into L2 (``K_ONE_AHEAD``). Many tokens (from
``K_LANES_MIN_TOKENS``) go to the stored layout's lanes (``runtime.lanes``, through
``kernels.interleaved_linear``), each chunk of rows put back in the stored layout in the worker's
buffer first: a tile of a few tokens' products
per line made 0.8x the lanes' GOP/s at 96 tokens.

``repack`` makes the copy (``HostLinear`` does when it loads a matrix of these on a VNNI CPU:
``runtime.linear``; ``ExpertSet`` for a layer of experts all in one of them; both release the
map's pages of what they copied, ``Bundle.release``), ``unpack`` undoes it, ``matvec`` and
``matmul`` multiply one token or several (from ``PER_256_MIN_TOKENS`` tokens on with the
activations quantized per 256, as the stored layout's products of as many tokens; q4_k's always
per 256), and ``rows`` (``k_rows``) is the one-token product of a run of groups for
``runtime.rows``' kinds ``rows.INTERLEAVED`` (projections that share their input in one parallel
region).
"""

from __future__ import annotations

from functools import reduce
from typing import NamedTuple

import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ktc.formats.bundle import anonymous_memory
from ktc.formats.kernel_args import read_only, writable

from . import vnni

GROUP = 16  # rows interleaved together


class Layout(NamedTuple):
    """A scheme's interleaved layout: bytes of its block (a scale, then 32 codes), of the
    block's scale (fp16, or mxfp4's e8m0 byte), the blocks of a unit (whose 16 rows' scales fill
    one 64-byte line), whether its codes are 4-bit, and the offset that makes them unsigned
    (``vpdpbusd`` multiplies unsigned bytes by signed ones; q8_0's codes are stored plus 128,
    mxfp4's looked up as twice their value plus 12: ``vnni.E2M1_TWICE_PLUS_12``)."""

    block: int
    scale_bytes: int
    unit: int
    nibbles: bool
    offset: int


LAYOUTS = {"q4_0": Layout(18, 2, 2, True, 8), "q8_0": Layout(34, 2, 2, False, 128),
           "mxfp4": Layout(17, 1, 4, True, 12)}
BLOCK_SCHEMES = tuple(LAYOUTS)
# q4_k's super-blocks (``_k_tile_intrinsic``, below)
K_SCHEMES = ("q4_k",)
K_BLOCK, K_WORDS = 144, 36  # bytes of a row's super-block; its four-byte words
SCHEMES = BLOCK_SCHEMES + K_SCHEMES  # the schemes interleaved; a scheme's code in the kernels is its place here
_OFFSETS = tuple(lay.offset for lay in LAYOUTS.values())
# ``matmul``'s tile: each line of codes (of TILE_GROUPS groups), unpacked once, multiplied by
# TILE_TOKENS tokens' activations, each broadcast once for the groups' lines. Measured (medians
# of 7 interleaved calls, two threads, GOP/s; the stored layout's products, ``kernels.linear``,
# in the same runs: q8_0 721-726 at 28672 x 4096 and 96 tokens, 652-684 at 4096 x 14336, q4_0
# 708-724 and 662-676), activations per 256: q8_0 4 tokens x 2 groups 758 and 728, 6 x 1 738
# and 707, 8 x 1 642 and 618 (registers spilled), q4_0 4 x 2 698 and 675, 8 x 1 706 and 689; at
# Qwen3-30B-A3B's expert shapes (1536 x 2048, 2048 x 768, 48 tokens) 640-720 against 440-560.
# Per 32 at 8 tokens a step q8_0 made 545 and 526 (a block's sums less its offset in float,
# per token, outweigh its products).
TILE_TOKENS, TILE_GROUPS = 4, 2
GROUPS_PER_ITEM = 4  # groups a parallel work item (64 rows, as rows.ROWS_PER_ITEM)
# Tokens from which ``matmul`` quantizes the activations per 256 values: kernels.LANES_MIN_TOKENS'
# for the schemes, where the stored layout's products of as many tokens do (``lanes.token_span``)
PER_256_MIN_TOKENS = {"q4_0": 12, "q8_0": 8, "mxfp4": 12}


# int8 rows (int8 codes, then a float32 row scale) have no interleaved layout of their own: on a
# VNNI CPU their copy is q8_0's (``int8_as_q8_0``), every block of a row taking the row's scale
# rounded to fp16 (a relative change of at most 2^-11, fp16's rounding, where the scale is one of
# fp16's normal numbers or zero: ``int8_copies`` says whether every row's is). Stored, a
# prompt chunk's int8 experts of a few tokens each ran one by one through the lanes (4 tokens
# and more) or row by row: a two-layer Qwen3-30B-A3B-shaped model prefilled 64 tokens at 1.16-
# 1.28x llama.cpp's Q8_0 tokens/s and decoded at 1.04-1.05x (``benchmarks/generate.py``, two
# runs); from the copies 2.31x and 1.26x (one run), a layer's 64-token MoE block 28-32 ms
# against 50-75.
COPIES = {"int8": "q8_0"}


def copy_scheme(scheme: str) -> str:
    """The scheme whose interleaved layout a copy of ``scheme``'s rows takes (``COPIES``)."""
    return COPIES.get(scheme, scheme)


def int8_copies(raw: np.ndarray) -> bool:
    """Whether int8 rows ``raw`` (uint8 [rows, cols + 4]) may be read from a q8_0 copy: every
    row scale zero or a normal fp16 number (so rounded to fp16 it moves by at most 2^-11)."""
    scales = np.abs(np.ascontiguousarray(raw[:, -4:]).view(np.float32)[:, 0])
    return bool(np.all((scales == 0) | ((scales >= np.finfo(np.float16).tiny) & (scales <= np.finfo(np.float16).max))))


def int8_as_q8_0(raw: np.ndarray) -> np.ndarray:
    """int8 rows ``raw`` (uint8 [rows, cols + 4]: codes, then a float32 scale) as q8_0 rows
    (uint8 [rows, cols / 32 * 34]): each block of 32 codes after the row's scale in fp16."""
    rows, row_bytes = raw.shape
    cols = row_bytes - 4
    scales = np.ascontiguousarray(raw[:, cols:]).view(np.float32)[:, 0].astype(np.float16)
    out = np.empty((rows, cols // 32, 34), dtype=np.uint8)
    out[:, :, :2] = scales.view(np.uint8).reshape(rows, 1, 2)
    out[:, :, 2:] = np.asarray(raw[:, :cols]).reshape(rows, cols // 32, 32)
    return out.reshape(rows, cols // 32 * 34)


def copy_row_bytes(scheme: str, row_bytes: int) -> int:
    """Bytes a row of the interleaved copy of ``scheme``'s rows of ``row_bytes`` bytes (int8's:
    its codes as q8_0's blocks): a block scheme's rows filled out to whole units of blocks
    (``repack``'s tail)."""
    if scheme in K_SCHEMES:
        return row_bytes
    lay = LAYOUTS[copy_scheme(scheme)]
    blocks = (row_bytes - 4) // 32 if scheme in COPIES else row_bytes // lay.block
    return -(-blocks // lay.unit) * lay.unit * lay.block


def _layout(scheme: str) -> Layout:
    if scheme not in SCHEMES:
        raise ValueError(f"only {', '.join(SCHEMES)} rows are interleaved, not {scheme}")
    return LAYOUTS[scheme]


def _row_values(scheme: str) -> int:
    # the values of a row that make a whole unit of blocks (q4_k: a super-block)
    return 256 if scheme in K_SCHEMES else 32 * _layout(scheme).unit


def fits(rows: int, cols: int, scheme: str, tail: bool = False) -> bool:
    """Whether a [rows, cols] matrix of ``scheme`` (one of ``SCHEMES``, or int8: ``COPIES``) can
    be interleaved: whole groups of rows, whole units of blocks (q4_k: super-blocks) in a row;
    with ``tail``, a block scheme's rows of whole blocks too, their last unit filled out (the
    copy's rows ``copy_row_bytes`` long: gpt-oss's rows of 2880 values are 22.5 units of
    mxfp4's 128). Only ``ExpertSet`` takes those (and the calibration's expert probe, which reads
    what it reads): ``HostLinear`` and the matrix probe read such rows as stored."""
    values = 32 if tail and copy_scheme(scheme) in LAYOUTS else _row_values(copy_scheme(scheme))
    return rows > 0 and rows % GROUP == 0 and cols > 0 and cols % values == 0


# Copies of this many bytes or more start on a huge page's boundary (``aligned_empty``).
_HUGE_PAGE = 2 << 20


def aligned_empty(nbytes: int) -> np.ndarray:
    """uint8 [nbytes] starting on a cache line, and from 2 MB on a huge page's boundary of memory
    advised for huge pages (``bundle.anonymous_memory``), so that all of the copy lies in them
    where Linux gives them: the products read faster from huge pages. Qwen3-30B-A3B's q4_0 output
    matrix (151936 x 2048, 166 MB copied) took 5.5-5.6 ms a product from them, 5.9-6.3 from 4 KB
    pages (a private map; medians of 40 alternating calls, two runs); its query projection (4096
    x 2048, 4.7 MB copied, 48 copies read in turn so that each comes from memory) 150-159 us from
    huge pages only, 157-178 as numpy places an array (on a page past a 16-byte header, so that
    only its whole 2 MB spans inside were huge pages) and 157-174 from 4 KB pages (medians of 12
    alternating rounds, two runs). The cost: up to a huge page less a byte of memory touched
    beyond the copy's end. A huge page's first touch can cost more here (`docs/runtime.md`)."""
    boundary = _HUGE_PAGE if nbytes >= _HUGE_PAGE else 64
    # room for the copy from any start, and for the whole of the last huge page it reaches into
    size = (nbytes + 2 * boundary - 1) // boundary * boundary
    buffer = (np.frombuffer(anonymous_memory(size), dtype=np.uint8) if boundary == _HUGE_PAGE
              else np.empty(size, dtype=np.uint8))
    start = -buffer.ctypes.data % boundary
    return buffer[start:start + nbytes]


def repack(raw: np.ndarray, scheme: str, rows_at_once: int = 4096, out: np.ndarray | None = None) -> np.ndarray:
    """The interleaved copy (uint8 [rows, ``copy_row_bytes``], on a cache line) of ``scheme``'s
    rows ``raw`` (uint8 [rows, row_bytes]; ``fits``, with its ``tail``), made ``rows_at_once``
    rows a call (``_repack_units``, ``_repack_words``: straight into the copy, no scratch); into
    ``out`` (C-contiguous) where given. int8 rows go into q8_0's layout (``int8_as_q8_0``). A
    row of blocks that do not fill whole units has its last unit filled out with blocks of zero
    bytes, which the kernels never read (their activations do not exist): the tail."""
    if scheme in COPIES:
        rows = raw.shape[0]
        if out is None:
            out = aligned_empty(rows * copy_row_bytes(scheme, raw.shape[1])).reshape(rows, -1)
        step = max(GROUP, rows_at_once // GROUP * GROUP)
        for first in range(0, rows, step):  # a chunk of rows at a time, as below
            repack(int8_as_q8_0(raw[first:first + step]), COPIES[scheme], rows_at_once, out[first:first + step])
        return out
    rows, row_bytes = raw.shape
    block, values = (K_BLOCK, 256) if scheme in K_SCHEMES else (_layout(scheme).block, 32)
    if raw.dtype != np.uint8 or row_bytes % block or not fits(rows, row_bytes // block * values, scheme, tail=True):
        raise ValueError(f"{scheme} rows {raw.shape} cannot be interleaved by {GROUP} (rows a multiple of {GROUP}, "
                         f"whole blocks of {values} values a row)")
    width = copy_row_bytes(scheme, row_bytes)
    if out is None:
        out = aligned_empty(rows * width).reshape(rows, width)
    elif out.shape != (rows, width) or out.dtype != np.uint8 or not out.flags.c_contiguous:
        raise ValueError(f"an interleaved copy of {raw.shape} rows goes into uint8 {(rows, width)}, "
                         f"not {out.dtype} {out.shape}")
    step = max(GROUP, rows_at_once // GROUP * GROUP)
    lay = LAYOUTS.get(scheme)
    for first in range(0, rows, step):
        part, target = np.asarray(raw[first:first + step]), out[first:first + step]
        if lay is None:  # q4_k
            _repack_words(part, target, K_BLOCK, K_WORDS)
        else:
            _repack_units(part, target, lay.block, lay.scale_bytes, lay.unit, scheme == "q8_0")
    return out


# Compiled, both threads a group of rows at a time, a four-byte word a load: numpy's transposes
# (each reshape of a transposed view a copy of its own, four bytes at a time) copied a Qwen3-30B-
# A3B-shaped expert's gate/up rows (1536 x 2048) at 0.4-0.8 GB/s from the caches, this 2.2-2.9
# (q4_0), 4.3-4.4 (q8_0), 13-17 (q4_k); a four-layer Qwen3-shaped Q4_0 model's load (1.7 GB of
# experts) took 2.2 s of copies against 5.3, and a whole Qwen3-30B-A3B's 16 GB would have taken
# close to a minute at every start.


@njit(cache=True, nogil=True, inline="always")
def _word(src, at, flip):  # pragma: no cover - compiled
    # the four bytes of src (uint8) at ``at`` as one uint32, each plus 128 where ``flip`` (q8_0's
    # codes): one load where compiled (_load_word), the same from its four bytes without the JIT.
    # Compiled from the four bytes too, LLVM did not make them one load: the copies 1.5-3x slower.
    if vnni._COMPILED:
        word = _load_word(src, at)
    else:
        word = (np.uint32(src[at]) | (np.uint32(src[at + 1]) << np.uint32(8))
                | (np.uint32(src[at + 2]) << np.uint32(16)) | (np.uint32(src[at + 3]) << np.uint32(24)))
    return word ^ np.uint32(0x80808080) if flip else word


@intrinsic
def _load_word(typingctx, src, at):  # type: ignore[no-untyped-def]
    """src[at:at + 4] (uint8) as one uint32, at any alignment."""
    from llvmlite import ir

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        (src_a,) = vnni._arrays(context, builder, signature, args, (0,))
        (at_v,) = vnni._indices(context, builder, signature, args, (1,))
        return builder.load(builder.bitcast(builder.gep(src_a.data, [at_v]), ir.IntType(32).as_pointer()), align=1)

    return types.uint32(src, at), codegen


@njit(cache=True, nogil=True, parallel=True)
def _repack_units(raw, out, block, scale_bytes, unit, flip):  # pragma: no cover - compiled
    # A block scheme's groups of GROUP rows, each unit of ``unit`` blocks (out's rows may be
    # longer than raw's: the last unit's missing blocks read as zero bytes) as one line of the
    # 16 rows' scales ([block of the unit, row, scale byte]) and then their codes four bytes at a
    # time ([block of the unit, word, row, byte]); q8_0's codes (``flip``) plus 128.
    row_bytes, width = raw.shape[1], out.shape[1]
    code_words = (block - scale_bytes) // 4
    units = width // block // unit
    unit_bytes = GROUP * unit * block
    flat = out.reshape(-1)
    words = flat.view(np.uint32)  # a unit's bytes are a multiple of 64, and out starts on a word
    for g in prange(raw.shape[0] // GROUP):
        rows = raw[g * GROUP:(g + 1) * GROUP]
        for u in range(units):
            at = (g * units + u) * unit_bytes
            for j in range(unit):
                first = (u * unit + j) * block
                if first + block > row_bytes:  # the tail
                    for c in range(GROUP * scale_bytes):
                        flat[at + j * GROUP * scale_bytes + c] = 0
                    for c in range(GROUP * 4 * code_words):
                        flat[at + 64 + j * GROUP * 4 * code_words + c] = np.uint8(128) if flip else np.uint8(0)
                    continue
                for r in range(GROUP):
                    for c in range(scale_bytes):
                        flat[at + (j * GROUP + r) * scale_bytes + c] = rows[r, first + c]
                for w in range(code_words):  # each word's 16 rows: 64 bytes in a row
                    to = (at + 64) // 4 + (j * code_words + w) * GROUP
                    src = first + scale_bytes + 4 * w
                    for r in range(GROUP):
                        words[to + r] = _word(rows[r], src, flip)


@njit(cache=True, nogil=True, parallel=True)
def _repack_words(raw, out, block, words):  # pragma: no cover - compiled
    # q4_k's groups of GROUP rows, each super-block of ``block`` bytes word by word: [super-block,
    # word, row, byte]
    blocks = raw.shape[1] // block
    out_words = out.reshape(-1).view(np.uint32)
    for g in prange(raw.shape[0] // GROUP):
        rows = raw[g * GROUP:(g + 1) * GROUP]
        for b in range(blocks):
            at = (g * blocks + b) * GROUP * block
            for w in range(words):  # each word's 16 rows: 64 bytes in a row
                to = at // 4 + w * GROUP
                src = b * block + 4 * w
                for r in range(GROUP):
                    out_words[to + r] = _word(rows[r], src, False)


def unpack(packed: np.ndarray, scheme: str, row_bytes: int | None = None) -> np.ndarray:
    """``scheme``'s rows (uint8 [rows, row_bytes]) of an interleaved copy: ``repack`` undone (the
    rows as long as the copy's unless ``row_bytes``: a tail's filled-out blocks left off)."""
    if row_bytes is not None:
        return np.ascontiguousarray(unpack(packed, scheme)[:, :row_bytes])
    rows, row_bytes = packed.shape
    if scheme in K_SCHEMES:
        n, blocks = rows // GROUP, row_bytes // K_BLOCK
        return np.ascontiguousarray(np.asarray(packed).reshape(n, blocks, K_WORDS, GROUP, 4).transpose(
            0, 3, 1, 2, 4)).reshape(rows, row_bytes)
    lay = _layout(scheme)
    units = row_bytes // lay.block // lay.unit
    code_bytes = lay.block - lay.scale_bytes
    n = rows // GROUP
    p = np.asarray(packed).reshape(n, units, GROUP * lay.unit * lay.block)
    scales = p[..., :64].reshape(n, units, lay.unit, GROUP, lay.scale_bytes).transpose(0, 3, 1, 2, 4)
    codes = p[..., 64:].reshape(n, units, lay.unit, code_bytes // 4, GROUP, 4).transpose(0, 4, 1, 2, 3, 5).reshape(
        n, GROUP, units, lay.unit, code_bytes)
    out = np.empty((n, GROUP, units, lay.unit, lay.block), dtype=np.uint8)
    out[..., :lay.scale_bytes] = scales
    if scheme == "q8_0":
        np.bitwise_xor(codes, np.uint8(128), out=out[..., lay.scale_bytes:])
    else:
        out[..., lay.scale_bytes:] = codes
    return out.reshape(rows, row_bytes)


def _tile_intrinsic(tokens: int, span: bool = False, groups: int = 1):  # type: ignore[no-untyped-def]
    """``tile(code, flat, at, blocks, xq, xbase, xstride, dx, sums, dbase, dstride, out, obase,
    ostride)``: the 16 rows of scheme SCHEMES[code]'s group at byte ``at`` of flat (rows of
    ``blocks`` blocks: whole units, then a last unit of fewer blocks where they do not fill one,
    ``repack``'s tail; with ``groups`` 2, the next group's too) times ``tokens`` tokens' activations (token t's int8
    values at xq[xbase + t * xstride], in order), each token's results stored at out[obase + t *
    ostride]. Per block and token: the products of the codes (unsigned: ``Layout.offset``
    above their values) summed in 16 int32 lanes, one a row. Activations quantized per 32 (not
    ``span``): their scales and dequantized sums per 32 at dx and sums [dbase + t * dstride];
    each block's sums, in float, times the activations' scale less the codes' offset times
    their sum, times the rows' scales. Per 256 (``span``: whole 256s a row): the codes' offset
    times each block's int8 sum at sums (int32) [dbase + t * dstride] starts its integer sums,
    which are converted and times the rows' scales each block, and times the activations' scale
    (dx [(dbase + t * dstride) / 8]) each 256 values (dbase and dstride multiples of 8)."""
    from llvmlite import ir

    i8, i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
    vector = ir.VectorType
    bytes64, words, lanes = vector(i8, 64), vector(i32, 16), vector(f32, 16)

    @intrinsic
    def tile(typingctx, code, flat, at, blocks, xq, xbase, xstride, dx, sums, dbase, dstride, out, obase,
             ostride):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            flat_a, xq_a, dx_a, sums_a, out_a = vnni._arrays(context, builder, signature, args, (1, 4, 7, 8, 11))
            code_v, at_v, blocks_v, xbase_v, xstride_v, dbase_v, dstride_v, obase_v, ostride_v = vnni._indices(
                context, builder, signature, args, (0, 2, 3, 5, 6, 9, 10, 12, 13))
            const, _, load, _, _, splat, _ = vnni.emitters(builder, at_v.type)

            def zeros():  # type: ignore[no-untyped-def]
                return [[cgutils.alloca_once_value(builder, ir.Constant(lanes, [0.0] * 16)) for _ in range(tokens)]
                        for _ in range(groups)]

            def emit(scheme):  # type: ignore[no-untyped-def]
                # the tile's code for one scheme
                lay = LAYOUTS[scheme]
                unit_bytes = GROUP * lay.unit * lay.block
                block_lines = (lay.block - lay.scale_bytes) // 4  # lines of codes a block
                units_a_span = 8 // lay.unit  # units of 256 values

                def block_scales(line, j):  # type: ignore[no-untyped-def]
                    # the 16 rows' scales of block j of a unit, from the unit's line of scales
                    if lay.scale_bytes == 2:  # fp16
                        picks = ir.Constant(vector(i32, 16), list(range(16 * j, 16 * j + 16)))
                        halves = builder.shuffle_vector(builder.bitcast(line, vector(i16, 32)),
                                                        ir.Constant(vector(i16, 32), ir.Undefined), picks)
                        return builder.fpext(builder.bitcast(halves, vector(ir.HalfType(), 16)), lanes)
                    # e8m0 byte e: 2^(e - 127), halved (the looked-up codes are twice their values):
                    # the float's exponent field e - 1 from e = 2 on, else 2^-128 and 2^-127's bits
                    picks = ir.Constant(vector(i32, 16), list(range(16 * j, 16 * j + 16)))
                    exponents = builder.zext(builder.shuffle_vector(line, ir.Constant(bytes64, ir.Undefined), picks),
                                             words)
                    normal = builder.shl(builder.sub(exponents, ir.Constant(words, [1] * 16)),
                                         ir.Constant(words, [23] * 16))
                    tiny = builder.shl(ir.Constant(words, [0x00200000] * 16), exponents)
                    bits = builder.select(builder.icmp_unsigned(">=", exponents, ir.Constant(words, [2] * 16)), normal,
                                          tiny)
                    return builder.bitcast(bits, lanes)

                dpbusd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(words, [words] * 3),
                                                        "llvm.x86.avx512.vpdpbusd.512")
                fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(lanes, [lanes] * 3),
                                                     "llvm.fma.v16f32")
                shuffle = cgutils.get_or_insert_function(builder.module, ir.FunctionType(bytes64, [bytes64] * 2),
                                                         "llvm.x86.avx512.pshuf.b.512")
                e2m1 = ir.Constant(bytes64, list(vnni.E2M1_TWICE_PLUS_12) * 4)
                low_bits = ir.Constant(bytes64, [15] * 64)
                code_offset = ir.Constant(f32, -float(lay.offset))
                accs, spans = zeros(), zeros()  # [group][token]: the results, a span's sums
                x_bases = [vnni._nth(builder, xbase_v, xstride_v, t) for t in range(tokens)]
                d_bases = [vnni._nth(builder, dbase_v, dstride_v, t) for t in range(tokens)]
                units_v = builder.udiv(blocks_v, const(lay.unit))  # whole units
                tail_v = builder.sub(blocks_v, builder.mul(units_v, const(lay.unit)))  # a last unit's blocks
                group_bytes = builder.mul(builder.udiv(builder.add(blocks_v, const(lay.unit - 1)), const(lay.unit)),
                                          const(unit_bytes))

                def unit_lines(index):  # type: ignore[no-untyped-def]
                    # unit ``index``'s place in each group, and each group's line of its scales
                    unit_ats = [builder.add(builder.add(at_v, builder.mul(group_bytes, const(g))),
                                            builder.mul(index, const(unit_bytes))) for g in range(groups)]
                    return unit_ats, [load(flat_a, unit_at, bytes64) for unit_at in unit_ats]

                def block_of(index, j, unit_ats, scale_lines):  # type: ignore[no-untyped-def]
                    # block j of unit ``index``: its products with every token, into accs (or spans)
                    block = builder.add(builder.mul(index, const(lay.unit)), const(j))
                    x_at = builder.mul(block, const(32))
                    if span:  # the codes' offset times the block's int8 sum (sums: int32)
                        starts = [splat(load(sums_a, builder.add(d_bases[t], block), i32), words)
                                  for t in range(tokens)]
                    else:
                        starts = [ir.Constant(words, [0] * 16)] * tokens
                    dots = [list(starts) for _ in range(groups)]
                    for k in range(block_lines):
                        for g in range(groups):
                            line = load(flat_a, builder.add(unit_ats[g], const(64 + 64 * (block_lines * j + k))),
                                        bytes64)
                            if not lay.nibbles:  # line k: codes 4k..4k+3 of every row
                                parts = [(line, 4 * k)]
                            else:  # line k: codes 4k..4k+3 in the low nibbles, 16+4k.. in the high ones
                                low = builder.and_(line, low_bits)
                                high = builder.and_(builder.lshr(line, ir.Constant(bytes64, [4] * 64)), low_bits)
                                parts = [(low, 4 * k), (high, 16 + 4 * k)]
                                if scheme == "mxfp4":  # e2m1 codes -> twice their values, plus 12
                                    parts = [(builder.call(shuffle, [e2m1, codes]), first)
                                             for codes, first in parts]
                            for codes, first in parts:
                                codes_w = builder.bitcast(codes, words)
                                for t in range(tokens):
                                    x4 = load(xq_a, builder.add(x_bases[t], builder.add(x_at, const(first))), i32)
                                    dots[g][t] = builder.call(dpbusd, [dots[g][t], codes_w, splat(x4, words)])
                    for g in range(groups):
                        scales = block_scales(scale_lines[g], j)
                        for t in range(tokens):
                            if span:
                                builder.store(builder.call(fma, [scales, builder.sitofp(dots[g][t], lanes),
                                                                 builder.load(spans[g][t])]), spans[g][t])
                                continue
                            d_at = builder.add(d_bases[t], block)
                            offset = builder.fmul(load(sums_a, d_at, f32), code_offset)
                            term = builder.call(fma, [builder.sitofp(dots[g][t], lanes),
                                                      splat(load(dx_a, d_at, f32), lanes), splat(offset, lanes)])
                            builder.store(builder.call(fma, [scales, term, builder.load(accs[g][t])]), accs[g][t])

                with cgutils.for_range(builder, units_v) as loop:
                    unit_ats, scale_lines = unit_lines(loop.index)
                    for j in range(lay.unit):
                        block_of(loop.index, j, unit_ats, scale_lines)
                    if span:  # a span's last unit: its sums times the tokens' scales per 256
                        last = builder.icmp_unsigned("==", builder.and_(loop.index, const(units_a_span - 1)),
                                                     const(units_a_span - 1))
                        with builder.if_then(last):
                            for t in range(tokens):
                                d_at = builder.add(builder.lshr(d_bases[t], const(3)),
                                                   builder.udiv(loop.index, const(units_a_span)))
                                scale = splat(load(dx_a, d_at, f32), lanes)
                                for g in range(groups):
                                    builder.store(builder.call(fma, [builder.load(spans[g][t]), scale,
                                                                     builder.load(accs[g][t])]), accs[g][t])
                                    builder.store(ir.Constant(lanes, [0.0] * 16), spans[g][t])
                if not span:  # (per 256 the rows are whole 256s: no tail)
                    with builder.if_then(builder.icmp_unsigned(">", tail_v, const(0))):
                        unit_ats, scale_lines = unit_lines(units_v)
                        for j in range(lay.unit - 1):
                            with builder.if_then(builder.icmp_unsigned(">", tail_v, const(j))):
                                block_of(units_v, j, unit_ats, scale_lines)
                for g in range(groups):
                    for t in range(tokens):
                        at_out = builder.add(obase_v, builder.add(builder.mul(ostride_v, const(t)), const(GROUP * g)))
                        builder.store(builder.load(accs[g][t]), builder.bitcast(builder.gep(out_a.data, [at_out]),
                                                                                lanes.as_pointer()), align=4)
            def emit_from(k):  # type: ignore[no-untyped-def]
                # scheme k's code where code is k, else the next schemes'
                if k == len(BLOCK_SCHEMES) - 1:
                    emit(BLOCK_SCHEMES[k])
                    return
                with builder.if_else(builder.icmp_signed("==", code_v, const(k))) as (this, others):
                    with this:
                        emit(BLOCK_SCHEMES[k])
                    with others:
                        emit_from(k + 1)

            emit_from(0)
            return context.get_dummy_value()

        return (types.void(code, flat, at, blocks, xq, xbase, xstride, dx, sums, dbase, dstride, out, obase,
                           ostride), codegen)

    return tile


# one token or TILE_TOKENS x TILE_GROUPS, activations per 32 or per 256
_one, _many = _tile_intrinsic(1), _tile_intrinsic(TILE_TOKENS, False, TILE_GROUPS)
_span1, _span = _tile_intrinsic(1, True), _tile_intrinsic(TILE_TOKENS, True, TILE_GROUPS)


@njit(cache=True, nogil=True, inline="always")
def _tile(per_256, many, code, flat, at, blocks, xq, xbase, xstride, dx, sums, dbase, dstride, out, obase,
          ostride):  # pragma: no cover - compiled
    # scheme SCHEMES[code]'s tile, the activations per 256 or per 32, for TILE_TOKENS tokens and
    # TILE_GROUPS groups (many) or one of each
    if per_256:
        if many:
            _span(code, flat, at, blocks, xq, xbase, xstride, dx, sums, dbase, dstride, out, obase, ostride)
        else:
            _span1(code, flat, at, blocks, xq, xbase, xstride, dx, sums, dbase, dstride, out, obase, ostride)
    elif many:
        _many(code, flat, at, blocks, xq, xbase, xstride, dx, sums, dbase, dstride, out, obase, ostride)
    else:
        _one(code, flat, at, blocks, xq, xbase, xstride, dx, sums, dbase, dstride, out, obase, ostride)


@njit(cache=True, nogil=True, inline="always")
def rows(code, flat, base, row_bytes, first, last, cols, xq, dx, sums, out):  # pragma: no cover - compiled
    """out[first:last] (whole groups) of the interleaved matrix of scheme SCHEMES[code] at byte
    ``base`` of flat times one token's activations (xq in order, dx and sums per 32:
    ``vnni._quantized_both``)."""
    for g in range(first // GROUP, last // GROUP):
        _tile(False, False, code, flat, base + g * GROUP * row_bytes, cols // 32, xq, 0, 0, dx, sums, 0, 0, out,
              g * GROUP, 0)


@njit(cache=True, nogil=True, inline="always")
def _next_tile_item(counters, t, threads, groups, n, tile_tokens):  # pragma: no cover - compiled
    # The next work item of the many-token loops (``vnni.work_item``): GROUPS_PER_ITEM groups by
    # ``tile_tokens`` tokens, as (its first token, its first group, the group past its last);
    # the first token -1 when none is left.
    token_items = (n + tile_tokens - 1) // tile_tokens
    item = vnni.work_item(counters, t, threads, (groups + GROUPS_PER_ITEM - 1) // GROUPS_PER_ITEM * token_items)
    if item < 0:
        return -1, 0, 0
    gi, ti = item // token_items, item % token_items
    return ti * tile_tokens, gi * GROUPS_PER_ITEM, min(groups, (gi + 1) * GROUPS_PER_ITEM)


@njit(cache=True, nogil=True, inline="always")
def _next_rows(counters, t, threads, n_rows):  # pragma: no cover - compiled
    # The next work item of the one-token loops (``vnni.work_item``): GROUPS_PER_ITEM groups' rows,
    # (first, last); first -1 when none is left.
    item = vnni.work_item(counters, t, threads, (n_rows // GROUP + GROUPS_PER_ITEM - 1) // GROUPS_PER_ITEM)
    if item < 0:
        return -1, 0
    first = item * GROUPS_PER_ITEM * GROUP
    return first, min(n_rows, first + GROUPS_PER_ITEM * GROUP)


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _matvec(code, packed, x, out):  # pragma: no cover - compiled
    n_rows, row_bytes = packed.shape
    cols = x.shape[0]
    xq, _, dx, sums = vnni._quantized_both(x, 1, cols, True, False)
    flat = packed.reshape(-1)
    threads = vnni.thread_count()
    counters = vnni.work_counters(threads)
    for t in prange(threads):
        while True:
            first, last = _next_rows(counters, t, threads, n_rows)
            if first < 0:
                break
            rows(code, flat, 0, row_bytes, first, last, cols, xq[0], dx[0], sums[0], out)


# ------------------------------------------------------------------------------------------------
# q4_k: super-blocks of 256 values, 144 bytes a row (fp16 d and dmin, 12 bytes of 6-bit scales
# and minimums of its eight 32-value sub-blocks, 128 bytes of codes: chunk j's 32 bytes hold
# sub-block 2j in their low nibbles and 2j + 1 in their high ones). A group's super-block is its
# 16 rows' 36 four-byte words word by word: line 0 every row's d and dmin, lines 1-3 the scale
# bytes, line 4 + 8j + k code bytes 32j + 4k.. 32j + 4k + 3 of every row. Against the
# activations quantized per 256 in order (``vnni.quantize_superblocks``, as the stored rows'
# q6_k reads them): each sub-block's products summed in 16 int32 lanes, one a row, times its
# 6-bit scale (``vpmulld``), the minimums through the activations' int16 sums per 16
# (``vpdpwssd``, each minimum twice beside a sub-block's two sums); once a super-block, both
# sums converted and times the rows' d and dmin and the activations' scale.
# ``matmul``'s q4_k tile (tokens x groups), for 2-11 tokens. Measured at 96 tokens (two threads,
# medians of 7 interleaved calls, GOP/s at 28672 x 4096 and 4096 x 14336): 3 x 2 562 and 506,
# 2 x 2 512 and 447, 2 x 3 505 and 452, 1 x 4 428 and 419, 4 x 2 409 and 432, 2 x 4 391 and 390,
# 3 x 3 361 and 356, 4 x 1 351 and 290; the stored layout's lanes in the same runs 626-690 and
# 550-631, hence the lanes from K_LANES_MIN_TOKENS on. At 4 tokens (1536 x 2048) 313 against
# the stored rows' tiles' 158.
K_TILE_TOKENS, K_TILE_GROUPS = 3, 2
# One token's tile of one group asks for its group's super-block K_ONE_AHEAD bytes ahead into L2
# (prefetcht2), every other line: one 57344 x 4096 matrix (132 MB, Mixtral's two experts'
# gate/up) on two threads, the variants compiled side by side and called in rotated order beside a
# plain read, 15 rounds a run: 1.04-1.14x the tile without it in the memory's slow phase (eight
# runs; 1.02-1.11x against the same tile through the same driver, three of them) and 1.14-1.20x in
# the fast phase (two runs). Every line 0.99-1.14x; 4-32 KB ahead gained about alike
# (1.01-1.19x); non-temporally 0.81x.
K_ONE_AHEAD = 8192
# From this many tokens on, q4_k's products take the stored layout's many-token kernel
# (``lanes``: 16 tokens a vector) over each chunk of rows put back in the stored layout.
K_LANES_MIN_TOKENS = 12


def _k_tile_intrinsic(tokens: int, groups: int = 1):  # type: ignore[no-untyped-def]
    """``tile(flat, at, blocks, yk, ybase, ystride, dk, dstride, bsum, bstride, out, obase,
    ostride)``: the 16 rows of the interleaved q4_k group at byte ``at`` of flat (``blocks``
    super-blocks a row; with ``groups`` 2 the next group's too) times ``tokens`` tokens'
    activations per 256 (token t's int8 values in order at yk[ybase + t * ystride], its scales
    at dk[t * dstride], its int16 sums per 16 at bsum[t * bstride]), token t's results stored at
    out[obase + t * ostride] (16 a group)."""
    from llvmlite import ir

    i8, i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
    vector = ir.VectorType
    bytes64, words, lanes = vector(i8, 64), vector(i32, 16), vector(f32, 16)

    @intrinsic
    def tile(typingctx, flat, at, blocks, yk, ybase, ystride, dk, dstride, bsum, bstride, out, obase,
             ostride):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            flat_a, yk_a, dk_a, bsum_a, out_a = vnni._arrays(context, builder, signature, args, (0, 3, 6, 8, 10))
            at_v, blocks_v, ybase_v, ystride_v, dstride_v, bstride_v, obase_v, ostride_v = vnni._indices(
                context, builder, signature, args, (1, 2, 4, 5, 7, 9, 11, 12))
            const, _, load, _, _, splat, fn = vnni.emitters(builder, at_v.type)

            def each(value):  # type: ignore[no-untyped-def]
                return ir.Constant(words, [value] * 16)

            dpbusd = fn("llvm.x86.avx512.vpdpbusd.512", words, [words] * 3)
            dpwssd = fn("llvm.x86.avx512.vpdpwssd.512", words, [words] * 3)
            fma = fn("llvm.fma.v16f32", lanes, [lanes] * 3)
            pshufb = fn("llvm.x86.avx512.pshuf.b.512", bytes64, [bytes64] * 2)

            def picked(bytes_, b, twice):  # type: ignore[no-untyped-def]
                # byte b of every word, as a word (or twice, as two int16s)
                mask = []
                for w in range(16):
                    first = 4 * (w % 4) + b  # within the word's 16-byte lane
                    mask += [first, -128, first if twice else -128, -128]
                return builder.bitcast(builder.call(pshufb, [builder.bitcast(bytes_, bytes64),
                                                             ir.Constant(bytes64, mask)]), words)

            low_bits = ir.Constant(bytes64, [15] * 64)
            zero_w, zero_f = ir.Constant(words, [0] * 16), ir.Constant(lanes, [0.0] * 16)
            accs = [[cgutils.alloca_once_value(builder, zero_f) for _ in range(tokens)] for _ in range(groups)]
            # One token of one group sums a sub-block's eight products in two chains of four (odd
            # and even lines), not one of eight: the super-block's longest chain of dependent
            # vpdpbusd halved, the rows read from memory 1.01-1.30x as fast (median 1.11x, six
            # runs: 132 MB of rows, two threads, rotated order; one core from L3 1.035x); and the
            # minimums' eight vpdpwssd in two chains too, then the longest: 1.01-1.09x more (median
            # 1.03x, six runs; 1.09x in the memory's fast phase). The tiles of several tokens or
            # groups have chains enough side by side.
            one = tokens * groups == 1  # one token of one group: two chains, and its lines asked for ahead
            chains = 2 if one else 1
            y_bases = [vnni._nth(builder, ybase_v, ystride_v, t) for t in range(tokens)]
            group_bytes = builder.mul(blocks_v, const(GROUP * K_BLOCK))
            with cgutils.for_range(builder, blocks_v) as loop:
                i = loop.index
                bases = [builder.add(builder.add(at_v, builder.mul(group_bytes, const(g))),
                                     builder.mul(i, const(GROUP * K_BLOCK))) for g in range(groups)]
                if one:  # K_ONE_AHEAD
                    vnni._prefetch_ahead(builder, flat_a, bases[0], GROUP * K_BLOCK, vnni._AGAIN, K_ONE_AHEAD, 128)
                heads = []
                for base in bases:
                    halves = builder.bitcast(load(flat_a, base, bytes64), vector(i16, 32))
                    d, dmin = (builder.fpext(builder.bitcast(builder.shuffle_vector(
                        halves, ir.Constant(vector(i16, 32), ir.Undefined),
                        ir.Constant(vector(i32, 16), list(range(p, 32, 2)))), vector(ir.HalfType(), 16)), lanes)
                        for p in (0, 1))
                    a, b, c = (load(flat_a, builder.add(base, const(64 * n)), words) for n in (1, 2, 3))
                    # the scales (bytes of sc and sh: sub-blocks 0-3 and 4-7) and minimums (mn, mh)
                    high_a = builder.and_(builder.lshr(a, each(2)), each(0x30303030))
                    high_b = builder.and_(builder.lshr(b, each(2)), each(0x30303030))
                    sc = builder.and_(a, each(0x3F3F3F3F))
                    sh = builder.or_(builder.and_(c, each(0x0F0F0F0F)), high_a)
                    mn = builder.and_(b, each(0x3F3F3F3F))
                    mh = builder.or_(builder.and_(builder.lshr(c, each(4)), each(0x0F0F0F0F)), high_b)
                    heads.append((d, dmin, (sc, sh), (mn, mh)))
                ints = [[zero_w] * tokens for _ in range(groups)]
                for j in range(4):  # sub-blocks 2j (low nibbles) and 2j + 1 (high)
                    # [group][token][nibbles * chains + line % chains]: each sub-block's eight
                    # products in ``chains`` sums
                    dots = [[[zero_w] * (2 * chains) for _ in range(tokens)] for _ in range(groups)]
                    for k in range(8):
                        for g, base in enumerate(bases):
                            line = load(flat_a, builder.add(base, const(64 * (4 + 8 * j + k))), bytes64)
                            low = builder.bitcast(builder.and_(line, low_bits), words)
                            high = builder.bitcast(builder.and_(builder.lshr(line, ir.Constant(bytes64, [4] * 64)),
                                                                low_bits), words)
                            for t in range(tokens):
                                y_at = builder.add(y_bases[t], builder.add(builder.mul(i, const(256)),
                                                                           const(64 * j + 4 * k)))
                                for h, codes in enumerate((low, high)):
                                    y4 = splat(load(yk_a, builder.add(y_at, const(32 * h)), i32), words)
                                    q = chains * h + k % chains
                                    dots[g][t][q] = builder.call(dpbusd, [dots[g][t][q], codes, y4])
                    for g in range(groups):
                        scales = [picked(heads[g][2][s // 4], s % 4, False) for s in (2 * j, 2 * j + 1)]
                        for t in range(tokens):
                            sub = [reduce(builder.add, dots[g][t][chains * h:chains * (h + 1)]) for h in (0, 1)]
                            ints[g][t] = builder.add(ints[g][t], builder.add(builder.mul(sub[0], scales[0]),
                                                                             builder.mul(sub[1], scales[1])))
                for t in range(tokens):
                    block = builder.add(builder.mul(dstride_v, const(t)), i)
                    scale = splat(load(dk_a, block, f32), lanes)
                    sums_at = builder.add(builder.mul(bstride_v, const(t)), builder.mul(i, const(16)))
                    pairs = [splat(load(bsum_a, builder.add(sums_at, const(2 * s)), i32), words) for s in range(8)]
                    for g in range(groups):
                        d, dmin, _, mins = heads[g]
                        mins_parts = [zero_w] * chains  # the minimums' products, in chains as the codes'
                        for s in range(8):
                            mins_parts[s % chains] = builder.call(dpwssd, [mins_parts[s % chains],
                                                                           picked(mins[s // 4], s % 4, True), pairs[s]])
                        least = reduce(builder.add, mins_parts)
                        acc = builder.call(fma, [builder.sitofp(ints[g][t], lanes), builder.fmul(d, scale),
                                                 builder.load(accs[g][t])])
                        acc = builder.call(fma, [builder.sitofp(least, lanes),
                                                 builder.fmul(dmin, builder.fsub(zero_f, scale)), acc])
                        builder.store(acc, accs[g][t])
            for g in range(groups):
                for t in range(tokens):
                    at_out = builder.add(obase_v, builder.add(builder.mul(ostride_v, const(t)), const(GROUP * g)))
                    builder.store(builder.load(accs[g][t]), builder.bitcast(builder.gep(out_a.data, [at_out]),
                                                                            lanes.as_pointer()), align=4)
            return context.get_dummy_value()

        return (types.void(flat, at, blocks, yk, ybase, ystride, dk, dstride, bsum, bstride, out, obase, ostride),
                codegen)

    return tile


_k_one, _k_many = _k_tile_intrinsic(1), _k_tile_intrinsic(K_TILE_TOKENS, K_TILE_GROUPS)


@njit(cache=True, nogil=True, inline="always")
def k_rows(flat, base, row_bytes, first, last, cols, yk, ybase, dk, bsum, out):  # pragma: no cover - compiled
    """out[first:last] (whole groups) of the interleaved q4_k matrix at byte ``base`` of flat
    times one token's activations per 256 (yk in order from ybase, dk, bsum:
    ``vnni.quantize_superblocks``)."""
    for g in range(first // GROUP, last // GROUP):
        _k_one(flat, base + g * GROUP * row_bytes, cols // 256, yk, ybase, 0, dk, 0, bsum, 0, out, g * GROUP, 0)


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _k_matmul(packed, x, out):  # pragma: no cover - compiled
    # Work items: GROUPS_PER_ITEM groups by K_TILE_TOKENS tokens; in an item, tiles of
    # K_TILE_GROUPS groups by K_TILE_TOKENS tokens, a group or a token past the last whole tile
    # one at a time (``_matmul``'s items).
    n_rows, row_bytes = packed.shape
    n, cols = x.shape
    yk_n, dk_n, bsum_n = vnni.superblock_activations(x.reshape(-1), n, cols, False, True)  # in order, from cols
    yk, dk, bsum = yk_n.reshape(-1), dk_n.reshape(-1), bsum_n.reshape(-1)
    flat, out_flat = packed.reshape(-1), out.reshape(-1)
    blocks = cols // 256
    groups = n_rows // GROUP
    threads = vnni.thread_count()
    counters = vnni.work_counters(threads)
    for t in prange(threads):
        while True:
            first_token, first_group, last_group = _next_tile_item(counters, t, threads, groups, n, K_TILE_TOKENS)
            if first_token < 0:
                break
            for g in range(first_group, last_group, K_TILE_GROUPS):
                at = g * GROUP * row_bytes
                if first_token + K_TILE_TOKENS <= n and g + K_TILE_GROUPS <= last_group:
                    _k_many(flat, at, blocks, yk, first_token * 2 * cols + cols, 2 * cols, dk[first_token * blocks:],
                            blocks, bsum[first_token * 16 * blocks:], 16 * blocks, out_flat,
                            first_token * n_rows + g * GROUP, n_rows)
                    continue
                for h in range(g, min(last_group, g + K_TILE_GROUPS)):
                    for token in range(first_token, min(n, first_token + K_TILE_TOKENS)):
                        _k_one(flat, h * GROUP * row_bytes, blocks, yk, token * 2 * cols + cols, 0,
                               dk[token * blocks:], 0, bsum[token * 16 * blocks:], 0, out_flat,
                               token * n_rows + h * GROUP, 0)


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _k_matvec(packed, x, out):  # pragma: no cover - compiled
    n_rows, row_bytes = packed.shape
    cols = x.shape[0]
    yk_n, dk_n, bsum_n = vnni.superblock_activations(x, 1, cols, False, True)  # in order, from cols
    yk, dk, bsum = yk_n.reshape(-1), dk_n.reshape(-1), bsum_n.reshape(-1)
    flat = packed.reshape(-1)
    threads = vnni.thread_count()
    counters = vnni.work_counters(threads)
    for t in prange(threads):
        while True:
            first, last = _next_rows(counters, t, threads, n_rows)
            if first < 0:
                break
            k_rows(flat, 0, row_bytes, first, last, cols, yk, cols, dk, bsum, out)


# Tokens below which ``matmul`` multiplies a scheme's rows by its few-token tiles, activations
# per 32 (q4_k: its tile, per 256): ``groups_product``'s experts have from 2 to fewer than these.
FEW_TOKENS = {**PER_256_MIN_TOKENS, "q4_k": K_LANES_MIN_TOKENS}
_K_CODE = SCHEMES.index("q4_k")


@njit(cache=True, nogil=True)
def groups_product(code, flat, offsets, row_bytes, x, groups, out):  # pragma: no cover - compiled
    """out rows groups[e]..groups[e + 1] = x's rows there [tokens, cols] times the interleaved
    matrix of scheme SCHEMES[code] (out.shape[1] rows of row_bytes) at byte offsets[e] of flat,
    for each expert e, in one parallel region: the few-token experts of a prompt chunk
    (``rows.experts_groups``), each with fewer than ``FEW_TOKENS`` tokens, multiplied as
    ``matmul`` multiplies as many (the same tiles and activations: the same results), which an
    expert a call paid Python and two parallel regions' starts for."""
    if code == _K_CODE:
        _k_groups(flat, offsets, row_bytes, x, groups, out)
    else:
        _block_groups(code, flat, offsets, row_bytes, x, groups, out)


@njit(cache=True, nogil=True, inline="always")
def _group_item(counters, t, threads, groups, n_groups):  # pragma: no cover - compiled
    # The next work item of the groups' products (``vnni.work_item``): GROUPS_PER_ITEM groups of
    # an expert's rows by all its tokens (the rows read once), as (the expert, its first group,
    # the group past its last); the expert -1 when none is left.
    row_items = (n_groups + GROUPS_PER_ITEM - 1) // GROUPS_PER_ITEM
    item = vnni.work_item(counters, t, threads, (groups.shape[0] - 1) * row_items)
    if item < 0:
        return -1, 0, 0
    first = item % row_items * GROUPS_PER_ITEM
    return item // row_items, first, min(n_groups, first + GROUPS_PER_ITEM)


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _block_groups(code, flat, offsets, row_bytes, x, groups, out):  # pragma: no cover - compiled
    n, cols = x.shape
    n_rows = out.shape[1]
    xq, _, dx, sums = vnni._quantized_both(x.reshape(-1), n, cols, True, False)
    xq_flat, dx_flat, sums_flat, out_flat = xq.reshape(-1), dx.reshape(-1), sums.reshape(-1), out.reshape(-1)
    blocks = cols // 32
    threads = vnni.thread_count()
    counters = vnni.work_counters(threads)
    for t in prange(threads):
        while True:
            e, first_group, last_group = _group_item(counters, t, threads, groups, n_rows // GROUP)
            if e < 0:
                break
            start, end = groups[e], groups[e + 1]
            for g in range(first_group, last_group, TILE_GROUPS):
                for first_token in range(start, end, TILE_TOKENS):
                    if first_token + TILE_TOKENS <= end and g + TILE_GROUPS <= last_group:
                        _tile(False, True, code, flat, offsets[e] + g * GROUP * row_bytes, blocks, xq_flat,
                              first_token * cols, cols, dx_flat, sums_flat, first_token * blocks, blocks, out_flat,
                              first_token * n_rows + g * GROUP, n_rows)
                        continue
                    for h in range(g, min(last_group, g + TILE_GROUPS)):
                        for token in range(first_token, min(end, first_token + TILE_TOKENS)):
                            _tile(False, False, code, flat, offsets[e] + h * GROUP * row_bytes, blocks, xq_flat,
                                  token * cols, 0, dx_flat, sums_flat, token * blocks, 0, out_flat,
                                  token * n_rows + h * GROUP, 0)


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _k_groups(flat, offsets, row_bytes, x, groups, out):  # pragma: no cover - compiled
    n, cols = x.shape
    n_rows = out.shape[1]
    yk_n, dk_n, bsum_n = vnni.superblock_activations(x.reshape(-1), n, cols, False, True)  # in order, from cols
    yk, dk, bsum, out_flat = yk_n.reshape(-1), dk_n.reshape(-1), bsum_n.reshape(-1), out.reshape(-1)
    blocks = cols // 256
    threads = vnni.thread_count()
    counters = vnni.work_counters(threads)
    for t in prange(threads):
        while True:
            e, first_group, last_group = _group_item(counters, t, threads, groups, n_rows // GROUP)
            if e < 0:
                break
            start, end = groups[e], groups[e + 1]
            for g in range(first_group, last_group, K_TILE_GROUPS):
                for first_token in range(start, end, K_TILE_TOKENS):
                    if first_token + K_TILE_TOKENS <= end and g + K_TILE_GROUPS <= last_group:
                        _k_many(flat, offsets[e] + g * GROUP * row_bytes, blocks, yk, first_token * 2 * cols + cols,
                                2 * cols, dk[first_token * blocks:], blocks, bsum[first_token * 16 * blocks:],
                                16 * blocks, out_flat, first_token * n_rows + g * GROUP, n_rows)
                        continue
                    for h in range(g, min(last_group, g + K_TILE_GROUPS)):
                        for token in range(first_token, min(end, first_token + K_TILE_TOKENS)):
                            _k_one(flat, offsets[e] + h * GROUP * row_bytes, blocks, yk, token * 2 * cols + cols, 0,
                                   dk[token * blocks:], 0, bsum[token * 16 * blocks:], 0, out_flat,
                                   token * n_rows + h * GROUP, 0)


def _checked(packed: np.ndarray, scheme: str, cols: int) -> int:
    # the scheme's code (its place in SCHEMES), the copy's shape checked against the
    # activations' (the kernels read whole groups and units of blocks by the shape alone)
    block, values = (K_BLOCK, 256) if scheme in K_SCHEMES else (_layout(scheme).block, 32)
    if not (packed.ndim == 2 and fits(packed.shape[0], cols, scheme, tail=True)
            and packed.shape[1] == copy_row_bytes(scheme, cols // values * block)):
        raise ValueError(f"an interleaved {scheme} copy {packed.shape} does not multiply {cols} values a token")
    return SCHEMES.index(scheme)


def matvec(packed: np.ndarray, scheme: str, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``W @ x`` (float32 [rows]) for an interleaved matrix ``packed`` of ``scheme`` (``repack``)
    and float32 x [cols], the activations quantized to int8 per 32 as the rows' kernels do."""
    code = _checked(packed, scheme, x.shape[-1])
    out = np.empty(packed.shape[0], dtype=np.float32) if out is None else out
    x = writable(np.ascontiguousarray(x, dtype=np.float32))
    if scheme in K_SCHEMES:
        _k_matvec(read_only(packed), x, out)
    else:
        _matvec(code, read_only(packed), x, out)
    return out


@njit(cache=True, nogil=True)
def _per_256(x, n, cols, offset):  # pragma: no cover - compiled
    # n vectors' int8 values per 256 (in order), their scales, and each block's int8 sum times
    # -offset (the codes') as int32 in a float32 array (the tiles read it as int32)
    xq = np.empty(n * cols, np.int8)
    dx = np.empty(n * cols // 256, np.float32)
    vnni._quantize_groups(x, 256, 0, xq, dx, np.empty(n * cols // 256, np.float32))
    starts = np.empty(n * cols // 32, np.float32)
    words = starts.view(np.int32)
    for b in range(n * cols // 32):
        total = 0
        for j in range(32):
            total += np.int32(xq[32 * b + j])
        words[b] = -offset * total
    return xq, dx, starts


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _matmul(code, per_256, packed, x, out):  # pragma: no cover - compiled
    # Work items: GROUPS_PER_ITEM groups by TILE_TOKENS tokens; in an item, tiles of TILE_GROUPS
    # groups by TILE_TOKENS tokens, a group or a token past the last whole tile one at a time.
    n_rows, row_bytes = packed.shape
    n, cols = x.shape
    if per_256:
        xq_flat, dx_flat, sums_flat = _per_256(x.reshape(-1), n, cols, _OFFSETS[code])
    else:
        xq, _, dx, sums = vnni._quantized_both(x.reshape(-1), n, cols, True, False)
        xq_flat, dx_flat, sums_flat = xq.reshape(-1), dx.reshape(-1), sums.reshape(-1)
    flat, out_flat = packed.reshape(-1), out.reshape(-1)
    blocks = cols // 32
    groups = n_rows // GROUP
    threads = vnni.thread_count()
    counters = vnni.work_counters(threads)
    for t in prange(threads):
        while True:
            first_token, first_group, last_group = _next_tile_item(counters, t, threads, groups, n, TILE_TOKENS)
            if first_token < 0:
                break
            for g in range(first_group, last_group, TILE_GROUPS):
                at = g * GROUP * row_bytes
                if first_token + TILE_TOKENS <= n and g + TILE_GROUPS <= last_group:
                    _tile(per_256, True, code, flat, at, blocks, xq_flat, first_token * cols, cols, dx_flat, sums_flat,
                          first_token * blocks, blocks, out_flat, first_token * n_rows + g * GROUP, n_rows)
                    continue
                for h in range(g, min(last_group, g + TILE_GROUPS)):
                    for token in range(first_token, min(n, first_token + TILE_TOKENS)):
                        _tile(per_256, False, code, flat, h * GROUP * row_bytes, blocks, xq_flat, token * cols, 0,
                              dx_flat, sums_flat, token * blocks, 0, out_flat, token * n_rows + h * GROUP, 0)


def matmul(x: np.ndarray, packed: np.ndarray, scheme: str) -> np.ndarray:
    """``x @ W.T`` (float32 [n, rows]) for tokens x [n, cols] and an interleaved matrix
    ``packed`` of ``scheme``, each token's activations quantized to int8 per 32, or per 256 from
    ``PER_256_MIN_TOKENS`` tokens on where the rows are whole 256s (as the stored layout's
    products of as many tokens: ``kernels.LANES_MIN_TOKENS``). Many tokens of q4_k's copies are
    faster through the stored layout's lanes: ``kernels.interleaved_linear`` sends them there."""
    code = _checked(packed, scheme, x.shape[-1])
    x = writable(np.ascontiguousarray(x, dtype=np.float32))
    out = np.empty((x.shape[0], packed.shape[0]), dtype=np.float32)
    if scheme in K_SCHEMES:
        _k_matmul(read_only(packed), x, out)
        return out
    _matmul(code, x.shape[0] >= PER_256_MIN_TOKENS[scheme] and x.shape[1] % 256 == 0, read_only(packed), x, out)
    return out
