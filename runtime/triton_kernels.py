"""The Triton kernels of ``triton_experts`` (a module of their own: Triton resolves the helpers a
kernel calls among its module's globals, and importing it needs Triton)."""

import triton
import triton.language as tl


@triton.jit
def _e2m1(code):
    # the FP4 e2m1 value of 4-bit codes: sign, two exponent bits, one mantissa bit
    v = code & 7
    mant = (v & 1).to(tl.float32)
    e = (v >> 1).to(tl.float32)
    mag = tl.where(v < 2, mant * 0.5, (1.0 + mant * 0.5) * tl.exp2(e - 1.0))
    return tl.where(code >= 8, -mag, mag)


@triton.jit
def _blocks_dot(w, rows, rmask, row_bytes, x, cols, KIND: tl.constexpr, BB: tl.constexpr, HEAD: tl.constexpr,
                CODES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCKS: tl.constexpr):
    # _rows_dot of ggml's blocks of 32 values: BB bytes each, HEAD of them its scale, then
    # CODES bytes of codes; BLOCKS blocks of each row a step
    b = tl.arange(0, BLOCKS)
    j = tl.arange(0, CODES)
    nblocks = cols // 32
    part = tl.zeros((BLOCK_R, BLOCKS), dtype=tl.float32)
    for start in range(0, nblocks, BLOCKS):
        bb = start + b
        inside = bb < nblocks
        bmask = rmask[:, None] & inside[None, :]
        base = rows[:, None] * row_bytes + bb[None, :] * BB  # [R, B]: each block's first byte
        if KIND == 6:
            scale = tl.exp2(tl.load(w + base, mask=bmask, other=127).to(tl.float32) - 127.0)
        else:
            lo_s = tl.load(w + base, mask=bmask, other=0).to(tl.uint16)
            hi_s = tl.load(w + base + 1, mask=bmask, other=0).to(tl.uint16)
            scale = (lo_s | (hi_s << 8)).to(tl.float16, bitcast=True).to(tl.float32)
        codes = tl.load(w + base[:, :, None] + HEAD + j[None, None, :], mask=bmask[:, :, None], other=0)
        xat = bb[:, None] * 32 + j[None, :]  # [B, CODES]: the values' places in x
        if KIND == 4:
            v = codes.to(tl.int8, bitcast=True).to(tl.float32)
            xv = tl.load(x + xat, mask=inside[:, None], other=0.0)
            dot = tl.sum(v * xv[None, :, :], axis=2)
        else:
            lo = codes & 15
            hi = codes >> 4
            if KIND == 5:
                vlo = lo.to(tl.float32) - 8.0
                vhi = hi.to(tl.float32) - 8.0
            else:
                vlo = _e2m1(lo)
                vhi = _e2m1(hi)
            xlo = tl.load(x + xat, mask=inside[:, None], other=0.0)
            xhi = tl.load(x + xat + 16, mask=inside[:, None], other=0.0)
            dot = tl.sum(vlo * xlo[None, :, :] + vhi * xhi[None, :, :], axis=2)
        part += dot * scale
    return tl.sum(part, axis=1)


@triton.jit
def _rows_dot(w, rows, rmask, row_bytes, x, cols, KIND: tl.constexpr, BLOCK_R: tl.constexpr,
              BLOCK_K: tl.constexpr):
    # [BLOCK_R] dot products of rows ``rows`` of the matrix at w (row_bytes a row: its values
    # for the plain kinds) with x [cols] (float32)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if KIND <= 2:  # f32, f16, bf16: values
        k = tl.arange(0, BLOCK_K)
        for start in range(0, cols, BLOCK_K):
            kk = start + k
            kmask = kk < cols
            v = tl.load(w + rows[:, None] * row_bytes + kk[None, :], mask=rmask[:, None] & kmask[None, :],
                        other=0.0).to(tl.float32)
            xv = tl.load(x + kk, mask=kmask, other=0.0)
            acc += tl.sum(v * xv[None, :], axis=1)
    elif KIND == 3:  # int8: the row's codes, then its float32 scale
        k = tl.arange(0, BLOCK_K)
        for start in range(0, cols, BLOCK_K):
            kk = start + k
            kmask = kk < cols
            c = tl.load(w + rows[:, None] * row_bytes + kk[None, :], mask=rmask[:, None] & kmask[None, :],
                        other=0).to(tl.int8, bitcast=True).to(tl.float32)
            xv = tl.load(x + kk, mask=kmask, other=0.0)
            acc += tl.sum(c * xv[None, :], axis=1)
        at = rows * row_bytes + cols
        s = (tl.load(w + at, mask=rmask, other=0).to(tl.uint32)
             | (tl.load(w + at + 1, mask=rmask, other=0).to(tl.uint32) << 8)
             | (tl.load(w + at + 2, mask=rmask, other=0).to(tl.uint32) << 16)
             | (tl.load(w + at + 3, mask=rmask, other=0).to(tl.uint32) << 24))
        acc = acc * s.to(tl.float32, bitcast=True)
    elif KIND == 4:  # q8_0: fp16 scale, 32 int8
        acc = _blocks_dot(w, rows, rmask, row_bytes, x, cols, KIND, 34, 2, 32, BLOCK_R, BLOCK_K // 32)
    elif KIND == 5:  # q4_0: fp16 scale, 16 bytes of nibbles (the low ones values 0-15, the high 16-31)
        acc = _blocks_dot(w, rows, rmask, row_bytes, x, cols, KIND, 18, 2, 16, BLOCK_R, BLOCK_K // 32)
    else:  # mxfp4: e8m0 scale, the same nibbles
        acc = _blocks_dot(w, rows, rmask, row_bytes, x, cols, KIND, 17, 1, 16, BLOCK_R, BLOCK_K // 32)
    return acc


@triton.jit
def gate_up(w, index, x, a, bias, cols, inter, row_bytes, expert_size, limit, alpha, KIND: tl.constexpr,
            CLAMPED: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    # program (i, r): rows r * BLOCK_R.. of the gate and the up matrices of expert index[i],
    # their activation into a[i]
    i = tl.program_id(0)
    e = tl.load(index + i).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < inter
    we = w + e * expert_size
    g = _rows_dot(we, rows, rmask, row_bytes, x, cols, KIND, BLOCK_R, BLOCK_K)
    u = _rows_dot(we, rows + inter, rmask, row_bytes, x, cols, KIND, BLOCK_R, BLOCK_K)
    if HAS_BIAS:
        g += tl.load(bias + e * 2 * inter + rows, mask=rmask, other=0.0)
        u += tl.load(bias + e * 2 * inter + inter + rows, mask=rmask, other=0.0)
    if CLAMPED:  # gpt-oss: clamp(gate, max=limit) * sigmoid(alpha * gate) * (clamp(up, +-limit) + 1)
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit) + 1.0
        act = g * tl.sigmoid(alpha * g) * u
    else:
        act = g * tl.sigmoid(g) * u
    tl.store(a + i * inter + rows, act, mask=rmask)


@triton.jit
def down(w, index, weights, a, out, bias, n, hidden, inter, row_bytes, expert_size, KIND: tl.constexpr,
         HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    # program r: rows r * BLOCK_R.. of out += sum over i, in order, of weights[i] * (down
    # rows of expert index[i] times a[i], plus its bias)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < hidden
    total = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for i in range(n):
        e = tl.load(index + i).to(tl.int64)
        y = _rows_dot(w + e * expert_size, rows, rmask, row_bytes, a + i * inter, inter, KIND, BLOCK_R, BLOCK_K)
        if HAS_BIAS:
            y += tl.load(bias + e * hidden + rows, mask=rmask, other=0.0)
        total += tl.load(weights + i) * y
    prior = tl.load(out + rows, mask=rmask, other=0.0)
    tl.store(out + rows, prior + total, mask=rmask)

